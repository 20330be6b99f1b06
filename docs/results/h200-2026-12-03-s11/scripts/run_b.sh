#!/bin/bash
# Session 11 GPU batch B: bsync = session 10's kernel + one barrier before pass 2 in sampled
# blocks of one tile (+ __launch_bounds__(256, 4) on the fused kernels, which keeps them at
# 64 registers); blb = the launch bound alone. TP=1 alternating with base, TP=2 once each;
# bit-exact check and the LL GPU tests on bsync.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/b
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
for v in base bsync blb; do
  nvcc -arch=sm_90 --cubin --fmad=false -std=c++17 -DTPSPEC_LL_EXCHANGE=1 -Xptxas -v -o /tmp/$v.cubin tmp_gpu/v_$v/ll_exchange.cu > $R/ptxas-$v.txt 2>&1
done
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_bsync timeout 120 python3 launch/ll_kernel_check.py > $R/check-bsync.txt 2>&1
echo "check bsync rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-bsync.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_$v timeout 150 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "(local_fused|ll_fused) +graph|local_philox_floor" $R/$name.txt | awk '{printf "%s/%s/%sx%s=%s  ", $5,$4,$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
for i in 1 2 3; do
  for v in base bsync blb; do bench tp1-$v-$i $v $B; done
done
for v in base bsync; do bench tp2-$v $v --tp 2 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100; done
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_bsync timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-bsync.txt 2>&1
echo "ll gpu tests bsync rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-bsync.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf b.tgz b && rm -rf b
