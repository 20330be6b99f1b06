#!/bin/bash
# Session 12 GPU batch A: HEAD's kernels and host (ca6a573) -- the bit-exact check, the local stage at TP=1
# twice (the new local_torch_max row; the one-rank group's ll_exchange_keys_1), TP=2 and TP=8 once, the GPU
# tests; and a sweep of plan_chunks' smallest chunk (1024 at HEAD) at 1, 8, 64 rows, alternating with HEAD.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
export TPSPEC_LL_SOURCE_DIR=$PWD/csrc/ll_exchange
R=$OUT/a
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt; git status --short >> $R/date.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/date.txt
s=$(date +%s)
PYTHONPATH=$PWD timeout 120 python3 launch/ll_kernel_check.py > $R/check.txt 2>&1
echo "check rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check.txt)"
for m in 2048 4096 8192 16384; do
  mkdir -p /tmp/vc$m && cp -r tpspec /tmp/vc$m/
  sed -i "s/chunk = max(chunk, 1024)/chunk = max(chunk, $m)/" /tmp/vc$m/tpspec/exchange/ll.py
  grep -c "chunk = max(chunk, $m)" /tmp/vc$m/tpspec/exchange/ll.py
done
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 path=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  PYTHONPATH=$path timeout 150 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  local pat="local_fused +graph|local_torch_max"; case $name in tp[248]*) pat="ll_fused +graph|ll_max_keys|ll_argmax_tokens";; esac
  grep -E "$pat" $R/$name.txt | awk '{printf "%s/%s/%sx%s=%s ", $5,substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
bench tp1-head-1 $PWD $B
S="--tp 1 --rows 1,8,64 --widths 16384,65536 --ag-iters 2 --timeout 100"
for i in 1 2; do
  bench sweep-1024-$i $PWD $S
  for m in 2048 4096 8192 16384; do bench sweep-$m-$i /tmp/vc$m $S; done
done
bench tp1-head-2 $PWD $B
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100"
bench tp2-head $PWD --tp 2 $TN
bench tp8-head $PWD --tp 8 $TN
s=$(date +%s)
PYTHONPATH=$PWD timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu.txt | tail -2
s=$(date +%s)
PYTHONPATH=$PWD timeout 120 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf a.tgz a && rm -rf a
