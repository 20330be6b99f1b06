#!/bin/bash
# Session 12 GPU batch C: gwarp (working tree: block 0 gathers a small batch's block lines a warp per row and
# reduces them with redux, no shared round trip or barrier between) against HEAD 8ba1e47 (tmp_gpu/v_redux):
# bit-exact check (150 cases), TP=1 alternating three times, TP=2 twice, TP=8 once each; the GPU tests on gwarp.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/c
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt; git status --short >> $R/date.txt
srcdir() { if [ $1 = gwarp ]; then echo $PWD/csrc/ll_exchange; else echo $PWD/tmp_gpu/v_redux; fi; }
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir gwarp) timeout 150 python3 launch/ll_kernel_check.py > $R/check-gwarp.txt 2>&1
echo "check gwarp rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-gwarp.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 150 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  local pat="local_fused +graph"; case $name in tp[248]*) pat="ll_fused +graph";; esac
  grep -E "$pat" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  grep -E "torch.max alone" $R/$name.txt | awk '{printf "%s=%s ", $3 "x" $5, $NF=="faster" ? $(NF-1) : ""} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
for i in 1 2 3; do
  for v in redux gwarp; do bench tp1-$v-$i $v $B; done
done
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100"
for i in 1 2; do
  for v in redux gwarp; do bench tp2-$v-$i $v --tp 2 $TN; done
done
for v in redux gwarp; do bench tp8-$v $v --tp 8 $TN; done
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir gwarp) timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-gwarp.txt 2>&1
echo "ll gpu tests gwarp rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-gwarp.txt | tail -2
s=$(date +%s)
timeout 120 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-gwarp.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-gwarp.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf c.tgz c && rm -rf c
