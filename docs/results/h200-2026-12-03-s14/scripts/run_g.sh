#!/bin/bash
# Session 14 GPU batch G. Kernel: branch wip/columns-twin (csrc, working tree) for every variant.
#   base:  host of the branch HEAD (greedy: 2 blocks an SM, at least 1024 columns a chunk).
#   gsNNN: greedy calls under about an SM's worth of blocks take isqrt(bytes / NNN) blocks
#          (per-block cost against per-SM streaming); 2 blocks an SM above. gs256 = the working tree.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/g
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
hostdir() { echo $REPO/tmp_gpu/hosts/$1; }
for v in base gs256 gs128 gs512; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "
import tpspec.exchange.ll as L
print('$v', L.__file__, [(r, c, L.plan_chunks(r, c, 2, 132, False)) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256) for c in (16384, 65536)])") >> $R/date.txt 2>&1
done
s=$(date +%s)
(PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py) > $R/check-cols.txt 2>&1
echo "check cols rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-cols.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD TPSPEC_LL_SOURCE_DIR=$REPO/csrc/ll_exchange timeout 80 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | grep greedy | awk '{printf "%sx%s=%s ", $2,$3,$7} END {print ""}'
  grep -E "local_read_floor +graph" $R/$name.txt | awk '{printf "rf%sx%s=%s ", $2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,2,4,8,16,32,64,128,256 --widths 16384,65536 --ag-iters 2 --timeout 70"
for i in 1 2; do for v in base gs256 gs128 gs512; do bench tp1-$v-$i $v $B; done; done
for v in base gs256; do [ $(( $(date +%s) - T0 )) -lt 260 ] && bench tp1-$v-3 $v $B; done
s=$(date +%s)
timeout 130 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-gs256.txt 2>&1
echo "ll gpu tests (cols + gs256) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-gs256.txt | tail -2
s=$(date +%s)
timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-gs256.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-gs256.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf g.tgz g && rm -rf g
