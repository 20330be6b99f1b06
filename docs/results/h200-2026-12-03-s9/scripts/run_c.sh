#!/bin/bash
# Session 9 GPU batch C: greedy blocks per SM 4 (tmp_gpu/pkg4) vs 2 on the session 9 kernel, TP=1
# alternating; checks and the LL GPU tests with 4; TP=8 and TP=2 reruns of the session 9 kernel.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/c
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 pp=$2; shift 2
  local o=/tmp/b-$name
  PYTHONPATH=$pp TPSPEC_LL_SOURCE_DIR=$PWD/csrc/ll_exchange timeout 120 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$?"; grep -E "ll_max_keys +graph|ll_argmax_tokens +graph|local_fused +graph|ll_fused +graph|local_read_floor" $R/$name.txt | awk '{printf "%s/%s/%s/%s=%s  ", $5,$2,$3,$4,$7} END {print ""}'
  grep -i -A3 "streaming" $R/$name.txt | head -5
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
T1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
for i in 1 2; do bench tp1-plan2-$i $PWD $T1; bench tp1-plan4-$i $PWD/tmp_gpu/pkg4 $T1; done
bench tp8-new-2 $PWD --tp 8 $TN
bench tp2-new-3 $PWD --tp 2 $TN
export PYTHONPATH=$PWD/tmp_gpu/pkg4:$PWD TPSPEC_LL_SOURCE_DIR=$PWD/csrc/ll_exchange
python3 -c "import tpspec.exchange.ll as l; print('plan module', l.__file__, l.GREEDY_BLOCKS_PER_SM)"
timeout 100 python3 launch/ll_kernel_check.py > $R/check-plan4.txt 2>&1; echo "check rc=$?"; tail -1 $R/check-plan4.txt
s=$(date +%s)
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-plan4.txt 2>&1; echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-plan4.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf c.tgz c && rm -rf c
