#!/bin/bash
# Session 17, batch I: why the _cluster twins were slower in batch H. head = 80c044b (tmp_gpu/hosts/head);
# clA = the working tree; clB = the tree without the cluster barrier's first phase (arrive at the start, wait before
# the shared-memory store: diagnosis only); clC = head's host with the tree's source where the plain bf16 kernel
# also carries __cluster_dims__(8) (the same code and block lines, launched as clusters: the cost of the launch).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/i; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
H=$REPO/tmp_gpu/hosts/head
md5sum csrc/ll_exchange/ll_exchange.cu $H/csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/*/ll_exchange.cu >> $R/date.txt
s=$(date +%s); PYTHONPATH=$REPO timeout 120 python3 launch/ll_kernel_check.py > $R/check-cluster.txt 2>&1
echo "check cluster rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-cluster.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name host(tree|head) kernel-dir
  local s=$(date +%s) d=$REPO
  [ $2 = head ] && d=$H
  (cd $d && TPSPEC_LL_SOURCE_DIR=$3 PYTHONPATH=$d timeout 100 python3 -m tpspec bench exchange --out /tmp/b-$1 --tp 1 \
     --rows 1,8 --widths 16384,65536 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1)
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_(fused|read_floor) +graph" $R/$1.txt | grep greedy | awk '{printf "%s/%sx%s=%s ", substr($5,7,4),$2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
bench head-1 head $H/csrc/ll_exchange; bench clC head $REPO/tmp_gpu/kern/clC; bench clA tree $REPO/csrc/ll_exchange
bench clB tree $REPO/tmp_gpu/kern/clB; bench head-2 head $H/csrc/ll_exchange
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf i.tgz i && rm -rf i
