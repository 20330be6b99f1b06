#!/bin/bash
# Session 11 GPU batch A: the sampled rows' later-tile word limit (new = working tree) against
# session 10's kernel (base) at TP=1, alternating; sync = new + one barrier before pass 2 in
# blocks of one tile; new with 2 sampled blocks per SM; bit-exact checks; resource usage.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/a
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv >> $R/date.txt
nvcc --version | tail -1 >> $R/date.txt
python3 -c "import cupy; print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())" >> $R/date.txt 2>&1
for v in base new sync; do
  src=tmp_gpu/v_$v/ll_exchange.cu; [ $v = new ] && src=csrc/ll_exchange/ll_exchange.cu
  nvcc -arch=sm_90 --cubin --fmad=false -std=c++17 -DTPSPEC_LL_EXCHANGE=1 -Xptxas -v -o /tmp/$v.cubin $src > $R/ptxas-$v.txt 2>&1
done
grep -A3 "argmax_logits_bf16" $R/ptxas-*.txt | grep -E "Used|spill"
srcdir() { if [ $1 = new ]; then echo csrc/ll_exchange; else echo tmp_gpu/v_$1; fi; }
for v in new sync; do
  s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 120 python3 launch/ll_kernel_check.py > $R/check-$v.txt 2>&1
  echo "check $v rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-$v.txt)"
done
ls ~/.cupy/kernel_cache/ 2>/dev/null | head -3 > $R/kernel-cache.txt
for f in ~/.cupy/kernel_cache/*.cubin; do cuobjdump -res-usage $f 2>/dev/null | grep -A1 argmax_logits_bf16; done >> $R/kernel-cache.txt 2>&1
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 150 python3 "$@" --out $o > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph|local_philox_floor" $R/$name.txt | awk '{printf "%s/%sx%s=%s  ", $4,$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="-m tpspec bench exchange --tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
for i in 1 2; do
  for v in base new sync; do bench tp1-$v-$i $v $B; done
done
BPS=2 bench tp1-new-bps2 new tmp_gpu/bench_bps.py bench exchange --tp 1 --rows 64,256 --widths 16384,65536 --ag-iters 2 --timeout 100
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf a.tgz a && rm -rf a
