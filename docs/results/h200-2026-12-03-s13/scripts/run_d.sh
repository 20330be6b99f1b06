#!/bin/bash
# Session 13 GPU batch D. Host variants now run from their own folder (python -m puts the working directory ahead of
# PYTHONPATH, so batch A's m512 / m256 and session 12's minimum chunk sweep timed the unmodified host).
#   base:   HEAD 52b0e85 (kernel tmp_gpu/v_bexpg = 25feff1's, host tmp_gpu/hosts/base).
#   cand:   working tree: kernel scores chunks of at most 256 columns a column a thread (scalar_span); host plans
#           sampled rows down to 256-column chunks, at most 64 a row while chunks stay <= 1024 columns.
#   m256q:  cand's host with base's kernel (256-column chunks, a quad a thread: 64 busy threads a block).
#   col1nc: cand's kernel, host without the 64-chunk limit (1 x 64K: 256 chunks, block 0's old gather).
#   g4096 / g16384: cand, with greedy rows' smallest chunk 4096 / 16384 columns (16384: one block a 16K row).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/d
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/v_bexpg/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
srcdir() { case $1 in base|m256q) echo $REPO/tmp_gpu/v_bexpg;; *) echo $REPO/csrc/ll_exchange;; esac; }
hostdir() { case $1 in base|col1nc|g4096|g16384) echo $REPO/tmp_gpu/hosts/$1;; *) echo $REPO;; esac; }
for v in base cand m256q col1nc g4096 g16384; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "
import tpspec.exchange.ll as L
print('$v', L.__file__, [(r, c, s, L.plan_chunks(r, c, 2, 132, s)) for s in (False, True) for r, c in ((1, 16384), (1, 65536), (8, 16384))])") >> $R/date.txt 2>&1
done
for v in cand col1nc; do
  s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 120 python3 $REPO/launch/ll_kernel_check.py) > $R/check-$v.txt 2>&1
  echo "check $v rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-$v.txt)"
done
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 100 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 90"
for i in 1 2; do
  for v in base cand m256q col1nc g4096 g16384; do bench tp1-$v-$i $v $B; done
done
s=$(date +%s)
timeout 130 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-cand.txt 2>&1
echo "ll gpu tests cand rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-cand.txt | tail -2
s=$(date +%s)
timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-cand.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-cand.txt | tail -2
for v in base cand; do [ $(( $(date +%s) - T0 )) -lt 420 ] && bench tp1-$v-3 $v $B; done
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 90"
[ $(( $(date +%s) - T0 )) -lt 440 ] && bench tp2-cand cand --tp 2 $TN
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf d.tgz d && rm -rf d
