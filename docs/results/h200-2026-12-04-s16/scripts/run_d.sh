#!/bin/bash
# Session 16 batch D: does main's fused kernel stay exact when its blocks cannot all be resident at once?
# Host variants smem2 / smem1 pad each fused block with 80 / 130 KiB of unused dynamic shared memory (2 / 1
# blocks an SM), main's kernel; launch/ll_kernel_check.py (150 cases). Then grp's check again without MPS.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/d; mkdir -p $R; date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/grp/ll_exchange.cu tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
for v in smem2 smem1; do
  s=$(date +%s); (cd tmp_gpu/hosts/$v && TPSPEC_LL_SOURCE_DIR=$REPO/csrc/ll_exchange PYTHONPATH=$PWD timeout 150 python3 $REPO/launch/ll_kernel_check.py > $R/check-$v.txt 2>&1)
  echo "check $v rc=$? $(( $(date +%s) - s )) s"; grep -E "MISMATCH|check:|Error" $R/check-$v.txt | head -8
done
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$REPO/tmp_gpu/kern/grp PYTHONPATH=$REPO timeout 100 python3 launch/ll_kernel_check.py > $R/check-grp.txt 2>&1
echo "check grp (no MPS) rc=$? $(( $(date +%s) - s )) s"; grep -E "MISMATCH|check:|Error" $R/check-grp.txt | head -8
date -u >> $R/date.txt; cd $OUT && tar czf d.tgz d && rm -rf d
