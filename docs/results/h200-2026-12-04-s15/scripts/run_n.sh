#!/bin/bash
# Session 15 GPU batch N: block 0's quick gather for up to 128 chunks a row in the _columns kernels.
#   base: main (csrc/ll_exchange, host tmp_gpu/hosts/main = HEAD).
#   rgA:  kernel tmp_gpu/kern/rg128 (gather_row_maxima<4> in the _columns kernels: 128 chunks a row; every other
#         kernel's sm_90 code byte-identical) + host allowing 128 chunks a row for both _columns chunk sizes
#         (1 x 32K -> 256 x 128, 1 x 64K -> 512 x 128).
#   rgB:  same kernel + host allowing 128 only for 512-column chunks (1 x 64K -> 512 x 128).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/n
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/*/ll_exchange.cu tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
hostdir() { echo $REPO/tmp_gpu/hosts/$1; }
srcdir() { case $1 in base) echo $REPO/csrc/ll_exchange;; *) echo $REPO/tmp_gpu/kern/rg128;; esac; }
hostof() { case $1 in base) echo main;; *) echo $1;; esac; }
for v in base rgA rgB; do
  (cd $(hostdir $(hostof $v)) && TPSPEC_LL_SOURCE_DIR=$(srcdir $v) PYTHONPATH=$PWD python3 -c "
import torch, tpspec.exchange.ll as L, tpspec.exchange.cuda_module as C
print('$v', L.__file__, C.source_dir(), [(r, c, L.plan_chunks(r, c, 2, 132, True)) for r in (1, 2, 3, 4) for c in (16384, 32768, 65536)])") >> $R/date.txt 2>&1
done
nvidia-cuda-mps-control -d; sleep 1
s=$(date +%s)
(cd $(hostdir rgA) && TPSPEC_LL_SOURCE_DIR=$(srcdir rgA) PYTHONPATH=$PWD timeout 90 python3 $REPO/launch/ll_kernel_check.py --shapes 1x32768,1x65536,1x40000,1x49156,2x16384,3x16384,2x32768) > $R/check-rgA-shapes.txt 2>&1
echo "check rgA (changed shapes) rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-rgA-shapes.txt)"
s=$(date +%s)
(cd $(hostdir rgA) && TPSPEC_LL_SOURCE_DIR=$(srcdir rgA) PYTHONPATH=$PWD timeout 90 python3 $REPO/launch/ll_kernel_check.py) > $R/check-rgA.txt 2>&1
echo "check rgA (default shapes) rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-rgA.txt)"
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $(hostof $v)) && TPSPEC_LL_SOURCE_DIR=$(srcdir $v) PYTHONPATH=$PWD timeout 80 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,2,3,4,8 --widths 16384,32768,65536 --ag-iters 2 --timeout 70"
for i in 1 2 3; do for v in base rgA rgB; do bench tp1-$v-$i $v $B; done; done
if [ $(( $(date +%s) - T0 )) -lt 280 ]; then
  s=$(date +%s)
  (cd $(hostdir rgA) && TPSPEC_LL_SOURCE_DIR=$(srcdir rgA) PYTHONPATH=$PWD timeout 140 python3 -m pytest -v -p no:cacheprovider $REPO/tests/test_ll_gpu.py) > $R/ll-gpu-rgA.txt 2>&1
  echo "ll gpu tests (rgA) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-rgA.txt | tail -2
fi
if [ $(( $(date +%s) - T0 )) -lt 400 ]; then
  s=$(date +%s)
  (cd $(hostdir rgA) && TPSPEC_LL_SOURCE_DIR=$(srcdir rgA) PYTHONPATH=$PWD timeout 60 python3 -m pytest -v -p no:cacheprovider $REPO/tests/test_model_gpu.py $REPO/tests/test_runtime_gpu.py $REPO/tests/test_check_gpu.py) > $R/other-rgA.txt 2>&1
  echo "model/runtime/check gpu tests (rgA) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-rgA.txt | tail -2
fi
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf n.tgz n && rm -rf n
