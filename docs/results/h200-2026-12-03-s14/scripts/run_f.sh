#!/bin/bash
# Session 14 GPU batch F.
#   base:  main 9478d4e (kernel tmp_gpu/v_base, host tmp_gpu/hosts/base; sm_90 code as 25feff1).
#   cols:  branch wip/columns-twin (working tree): _columns kernels for sampled chunks <= 256 columns,
#          planned only while rows * column chunks <= SMs (1-2 rows x 16K).
#   gsm1:  base, greedy one block an SM (GREEDY_BLOCKS_PER_SM = 1).
#   ghalf: base, greedy at most half an SM's worth of blocks (64+ rows: one block a row).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/f
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/v_base/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
srcdir() { case $1 in cols) echo $REPO/csrc/ll_exchange;; *) echo $REPO/tmp_gpu/v_base;; esac; }
hostdir() { case $1 in cols) echo $REPO;; *) echo $REPO/tmp_gpu/hosts/$1;; esac; }
for v in base cols gsm1 ghalf; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "
import tpspec.exchange.ll as L
print('$v', L.__file__, [(r, c, s, L.plan_chunks(r, c, 2, 132, s), L.fused_kernel_name(__import__('torch').bfloat16, L.plan_chunks(r, c, 2, 132, s)[0], s)) for s in (False, True) for r, c in ((1, 16384), (2, 16384), (4, 16384), (8, 16384), (1, 65536), (8, 65536), (64, 16384))])") >> $R/date.txt 2>&1
done
s=$(date +%s)
timeout 90 python3 launch/ll_kernel_check.py > $R/check-cols.txt 2>&1
echo "check cols rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-cols.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 80 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,2,4,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 70"
for i in 1 2 3; do for v in base cols; do bench tp1-$v-$i $v $B; done; done
G="--tp 1 --rows 8,16,32,64,128 --widths 16384,65536 --ag-iters 2 --timeout 70"
for i in 1 2; do for v in base gsm1 ghalf; do [ $(( $(date +%s) - T0 )) -lt 300 ] && bench g-$v-$i $v $G; done; done
s=$(date +%s)
timeout 130 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-cols.txt 2>&1
echo "ll gpu tests cols rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-cols.txt | tail -2
s=$(date +%s)
timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-cols.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-cols.txt | tail -2
TN="--rows 1,2,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 60"
for v in cols base; do [ $(( $(date +%s) - T0 )) -lt 520 ] && bench tp2-$v $v --tp 2 $TN; done
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf f.tgz f && rm -rf f
