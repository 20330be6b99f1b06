#!/bin/bash
# NOT RUN (session 17's device time was spent). The next batch's template, for the Gumbel gap at 64-256 rows: there
# the fused call takes 2.2-2.9x greedy while reading the slice plus every column's Philox block alone takes
# 1.05-1.28x (local_philox_floor, batch J), so the pruned path's work beyond Philox costs more than Philox itself.
# Session 3 profiled it at 256 x 64K (192 instructions a warp-quad, 29 % of stalls at barriers); the kernel has
# changed a lot since. This profiles today's kernel at three shapes with session 8's driver (one rank, 20 warm-up
# launches, the 21st profiled), plus the reads + Philox floor, so the next session can see which phase to cut.
REPO=$PWD; R=$OUT/next; mkdir -p $R; date -u > $R/date.txt; md5sum csrc/ll_exchange/ll_exchange.cu >> $R/date.txt
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
DRIVER=docs/results/h200-2026-12-03-s8/variants/prof_one.py
for shape in "256 16384 gumbel" "64 65536 gumbel" "128 16384 gumbel" "256 16384 greedy"; do
  set -- $shape; n=ncu-$1x$2-$3
  timeout 120 $NCU --set full -k regex:ll_argmax_logits_bf16 --launch-skip 20 --launch-count 1 -f -o $R/$n \
    python3 $DRIVER $1 $2 $3 > $R/$n.log 2>&1
  echo "$n rc=$?"
  $NCU -i $R/$n.ncu-rep --page source --csv --print-source sass > $R/$n-sass.csv 2>/dev/null
  $NCU -i $R/$n.ncu-rep --page details > $R/$n-details.txt 2>/dev/null
  grep -E "Duration|Registers|Achieved Occupancy|Warp Cycles Per Issued|Executed Ipc" $R/$n-details.txt | head -8
done
export PYTHONUNBUFFERED=1 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d; sleep 1
timeout 100 python3 -m tpspec bench exchange --out /tmp/b-next --tp 1 --rows 64,128,256 --widths 16384,65536 \
  --ag-iters 2 --timeout 70 > $R/bench.txt 2>&1; echo "bench rc=$?"; grep "local stage" $R/bench.txt
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt
cd $OUT && tar czf next.tgz next && rm -rf next
