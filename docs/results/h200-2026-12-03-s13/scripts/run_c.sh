#!/bin/bash
# Session 13 GPU batch C: the working tree's kernel (= bexpg, to be committed): check, the LL GPU tests and the model,
# runtime and check GPU tests; TP=1 alternating twice with two timing-only probes that are not bit-exact:
# nodiv (f_div by __fdividef) and noscore (gumbel_score_bits returns the logit's bits with a word's low byte mixed in:
# the Philox blocks stay, the exponential, logarithm and division go).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/c
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/v_*/ll_exchange.cu tpspec/exchange/ll.py >> $R/date.txt
srcdir() { case $1 in bexpg) echo $PWD/csrc/ll_exchange;; *) echo $PWD/tmp_gpu/v_$1;; esac; }
s=$(date +%s)
timeout 120 python3 launch/ll_kernel_check.py > $R/check-bexpg.txt 2>&1
echo "check bexpg rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-bexpg.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
  cp $o/exchange.png $R/$name.png 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 90"
for i in 1 2; do
  for v in bexpg nodiv noscore; do bench tp1-$v-$i $v $B; done
done
s=$(date +%s)
timeout 130 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-bexpg.txt 2>&1
echo "ll gpu tests bexpg rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-bexpg.txt | tail -2
s=$(date +%s)
timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-bexpg.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-bexpg.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf c.tgz c && rm -rf c
