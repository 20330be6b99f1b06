#!/bin/bash
# Session 16 batch C: the greedy loop ranking a group of four packs at once (kernel grp: 80 registers in the
# bf16 kernel; grp4: the same with __launch_bounds__(256, 4), 64 registers and 100 B of spills) and four greedy
# blocks an SM for calls of 8 MiB and more (host gb4), against main; TP=1 local stage at large shapes.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/c; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/*/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
kdir() { case $1 in base) echo $REPO/csrc/ll_exchange;; *) echo $REPO/tmp_gpu/kern/$1;; esac; }
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$(kdir grp) PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py > $R/check-grp.txt 2>&1
echo "check grp rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-grp.txt)"
bench() {  # name host kernel
  local name=$1 host=$2 k=$3 s=$(date +%s) dir=$REPO
  [ $host != main ] && dir=$REPO/tmp_gpu/hosts/$host
  (cd $dir && TPSPEC_LL_SOURCE_DIR=$(kdir $k) PYTHONPATH=$dir timeout 80 python3 -m tpspec bench exchange --out /tmp/b-$name \
     --tp 1 --rows 8,64,128,256 --widths 16384,65536 --ag-iters 2 --timeout 70 > $R/$name.txt 2>&1)
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "greedy +local_(fused|read_floor) +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($5,7,4),$2,$3,$7} END {print ""}'
  cp /tmp/b-$name/exchange.json $R/$name.json 2>/dev/null
}
for i in 1 2; do
  bench base-$i main base; bench grp-$i main grp; bench grp4-$i main grp4; bench gb4-$i gb4 base; bench gb4grp-$i gb4 grp
done
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt
cd $OUT && tar czf c.tgz c && rm -rf c
