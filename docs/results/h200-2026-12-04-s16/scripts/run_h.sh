#!/bin/bash
# NOT RUN (session 16's device time was spent). The next batch's template, from session 16's reader probe: a plain
# reader with four 16-byte loads a thread in flight and three instructions a pack reads 256 x 64K in 9.4-9.75 us, the
# fused kernel's greedy loop (eight in flight, ~15 instructions a pack) in 10.2-10.3. grpN (scripts/grpN-vs-e01081f-
# kernel.diff) ranks a group of four packs by its elementwise maximum, one group in flight, 63-64 registers in every
# fused kernel (checked locally with nvcc -Xptxas -v). gb4 (scripts/gb4-vs-c4e3782-host.diff) gives it 512 blocks at
# 256 x 64K. Adopt only if exact (check, LL GPU tests) and no shape of 1-8 rows gets slower. Set up before running:
#   mkdir -p tmp_gpu/kern/grpN && cp csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/grpN/
#   (cd tmp_gpu/kern/grpN && patch -p3 < ../../../docs/results/h200-2026-12-04-s16/scripts/grpN-vs-e01081f-kernel.diff)
#   mkdir -p tmp_gpu/hosts/gb4 && git archive HEAD tpspec | tar x -C tmp_gpu/hosts/gb4
#   sed -i 's/^GREEDY_BLOCKS_PER_SM = 2/GREEDY_BLOCKS_PER_SM = 4/' tmp_gpu/hosts/gb4/tpspec/exchange/ll.py
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/h; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/grpN/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/gb4/tpspec/exchange/ll.py >> $R/date.txt
kdir() { case $1 in base) echo $REPO/csrc/ll_exchange;; *) echo $REPO/tmp_gpu/kern/$1;; esac; }
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$(kdir grpN) PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py > $R/check-grpN.txt 2>&1
echo "check grpN rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-grpN.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name host kernel
  local name=$1 host=$2 k=$3 s=$(date +%s) dir=$REPO
  [ $host != main ] && dir=$REPO/tmp_gpu/hosts/$host
  (cd $dir && TPSPEC_LL_SOURCE_DIR=$(kdir $k) PYTHONPATH=$dir timeout 80 python3 -m tpspec bench exchange --out /tmp/b-$name \
     --tp 1 --rows 1,8,64,128,256 --widths 16384,65536 --ag-iters 2 --timeout 70 > $R/$name.txt 2>&1)
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_(fused|read_floor) +graph" $R/$name.txt | awk '{printf "%s/%s/%sx%s=%s ", substr($5,7,4),substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$name/exchange.json $R/$name.json 2>/dev/null
}
for i in 1 2; do bench base-$i main base; bench grpN-$i main grpN; bench gb4grpN-$i gb4 grpN; done
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$(kdir grpN) timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-grpN.txt 2>&1
echo "ll gpu tests (grpN) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-grpN.txt | tail -2
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf h.tgz h && rm -rf h
