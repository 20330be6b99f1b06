#!/bin/bash
# Session 9 GPU batch D: greedy blocks per SM 4 (tmp_gpu/pkg4, run from inside it so that its
# tpspec copy is imported) vs 2, TP=1 alternating; TP=8 base vs new alternating; checks and
# the LL GPU tests with 4.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
ROOT=$PWD
R=$OUT/d
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
(cd tmp_gpu/pkg4 && PYTHONPATH=$ROOT/tmp_gpu/pkg4 python3 -c "import tpspec.exchange.ll as l; print('pkg4 uses', l.__file__, l.GREEDY_BLOCKS_PER_SM)")
bench() {
  local name=$1 dir=$2 src=$3; shift 3
  local o=/tmp/b-$name
  (cd $dir && PYTHONPATH=$dir TPSPEC_LL_SOURCE_DIR=$src timeout 120 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1)
  echo "== $name rc=$?"; grep -E "ll_max_keys +graph|ll_argmax_tokens +graph|local_fused +graph|ll_fused +graph" $R/$name.txt | awk '{printf "%s/%s/%s/%s=%s  ", $5,$2,$3,$4,$7} END {print ""}'
  grep -i "streaming" $R/$name.txt | head -2
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
T1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
P4=$ROOT/tmp_gpu/pkg4; SRC=$ROOT/csrc/ll_exchange
for i in 1 2; do bench tp1-plan4-$i $P4 $SRC $T1; bench tp1-plan2-$i $ROOT $SRC $T1; done
for i in 1 2; do bench tp8-new-$i $ROOT $SRC --tp 8 $TN; bench tp8-base-$i $ROOT $ROOT/tmp_gpu/v_base --tp 8 $TN; done
(cd $P4 && PYTHONPATH=$P4 TPSPEC_LL_SOURCE_DIR=$SRC timeout 100 python3 $ROOT/launch/ll_kernel_check.py > $R/check-plan4.txt 2>&1; echo "check rc=$?"; tail -1 $R/check-plan4.txt)
s=$(date +%s)
(cd $P4 && PYTHONPATH=$P4 TPSPEC_LL_SOURCE_DIR=$SRC timeout 200 python3 -m pytest -v -p no:cacheprovider --rootdir=$ROOT -c $ROOT/pyproject.toml $ROOT/tests/test_ll_gpu.py > $R/ll-gpu-plan4.txt 2>&1; echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-plan4.txt | tail -2)
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf d.tgz d && rm -rf d
