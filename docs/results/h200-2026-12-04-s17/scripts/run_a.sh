#!/bin/bash
# Session 17, batch A: session 16's grpN template (run_h.sh) plus ded (a dedicated collector block: the plain fused
# kernels get rows * chunks + 1 blocks, the last only collects) and handoff_probe.py. Variants under tmp_gpu/:
#   kern/grpN    = csrc + scripts/grpN-vs-e01081f-kernel.diff (session 16's folder)
#   kern/ded     = csrc + ded-vs-80c044b-kernel.diff;  kern/dedgrpN = both
#   hosts/gb4    = git archive + GREEDY_BLOCKS_PER_SM = 4;  hosts/ded = + ded-vs-80c044b-host.diff;  hosts/dedgb4 = both
# Usage: bash run_a.sh 1 (checks, probe, one round of benches) | bash run_a.sh 2 (second round, reversed; LL GPU tests of $2)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; PART=$1; R=$OUT/a$PART; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/*/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
kdir() { case $1 in base) echo $REPO/csrc/ll_exchange;; *) echo $REPO/tmp_gpu/kern/$1;; esac; }
hdir() { case $1 in main) echo $REPO;; *) echo $REPO/tmp_gpu/hosts/$1;; esac; }
check() {  # host kernel
  local s=$(date +%s) d=$(hdir $1)
  (cd $d && TPSPEC_LL_SOURCE_DIR=$(kdir $2) PYTHONPATH=$d timeout 90 python3 $REPO/launch/ll_kernel_check.py > $R/check-$1-$2.txt 2>&1)
  echo "check $1/$2 rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-$1-$2.txt)"
}
bench() {  # name host kernel
  local name=$1 d=$(hdir $2) s=$(date +%s)
  (cd $d && TPSPEC_LL_SOURCE_DIR=$(kdir $3) PYTHONPATH=$d timeout 80 python3 -m tpspec bench exchange --out /tmp/b-$name \
     --tp 1 --rows 1,8,64,128,256 --widths 16384,65536 --ag-iters 2 --timeout 70 > $R/$name.txt 2>&1)
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_(fused|read_floor) +graph" $R/$name.txt | awk '{printf "%s/%s/%sx%s=%s ", substr($5,7,4),substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$name/exchange.json $R/$name.json 2>/dev/null
}
if [ "$PART" = 1 ]; then
  check main grpN; check ded ded; check ded dedgrpN; check dedgb4 dedgrpN
  s=$(date +%s); timeout 120 python3 tmp_gpu/handoff_probe.py 3 > $R/handoff.txt 2>&1; echo "probe rc=$? $(( $(date +%s) - s )) s"
  python3 - $R/handoff.txt <<'PY'
import collections, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith("round"):
        f = line.split(); d[(int(f[3]), f[5])].append(float(f[6]))
for k, v in sorted(d.items()): print(k, v)
PY
  nvidia-cuda-mps-control -d; sleep 1
  bench base-1 main base; bench grpN-1 main grpN; bench gb4grpN-1 gb4 grpN
  bench ded-1 ded ded; bench dedgrpN-1 ded dedgrpN; bench dedgb4grpN-1 dedgb4 dedgrpN
else
  nvidia-cuda-mps-control -d; sleep 1
  bench dedgb4grpN-2 dedgb4 dedgrpN; bench dedgrpN-2 ded dedgrpN; bench ded-2 ded ded
  bench gb4grpN-2 gb4 grpN; bench grpN-2 main grpN; bench base-2 main base
  if [ -n "$2" ]; then
    h=${2%/*}; k=${2#*/}; d=$(hdir $h); s=$(date +%s)
    (cd $d && TPSPEC_LL_SOURCE_DIR=$(kdir $k) PYTHONPATH=$d timeout 170 python3 -m pytest -v -p no:cacheprovider $REPO/tests/test_ll_gpu.py > $R/ll-gpu-$h-$k.txt 2>&1)
    echo "ll gpu tests ($2) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-$h-$k.txt | tail -2
  fi
fi
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf a$PART.tgz a$PART && rm -rf a$PART
