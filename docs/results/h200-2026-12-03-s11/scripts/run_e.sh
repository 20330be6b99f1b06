#!/bin/bash
# Session 11 GPU batch E: one exchange kernel per poll batch (working tree: ll_exchange_keys_1/_4/_8,
# the host picks by world) against session 10's single dispatching kernel (tmp_gpu/v_xbase: the same
# kernel under the three names). TP=8 alternating twice, TP=2 once each, TP=4 new once; the LL GPU tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/e
mkdir -p /tmp/mps /tmp/mpslog $R
S=$OUT/e-summary.txt
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
srcdir() { if [ $1 = new ]; then echo csrc/ll_exchange; else echo tmp_gpu/v_$1; fi; }
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s" | tee -a $S
  grep -E "ll_max_keys|ll_argmax_tokens" $R/$name.txt | grep graph | awk '{printf "%s/%s=%s  ", substr($5,4),$2,$7} END {print ""}' | tee -a $S
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
for i in 1 2; do for v in xbase new; do bench tp8-$v-$i $v --tp 8 $TN; done; done
for v in xbase new; do bench tp2-$v $v --tp 2 $TN; done
bench tp4-new new --tp 4 $TN
s=$(date +%s)
timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-new.txt 2>&1
echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s" | tee -a $S; grep -E "passed|failed" $R/ll-gpu-new.txt | tail -2 | tee -a $S
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf e.tgz e && rm -rf e
