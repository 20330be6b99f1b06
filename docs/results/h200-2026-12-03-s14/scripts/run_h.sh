#!/bin/bash
# Session 14 GPU batch H (greedy: fewer waits, fewer blocks).
#   cols:   branch wip/columns-twin's kernel (tmp_gpu/v_cols) and host (tmp_gpu/hosts/base).
#   t3:     working-tree kernel: greedy_span loads its last (< 4) packs together, then ranks them; host as cols.
#   t3b32:  t3 + host tmp_gpu/hosts/b32k: greedy calls take one block per 32 KiB of logits, at least SMs/2 blocks,
#           at most 2 an SM (= the working tree).
#   t3gs:   t3 + batch G's gs256 host (isqrt(bytes / 256) blocks below one an SM).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/h
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/v_cols/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
srcdir() { case $1 in cols) echo $REPO/tmp_gpu/v_cols;; *) echo $REPO/csrc/ll_exchange;; esac; }
hostdir() { case $1 in cols|t3) echo $REPO/tmp_gpu/hosts/base;; t3b32) echo $REPO/tmp_gpu/hosts/b32k;; t3gs) echo $REPO/tmp_gpu/hosts/gs256;; esac; }
for v in cols t3 t3b32 t3gs; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "
import tpspec.exchange.ll as L
print('$v', L.__file__, [(r, c, L.plan_chunks(r, c, 2, 132, False)) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256) for c in (16384, 65536)])") >> $R/date.txt 2>&1
done
s=$(date +%s)
(PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py) > $R/check-t3.txt 2>&1
echo "check t3 rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-t3.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 80 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | grep greedy | awk '{printf "%sx%s=%s ", $2,$3,$7} END {print ""}'
  grep -E "local_read_floor +graph" $R/$name.txt | awk '{printf "rf%sx%s=%s ", $2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,2,4,8,16,32,64,128,256 --widths 16384,65536 --ag-iters 2 --timeout 70"
for i in 1 2 3; do for v in cols t3 t3b32; do bench tp1-$v-$i $v $B; done; done
[ $(( $(date +%s) - T0 )) -lt 200 ] && bench tp1-t3gs-1 t3gs $B
s=$(date +%s)
timeout 130 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-t3b32.txt 2>&1
echo "ll gpu tests (t3b32) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-t3b32.txt | tail -2
s=$(date +%s)
timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-t3b32.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-t3b32.txt | tail -2
[ $(( $(date +%s) - T0 )) -lt 360 ] && bench tp2-t3b32 t3b32 --tp 2 --rows 1,2,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 60
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf h.tgz h && rm -rf h
