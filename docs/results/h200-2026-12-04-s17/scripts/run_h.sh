#!/bin/bash
# Session 17, batch H: the _cluster twins (the working tree: small all-greedy calls launch one thread-block cluster
# of 8 blocks, keys handed to the collector through its shared memory) against main (80c044b, a git archive of
# tpspec, csrc and launch under tmp_gpu/hosts/head): exactness (ll_kernel_check), TP=1 rows 1-8 x 16K-64K twice
# alternating, TP=2 once each, then the LL GPU tests (the new test_ll_cluster_twin_small_greedy_calls among them).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/h; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
H=$REPO/tmp_gpu/hosts/head
md5sum csrc/ll_exchange/ll_exchange.cu $H/csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py $H/tpspec/exchange/ll.py >> $R/date.txt
s=$(date +%s); timeout 120 python3 launch/ll_kernel_check.py > $R/check-cluster.txt 2>&1
echo "check cluster rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-cluster.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name tree|head tp rows widths
  local s=$(date +%s) d=$REPO k=$REPO/csrc/ll_exchange
  [ $2 = head ] && d=$H && k=$H/csrc/ll_exchange
  (cd $d && TPSPEC_LL_SOURCE_DIR=$k PYTHONPATH=$d timeout 100 python3 -m tpspec bench exchange --out /tmp/b-$1 --tp $3 \
     --rows $4 --widths $5 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1)
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$1.txt | grep greedy | awk '{printf "%sx%s=%s ", $2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
for i in 1 2; do
  bench head-$i head 1 1,2,4,8 16384,32768,65536; bench cluster-$i tree 1 1,2,4,8 16384,32768,65536
done
bench tp2-head head 2 1,2,8 16384,65536; bench tp2-cluster tree 2 1,2,8 16384,65536
s=$(date +%s); timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|PASSED|FAILED" $R/ll-gpu.txt | tail -14
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf h.tgz h && rm -rf h
