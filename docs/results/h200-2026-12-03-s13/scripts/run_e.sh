#!/bin/bash
# NOT RUN: the start was refused (too little device time left in session 13). Kept as the next step's template;
# cand2 is cand's kernel (scripts/cand-vs-25feff1-kernel.diff) with scripts/cand2-vs-52b0e85-host.diff.
# Session 13 GPU batch E (short): cand2 = batch D's cand kernel, with the host giving sampled rows 256-column chunks
# only while a row needs at most 64 of them and the call at most one block an SM (1-2 rows x 16K here); check, then
# TP=1 base / cand2 alternating twice at 1, 2, 4 and 8 rows.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/e
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/v_bexpg/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/base/tpspec/exchange/ll.py >> $R/date.txt
srcdir() { case $1 in base) echo $REPO/tmp_gpu/v_bexpg;; *) echo $REPO/csrc/ll_exchange;; esac; }
hostdir() { case $1 in base) echo $REPO/tmp_gpu/hosts/base;; *) echo $REPO;; esac; }
s=$(date +%s)
timeout 60 python3 launch/ll_kernel_check.py > $R/check-cand2.txt 2>&1
echo "check cand2 rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-cand2.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 40 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,2,4,8 --widths 16384,65536 --ag-iters 2 --timeout 35"
for i in 1 2; do for v in base cand2; do bench tp1-$v-$i $v $B; done; done
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf e.tgz e && rm -rf e
