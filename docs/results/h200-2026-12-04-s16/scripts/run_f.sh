#!/bin/bash
# Session 16 batch F: kernel "last" (tmp_gpu/last-vs-main-kernel.diff: the collector runs in the grid's last block).
# Bit-exactness (check), the co-residency diagnostic and check under smem2/smem1 hosts, bench TP=1/TP=2 main vs last
# alternating, LL GPU tests on last.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/f; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/last/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
K=$REPO/tmp_gpu/kern/last
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$K PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py > $R/check-last.txt 2>&1
echo "check last rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-last.txt)"
for v in smem2 smem1; do
  (cd tmp_gpu/hosts/$v && TPSPEC_LL_SOURCE_DIR=$K PYTHONPATH=$PWD timeout 60 python3 $REPO/tmp_gpu/coresidency_diag.py > $R/diag-last-$v.txt 2>&1; echo "diag last/$v rc=$?"; grep -o "blocks=[0-9]*.*missing=[0-9]*" $R/diag-last-$v.txt)
done
s=$(date +%s); (cd tmp_gpu/hosts/smem1 && TPSPEC_LL_SOURCE_DIR=$K PYTHONPATH=$PWD timeout 90 python3 $REPO/launch/ll_kernel_check.py > $R/check-last-smem1.txt 2>&1)
echo "check last/smem1 rc=$? $(( $(date +%s) - s )) s: $(grep -E 'MISMATCH|check:|Error' $R/check-last-smem1.txt | head -3)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name kerneldir args...
  local name=$1 k=$2; shift 2; local s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$k timeout 80 python3 -m tpspec bench exchange --out /tmp/b-$name "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "(local_fused|ll_fused) +graph" $R/$name.txt | awk '{printf "%s/%s/%sx%s=%s ", $5,substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$name/exchange.json $R/$name.json 2>/dev/null
}
B1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 70"
B2="--tp 2 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 70"
for i in 1 2; do bench tp1-main-$i $REPO/csrc/ll_exchange $B1; bench tp1-last-$i $K $B1; done
for i in 1 2; do bench tp2-main-$i $REPO/csrc/ll_exchange $B2; bench tp2-last-$i $K $B2; done
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$K timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-last.txt 2>&1
echo "ll gpu tests (last) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-last.txt | tail -2
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf f.tgz f && rm -rf f
