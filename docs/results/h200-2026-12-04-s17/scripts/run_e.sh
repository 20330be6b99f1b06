#!/bin/bash
# Session 17, batch E: rlx (scripts/rlx-vs-80c044b-kernel.diff: the fused kernel's block lines, its other blocks'
# epoch read (thread 0 only) and the step-counter read use .relaxed.gpu instead of .volatile), checked, timed
# against main twice at TP=1 and once at TP=2, and the LL GPU tests on it. Kernel under tmp_gpu/kern/rlx/.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/e; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/rlx/ll_exchange.cu tpspec/exchange/ll.py >> $R/date.txt
kdir() { case $1 in base) echo $REPO/csrc/ll_exchange;; *) echo $REPO/tmp_gpu/kern/$1;; esac; }
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$(kdir rlx) timeout 90 python3 launch/ll_kernel_check.py > $R/check-rlx.txt 2>&1
echo "check rlx rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-rlx.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name kernel tp rows widths
  local s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(kdir $2) timeout 80 python3 -m tpspec bench exchange --out /tmp/b-$1 --tp $3 --rows $4 \
     --widths $5 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_(fused|read_floor) +graph" $R/$1.txt | awk '{printf "%s/%s/%sx%s=%s ", substr($5,7,4),substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
for i in 1 2; do
  bench base-$i base 1 1,8,64,128,256 16384,65536; bench rlx-$i rlx 1 1,8,64,128,256 16384,65536
done
bench tp2-base base 2 1,8,64,256 16384; bench tp2-rlx rlx 2 1,8,64,256 16384
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$(kdir rlx) timeout 170 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-rlx.txt 2>&1
echo "ll gpu tests (rlx) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-rlx.txt | tail -2
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf e.tgz e && rm -rf e
