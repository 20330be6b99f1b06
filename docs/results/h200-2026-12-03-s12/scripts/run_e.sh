#!/bin/bash
# Session 12 GPU batch E: exact (working tree: sampled blocks of one-tile kernels with chunks <= 1024 columns
# score every column exactly, a quad per thread, instead of pruning) against HEAD 43e3523's kernel (tmp_gpu/v_head),
# and e2048 (the same up to 2048-column chunks; timed only): check on exact, TP=1 head / exact / e2048 alternating
# twice, TP=2 head / exact once, the LL GPU tests and the model, runtime and check GPU tests on exact.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/e
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/v_*/ll_exchange.cu >> $R/date.txt
srcdir() { if [ $1 = exact ]; then echo $PWD/csrc/ll_exchange; else echo $PWD/tmp_gpu/v_$1; fi; }
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir exact) timeout 150 python3 launch/ll_kernel_check.py > $R/check-exact.txt 2>&1
echo "check exact rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-exact.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 150 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  local pat="local_fused +graph"; case $name in tp[248]*) pat="ll_fused +graph";; esac
  grep -E "$pat" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
for i in 1 2; do
  for v in head exact e2048; do bench tp1-$v-$i $v $B; done
done
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100"
for v in head exact; do bench tp2-$v $v --tp 2 $TN; done
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir exact) timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-exact.txt 2>&1
echo "ll gpu tests exact rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-exact.txt | tail -2
s=$(date +%s)
timeout 100 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-exact.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-exact.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf e.tgz e && rm -rf e
