#!/bin/bash
# Session 10 GPU batch A: staggered polling in ll_exchange_keys (LL_POLL_DEPTH polls of a line in
# flight, LL_POLL_GAP_CYCLES apart) against the session 9 kernel, TP=2 alternating, TP=4/8 once;
# the SASS of the wait loop; the multi-rank equality test on two variants.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/a
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv >> $R/date.txt
which nvcc cuobjdump nvdisasm >> $R/date.txt 2>&1
if which nvcc >/dev/null 2>&1 && which cuobjdump >/dev/null 2>&1; then
  for v in base d2g384; do
    nvcc -arch=sm_90 --cubin --fmad=false -std=c++17 -DTPSPEC_LL_EXCHANGE=1 -o /tmp/$v.cubin tmp_gpu/v_$v/ll_exchange.cu && \
      cuobjdump -sass -fun ll_exchange_keys /tmp/$v.cubin > $R/sass-$v.txt 2>&1
  done
fi
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_$v timeout 120 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "ll_max_keys|ll_argmax_tokens" $R/$name.txt | grep graph | awk '{printf "%s/%s=%s  ", substr($5,4),$2,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
T2="--tp 2 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
for i in 1 2; do
  for v in base d2g192 d2g384 d3g192 d4g128; do bench tp2-$v-$i $v $T2; done
done
T4="--tp 4 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
for v in base d2g384 d3g192; do bench tp4-$v $v $T4; done
T8="--tp 8 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100"
for v in d3g192 base; do bench tp8-$v $v $T8; done
for v in d2g384 d3g192; do
  s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_$v timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ll_gpu.py -k "equals_allgather" > $R/eq-$v.txt 2>&1
  echo "equality test $v rc=$? $(( $(date +%s) - s )) s"; tail -1 $R/eq-$v.txt
done
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf a.tgz a && rm -rf a
