#!/bin/bash
# Session 10 GPU batch D: ll_exchange_keys polling 1 / 4 / 8 peer lines at once for TP=2 / 3-5 / 6+ (v_wb)
# alternating at TP=2 and 4, once at TP=8; the LL GPU tests on v_wb.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/d
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_$v timeout 120 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "ll_max_keys|ll_argmax_tokens" $R/$name.txt | grep graph | awk '{printf "%s/%s=%s  ", substr($5,4),$2,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
T8="--tp 8 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100"
T4="--tp 4 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
T2="--tp 2 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
for i in 1 2; do bench tp2-wb-$i wb $T2; bench tp2-base-$i base $T2; done
for i in 1 2; do bench tp4-wb-$i wb $T4; bench tp4-base-$i base $T4; done
bench tp8-wb-1 wb $T8
export TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_wb
s=$(date +%s)
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-wb.txt 2>&1; echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|PASS|FAIL" $R/ll-gpu-wb.txt | tail -10
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf d.tgz d && rm -rf d
