#!/bin/bash
# Session 22 device batch. From the repo root: bash gpu_batch/run.sh PART   (A, then B; see this folder's README for the set-up)
# A: bit-exact checks of HEAD (the _tiles route) and thr; probes of a6e58d0 (base), HEAD, thr, base at
#    four blocks an SM; the LL GPU tests on HEAD.
# B: the LL GPU tests on thr; the other GPU tests (check, model, runtime); tpspec bench exchange --tp 1 on HEAD.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/s22$1; mkdir -p /tmp/mps /tmp/mpslog $R; T0=$(date +%s)
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu gpu_batch/base/csrc/ll_exchange/ll_exchange.cu gpu_batch/thr/ll_exchange.cu \
  tpspec/exchange/ll.py gpu_batch/base/tpspec/exchange/ll.py >> $R/date.txt
SHAPES=1x16384,1x65536,8x16384,8x32768,8x65536,32x16384,32x32768,48x20000,64x16384,128x16384,256x16384,256x65536
probe() {  # label [flags]: one process, its own NVRTC build
  local s=$(date +%s) py=$REPO src=$REPO/csrc/ll_exchange
  [ $1 = base ] && py=$REPO/gpu_batch/base && src=$REPO/gpu_batch/base/csrc/ll_exchange
  [ $1 = thr ] && src=$REPO/gpu_batch/thr
  TPSPEC_LL_SOURCE_DIR=$src PYTHONPATH=$py timeout 100 python3 docs/results/h200-2026-12-05-s22/scripts/probe.py $1 $SHAPES $2 $3 \
    > $R/probe-$1$2$3-$(date +%s%N).txt 2>&1
  echo "== probe $1 $2 $3 rc=$? $(( $(date +%s) - s )) s"
}
check() {  # label: launch/ll_kernel_check.py (180 cases, bit-exact against the CPU reference)
  local s=$(date +%s) src=$REPO/csrc/ll_exchange
  [ $1 = thr ] && src=$REPO/gpu_batch/thr
  TPSPEC_LL_SOURCE_DIR=$src PYTHONPATH=$REPO timeout 120 python3 launch/ll_kernel_check.py > $R/check-$1.txt 2>&1
  echo "check $1 rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-$1.txt)"
  TPSPEC_LL_SOURCE_DIR=$src PYTHONPATH=$REPO timeout 60 python3 launch/ll_kernel_check.py \
    --shapes 32x32768,48x20000,64x16384,24x16336,24x8168,8x65536 > $R/checkx-$1.txt 2>&1
  echo "checkx $1 rc=$?: $(tail -1 $R/checkx-$1.txt)"; grep sampled $R/checkx-$1.txt
}
case $1 in
  A) check head; check thr
     probe base; probe head; probe thr; probe base --b4; probe head; probe base; probe thr
     probe base --lm; probe head --lm; probe thr --lm
     s=$(date +%s); timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
     echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/ll-gpu.txt)" ;;
  B) s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$REPO/gpu_batch/thr timeout 200 python3 -m pytest -v -p no:cacheprovider \
       tests/test_ll_gpu.py > $R/ll-gpu-thr.txt 2>&1
     echo "ll gpu tests (thr) rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/ll-gpu-thr.txt)"
     s=$(date +%s); timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_check_gpu.py tests/test_model_gpu.py \
       tests/test_runtime_gpu.py > $R/gpu-tests.txt 2>&1
     echo "gpu tests rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/gpu-tests.txt)"
     s=$(date +%s); timeout 240 python3 -m tpspec.cli bench exchange --tp 1 --ag-iters 2 --out $R/bench > $R/bench.txt 2>&1
     echo "bench rc=$? $(( $(date +%s) - s )) s"; tail -30 $R/bench.txt ;;
esac
cat $R/probe-*.txt 2>/dev/null | grep -v "^label" | sort -k2,2n -k3,3n -s
date -u >> $R/date.txt
cd $OUT && tar czf s22$1.tgz s22$1 && rm -rf s22$1; echo "total $(( $(date +%s) - T0 )) s"
