#!/bin/bash
# Session 9 GPU batch B: the kernel with the epoch written first and the keys loaded before the
# prologue (csrc) against HEAD's (tmp_gpu/v_base): checks, stamps, alternating benches; the PDL probe.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/b
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
timeout 60 python3 tmp_gpu/pdl_probe.py > $R/pdl.txt 2>&1; echo "pdl rc=$?"; grep -v -i "warn\|fn()" $R/pdl.txt | tail -12
nvidia-cuda-mps-control -d; sleep 1
timeout 100 python3 launch/ll_kernel_check.py > $R/check-new.txt 2>&1; echo "check rc=$?"; tail -1 $R/check-new.txt
s=$(date +%s)
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-new.txt 2>&1; echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $R/ll-gpu-new.txt | cut -c1-120
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-new.txt 2>&1; echo "other gpu tests rc=$?"; tail -1 $R/other-new.txt
XSTAMP_SRC=tmp_gpu/v_xstamp_new timeout 60 python3 tmp_gpu/xstamps.py 2 1,256 > $R/xstamps-new-tp2.txt 2>&1; echo "xstamps rc=$?"; grep -v -i warn $R/xstamps-new-tp2.txt
bench() {
  local name=$1 dir=$2; shift 2
  local o=/tmp/b-$name
  if [ -n "$dir" ]; then export TPSPEC_LL_SOURCE_DIR=$dir; else unset TPSPEC_LL_SOURCE_DIR; fi
  timeout 120 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$?"; grep -E "ll_max_keys +graph|ll_argmax_tokens +graph|local_fused +graph|ll_fused +graph" $R/$name.txt | awk '{printf "%s/%s/%s=%s  ", $5,$2,$4,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
  unset TPSPEC_LL_SOURCE_DIR
}
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
for i in 1 2; do bench tp2-base-$i tmp_gpu/v_base --tp 2 $TN; bench tp2-new-$i "" --tp 2 $TN; done
bench tp4-base tmp_gpu/v_base --tp 4 $TN; bench tp4-new "" --tp 4 $TN
bench tp8-new "" --tp 8 $TN
T1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
bench tp1-new "" $T1
bench tp8-base tmp_gpu/v_base --tp 8 $TN
bench tp1-base tmp_gpu/v_base $T1
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
