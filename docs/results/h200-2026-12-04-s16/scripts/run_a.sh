#!/bin/bash
# Session 16 batch A (was session 15's run_p.sh template; plus tmp_gpu/reader_probe.py). (session 15's device time was spent). The next batch's template: rgC, a kernel-only variant of main c54f3e8
# (scripts/rgC-vs-c54f3e8-kernel.diff): the _columns kernels poll 4 block lines a lane only for rows of more than 64
# chunks (1 x 32K, 1 x 64K), 2 otherwise, to win back the 0.05 us the wider gather cost 1 x 16K (3.02 -> 3.07).
# Only the three _columns kernels' sm_90 code differs from main (checked locally with nvcc). Set up before running:
#   mkdir -p tmp_gpu/kern/rgC && cp csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/rgC/
#   (cd tmp_gpu/kern/rgC && patch -p3 < ../../../docs/results/h200-2026-12-04-s15/scripts/rgC-vs-c54f3e8-kernel.diff)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/a
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/*/ll_exchange.cu tpspec/exchange/ll.py >> $R/date.txt
srcdir() { case $1 in base) echo $REPO/csrc/ll_exchange;; *) echo $REPO/tmp_gpu/kern/$1;; esac; }
nvidia-cuda-mps-control -d; sleep 1
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir rgC) PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py > $R/check-rgC.txt 2>&1
echo "check rgC rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-rgC.txt)"
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir rgC) PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py --shapes 1x16384,2x16384,3x16384,1x32768,1x65536,1x40000 > $R/check-rgC-shapes.txt 2>&1
echo "check rgC (columns shapes) rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-rgC-shapes.txt)"
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 80 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,2,3,4,8 --widths 16384,32768,65536 --ag-iters 2 --timeout 70"
for i in 1 2 3; do for v in base rgC; do bench tp1-$v-$i $v $B; done; done
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir rgC) timeout 140 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-rgC.txt 2>&1
echo "ll gpu tests (rgC) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-rgC.txt | tail -2
s=$(date +%s)
timeout 150 python3 tmp_gpu/reader_probe.py 2 > $R/reader-probe.txt 2>&1
echo "reader probe rc=$? $(( $(date +%s) - s )) s"; grep -E "copy|FAILED" $R/reader-probe.txt | head -5
for i in 1 2; do bench tp1-256x64K-$i base --tp 1 --rows 256 --widths 65536 --ag-iters 2 --timeout 70; done
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf a.tgz a && rm -rf a
