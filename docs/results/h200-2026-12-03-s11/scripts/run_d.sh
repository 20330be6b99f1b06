#!/bin/bash
# Session 11 GPU batch D: the committed candidate (working tree: the fused kernels' _one_tile twins,
# picked by the host for sampled calls whose chunks fit one tile) against session 10's kernels
# (tmp_gpu/v_base1: the same kernels also under the _one_tile names), TP=1 alternating three
# times, TP=2 once each, TP=4/8 once; bit-exact check, the LL GPU tests, model/runtime/check tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/d
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt; git status --short >> $R/date.txt
nvcc -arch=sm_90 --cubin --fmad=false -std=c++17 -DTPSPEC_LL_EXCHANGE=1 -Xptxas -v -o /tmp/new.cubin csrc/ll_exchange/ll_exchange.cu > $R/ptxas-new.txt 2>&1
s=$(date +%s)
timeout 120 python3 launch/ll_kernel_check.py > $R/check-new.txt 2>&1
echo "check new rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-new.txt)"
nvidia-cuda-mps-control -d; sleep 1
srcdir() { if [ $1 = new ]; then echo csrc/ll_exchange; else echo tmp_gpu/v_$1; fi; }
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 150 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  local pat="local_fused +graph"; case $name in tp[248]*) pat="ll_fused +graph";; esac
  grep -E "$pat" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
for i in 1 2 3; do
  for v in base1 new; do bench tp1-$v-$i $v $B; done
done
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100"
for v in base1 new; do bench tp2-$v $v --tp 2 $TN; done
bench tp4-new new --tp 4 $TN
bench tp8-new new --tp 8 $TN
s=$(date +%s)
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-new.txt 2>&1
echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-new.txt | tail -2
s=$(date +%s)
timeout 120 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-new.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-new.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf d.tgz d && rm -rf d
