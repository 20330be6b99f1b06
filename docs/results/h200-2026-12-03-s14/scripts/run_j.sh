#!/bin/bash
# NOT RUN (session 14's device time was spent). The next batch's template: c512, a host-only variant of main
# (scripts/c512-vs-ddc88fc-host.diff): sampled calls of 3-8 rows x 16K get 512-column chunks (two columns a thread
# in the _columns kernels, at most two blocks an SM, at most 64 chunks a row). Set up before running:
#   mkdir -p tmp_gpu/hosts/base tmp_gpu/hosts/c512
#   git archive HEAD tpspec | tar x -C tmp_gpu/hosts/base; git archive HEAD tpspec | tar x -C tmp_gpu/hosts/c512
#   (cd tmp_gpu/hosts/c512 && patch -p1 < ../../../docs/results/h200-2026-12-03-s14/scripts/c512-vs-ddc88fc-host.diff)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/j
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
hostdir() { echo $REPO/tmp_gpu/hosts/$1; }
export TPSPEC_LL_SOURCE_DIR=$REPO/csrc/ll_exchange  # the host copies carry no csrc/
for v in base c512; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "
import torch, tpspec.exchange.ll as L
print('$v', L.__file__, [(r, c, L.plan_chunks(r, c, 2, 132, True), L.fused_kernel_name(torch.bfloat16, L.plan_chunks(r, c, 2, 132, True)[0], True)) for r in (1, 2, 3, 4, 8, 16) for c in (16384, 65536)])") >> $R/date.txt 2>&1
done
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD timeout 80 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,2,3,4,8,16,64 --widths 16384,65536 --ag-iters 2 --timeout 70"
for i in 1 2 3; do for v in base c512; do bench tp1-$v-$i $v $B; done; done
s=$(date +%s)
(cd $(hostdir c512) && PYTHONPATH=$PWD timeout 130 python3 -m pytest -v -p no:cacheprovider $REPO/tests/test_ll_gpu.py) > $R/ll-gpu-c512.txt 2>&1
echo "ll gpu tests (c512) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-c512.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf j.tgz j && rm -rf j
