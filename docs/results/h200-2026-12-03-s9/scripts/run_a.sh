#!/bin/bash
# Session 9 GPU batch A: exchange-kernel phase stamps at TP=2/4, a TP=2 baseline, the PDL probe.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog $OUT/a
R=$OUT/a
date -u > $R/date.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
s=$(date +%s)
timeout 120 python3 tmp_gpu/xstamps.py 2 1,64,128,256 > $R/xstamps-tp2.txt 2>&1; echo "xstamps tp2 rc=$? $(( $(date +%s) - s )) s"; cat $R/xstamps-tp2.txt | grep -v Warning
s=$(date +%s)
timeout 120 python3 tmp_gpu/xstamps.py 4 1,256 > $R/xstamps-tp4.txt 2>&1; echo "xstamps tp4 rc=$? $(( $(date +%s) - s )) s"; cat $R/xstamps-tp4.txt | grep -v Warning
s=$(date +%s)
timeout 150 python3 -m tpspec bench exchange --out /tmp/b-tp2 --tp 2 --rows 1,8,64,128,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80 > $R/tp2-base.txt 2>&1
echo "bench tp2 rc=$? $(( $(date +%s) - s )) s"; grep -E "ll_max_keys|ll_argmax_tokens" $R/tp2-base.txt
cp /tmp/b-tp2/exchange.json $R/tp2-base.json 2>/dev/null
echo quit | nvidia-cuda-mps-control
sleep 1
s=$(date +%s)
timeout 120 python3 tmp_gpu/pdl_probe.py > $R/pdl.txt 2>&1; echo "pdl rc=$? $(( $(date +%s) - s )) s"; cat $R/pdl.txt | tail -20
date -u >> $R/date.txt
cd $OUT && tar czf a.tgz a && rm -rf a
