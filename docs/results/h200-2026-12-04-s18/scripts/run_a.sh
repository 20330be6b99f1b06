#!/bin/bash
# Session 18, batch A: ncu --set full of the fused kernel's sampled path (randn * 3, T = 0.8, the bench's inputs) at
# 256 x 16K, 64 x 64K, 128 x 16K, the same 256 x 16K greedy, and the reads + Philox floor kernel at 256 x 16K; then
# the TP=1 bench at 64-256 rows. Run from the repository root.
REPO=$PWD; R=$OUT/a; mkdir -p $R; date -u > $R/date.txt; md5sum csrc/ll_exchange/ll_exchange.cu >> $R/date.txt
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
DRIVER=docs/results/h200-2026-12-04-s18/scripts/prof_one.py
for shape in "256 16384 gumbel" "64 65536 gumbel" "128 16384 gumbel" "256 16384 greedy" "256 16384 floor"; do
  set -- $shape; n=ncu-$1x$2-$3
  PYTHONPATH=$REPO timeout 150 $NCU --set full --import-source yes -k "regex:ll_argmax_logits_bf16|ll_philox_floor" \
    --launch-skip 20 --launch-count 1 -f -o $R/$n python3 $DRIVER $1 $2 $3 > $R/$n.log 2>&1
  echo "$n rc=$?"
  $NCU -i $R/$n.ncu-rep --page source --csv --print-source sass > $R/$n-sass.csv 2>/dev/null
  $NCU -i $R/$n.ncu-rep --page details > $R/$n-details.txt 2>/dev/null
  grep -E " Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Executed Ipc A|Issue Slots Busy" $R/$n-details.txt | head -8
done
date -u >> $R/date.txt
export PYTHONUNBUFFERED=1 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d; sleep 1
PYTHONPATH=$REPO timeout 120 python3 -m tpspec bench exchange --out /tmp/b-a --tp 1 --rows 64,128,256 \
  --widths 16384,65536 --ag-iters 2 --timeout 70 > $R/bench.txt 2>&1; echo "bench rc=$?"
grep -E "local_(fused|philox_floor|read_floor)" $R/bench.txt
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt
cd $OUT && tar czf a.tgz a && rm -rf a
