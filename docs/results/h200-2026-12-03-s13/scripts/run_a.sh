#!/bin/bash
# Session 13 GPU batch A: bexpg (working tree: branchless exponential_from_word, and the exact path skips the bound
# table's loads) against HEAD c6054d4's kernel (tmp_gpu/v_head) and bexp (the branchless exponential alone,
# tmp_gpu/v_bexp); and, on bexpg, host copies whose plan_chunks gives sampled rows a smallest chunk of 512 (m512) or
# 256 (m256) columns, at most 64 chunks a row. Check on bexpg, bexpg+m512 and bexpg+m256; TP=1 alternating 3 times;
# the LL GPU tests on bexpg.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/a
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/v_*/ll_exchange.cu tpspec/exchange/ll.py >> $R/date.txt
for m in 512 256; do
  rm -rf /tmp/vc_m$m; mkdir -p /tmp/vc_m$m; cp -r tpspec /tmp/vc_m$m/
  sed -i "s|    chunk = max(chunk, 1024)|    chunk = max(chunk, $m, -(-cols // 64)) if sampled else max(chunk, 1024)|" /tmp/vc_m$m/tpspec/exchange/ll.py
  grep -n "chunk = max(chunk" /tmp/vc_m$m/tpspec/exchange/ll.py >> $R/date.txt
done
srcdir() { case $1 in bexpg*) echo $PWD/csrc/ll_exchange;; *) echo $PWD/tmp_gpu/v_$1;; esac; }
pypath() { case $1 in *-m512) echo /tmp/vc_m512;; *-m256) echo /tmp/vc_m256;; *) echo $PWD;; esac; }
for v in bexpg bexpg-m512 bexpg-m256; do
  s=$(date +%s)
  PYTHONPATH=$(pypath $v) TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 120 python3 launch/ll_kernel_check.py > $R/check-$v.txt 2>&1
  echo "check $v rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-$v.txt)"
done
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  PYTHONPATH=$(pypath $v) TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 150 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  local pat="local_fused +graph"; case $name in tp[248]*) pat="ll_fused +graph";; esac
  grep -E "$pat" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
for i in 1 2 3; do
  for v in head bexp bexpg bexpg-m512 bexpg-m256; do bench tp1-$v-$i $v $B; done
done
s=$(date +%s)
PYTHONPATH=$PWD TPSPEC_LL_SOURCE_DIR=$(srcdir bexpg) timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-bexpg.txt 2>&1
echo "ll gpu tests bexpg rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-bexpg.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf a.tgz a && rm -rf a
