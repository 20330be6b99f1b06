#!/bin/bash
# Session 13 GPU batch B: pre2 (working tree: bexpg, plus each sampled block of the one-tile kernels loads its
# first values beside the row's inputs instead of after the test of the row's temperature: the exact path's quad
# and the pruned path's first tile; one-tile kernels held to 64 registers) against bexpg (batch A's, tmp_gpu/v_bexpg)
# and pre (the exact path's quad only, tmp_gpu/v_pre). Check on pre and pre2; TP=1 alternating 3 times; the GPU tests
# on pre2; TP=2 all three; TP=4 and TP=8 on pre2, then on bexpg while time remains.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/b
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/v_*/ll_exchange.cu tpspec/exchange/ll.py >> $R/date.txt
srcdir() { case $1 in pre2) echo $PWD/csrc/ll_exchange;; *) echo $PWD/tmp_gpu/v_$1;; esac; }
for v in pre pre2; do
  s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 120 python3 launch/ll_kernel_check.py > $R/check-$v.txt 2>&1
  echo "check $v rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-$v.txt)"
done
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  local pat="local_fused +graph"; case $name in tp[248]*) pat="ll_fused +graph";; esac
  grep -E "$pat" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 90"
for i in 1 2 3; do
  for v in bexpg pre pre2; do bench tp1-$v-$i $v $B; done
done
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir pre2) timeout 130 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-pre2.txt 2>&1
echo "ll gpu tests pre2 rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-pre2.txt | tail -2
s=$(date +%s)
timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-pre2.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-pre2.txt | tail -2
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 90"
for v in bexpg pre pre2; do bench tp2-$v $v --tp 2 $TN; done
for n in 4 8; do
  for v in pre2 bexpg; do
    [ $(( $(date +%s) - T0 )) -lt 480 ] && bench tp$n-$v $v --tp $n $TN
  done
done
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf b.tgz b && rm -rf b
