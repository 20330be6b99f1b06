#!/bin/bash
# Session 16 batch E: tmp_gpu/coresidency_diag.py under main, smem2 and smem1 (no MPS).
REPO=$PWD; R=$OUT/e; mkdir -p $R; date -u > $R/date.txt
md5sum tmp_gpu/coresidency_diag.py csrc/ll_exchange/ll_exchange.cu tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
for v in main smem2 smem1; do
  dir=$REPO; [ $v != main ] && dir=$REPO/tmp_gpu/hosts/$v
  echo "== $v"; (cd $dir && TPSPEC_LL_SOURCE_DIR=$REPO/csrc/ll_exchange PYTHONPATH=$dir timeout 100 python3 $REPO/tmp_gpu/coresidency_diag.py 2>&1 | tee $R/diag-$v.txt | grep -v Warning | tail -8)
done
date -u >> $R/date.txt; cd $OUT && tar czf e.tgz e && rm -rf e
