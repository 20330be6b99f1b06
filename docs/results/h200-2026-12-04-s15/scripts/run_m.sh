#!/bin/bash
# Session 15 GPU batch M: how bench exchange times graphs. Same kernels and plans for all (csrc unchanged; the
# bare-exchange and TP=2/4/8 16K plans are the same in every host):
#   old:       de3c3f1's bench (tmp_gpu/hosts/base): one window over all 50 replays, right after the CPU barrier.
#   perreplay: 02108ae's bench (tmp_gpu/hosts/perreplay): an event between every two replays, median replay.
#   windows:   the working tree: two warm-up replays, then five windows of 10 replays, median window.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/m
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tpspec/bench/exchange.py tmp_gpu/hosts/*/tpspec/bench/exchange.py >> $R/date.txt
hostdir() { case $1 in old) echo $REPO/tmp_gpu/hosts/base;; perreplay) echo $REPO/tmp_gpu/hosts/perreplay;; *) echo $REPO;; esac; }
export TPSPEC_LL_SOURCE_DIR=$REPO/csrc/ll_exchange
for v in old perreplay windows; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "import tpspec.bench.exchange as B; print('$v', B.__file__)") >> $R/date.txt 2>&1
done
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD timeout 100 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "ll_max_keys +graph|ll_argmax_tokens +graph" $R/$name.txt | awk '{printf "%s/%s=%s ", substr($5,4,3),$2,$7} END {print ""}'
  grep -E "^note" $R/$name.txt
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 60"
for i in 1 2; do for n in 4 8; do for v in old windows perreplay; do bench tp$n-$v-$i $v --tp $n $TN; done; done; done
for n in 2 4 8; do [ $(( $(date +%s) - T0 )) -lt 300 ] && bench tp$n-windows-3 windows --tp $n $TN; done
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf m.tgz m && rm -rf m
