#!/bin/bash
# Session 8 GPU batch B: timings (sweep + give-up flag vs session 7's behaviour), the
# Gumbel prefetch variant, Philox compute alone, ncu of the fused kernel.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog $OUT/b
R=$OUT/b
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 dir=$2; shift 2
  local o=/tmp/b-$name
  if [ -n "$dir" ]; then export TPSPEC_LL_SOURCE_DIR=$dir; else unset TPSPEC_LL_SOURCE_DIR; fi
  timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$?"; grep -E "ll_max_keys +graph|ll_fused +graph|local_fused +graph" $R/$name.txt | awk '{printf "%s/%s/%s/%s=%s  ", $2,$3,$4,$5,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_nosweep timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_ll_gpu.py -k epoch_wrap -vv > $R/epoch-nosweep.txt 2>&1
echo "epoch test with the sweep disabled rc=$? (must fail)"; grep -oE "'[0-9]+ (slot|block) lines left[^']*'|'epoch [0-9] after the wrap" $R/epoch-nosweep.txt | sort | uniq -c
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_ll_gpu.py -k epoch_wrap > $R/epoch-new.txt 2>&1; echo "epoch test rc=$?"; tail -1 $R/epoch-new.txt
T1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
for i in 1 2; do
  bench tp2-new-$i "" --tp 2 $TN; bench tp2-s7-$i tmp_gpu/v_s7 --tp 2 $TN; bench tp2-errpoll-$i tmp_gpu/v_errpoll --tp 2 $TN
done
bench tp4-new "" --tp 4 $TN; bench tp4-s7 tmp_gpu/v_s7 --tp 4 $TN
bench tp8-new "" --tp 8 $TN; bench tp8-s7 tmp_gpu/v_s7 --tp 8 $TN
for i in 1 2; do bench tp1-new-$i "" $T1; bench tp1-prefetch-$i tmp_gpu/v_prefetch $T1; done
echo quit | nvidia-cuda-mps-control
unset TPSPEC_LL_SOURCE_DIR
timeout 60 python3 tmp_gpu/philox_compute.py > $R/philox-compute.txt 2>&1; echo "philox rc=$?"; cat $R/philox-compute.txt
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for shape in "1 16384 gumbel" "1 16384 greedy" "256 65536 gumbel"; do
  set -- $shape; n=ncu-$1x$2-$3
  timeout 90 $NCU --set full -k regex:ll_argmax_logits_bf16 --launch-skip 20 --launch-count 1 -f -o $R/$n python3 tmp_gpu/prof_one.py $1 $2 $3 > $R/$n.log 2>&1
  echo "$n rc=$?"
  $NCU -i $R/$n.ncu-rep --page source --csv --print-source sass > $R/$n-sass.csv 2>/dev/null
  $NCU -i $R/$n.ncu-rep --page details > $R/$n-details.txt 2>/dev/null
  grep -E "Duration|Registers|Achieved Occupancy|Warp Cycles Per Issued" $R/$n-details.txt | head -6
done
date -u >> $R/date.txt
cd $OUT && tar czf b.tgz b && rm -rf b
