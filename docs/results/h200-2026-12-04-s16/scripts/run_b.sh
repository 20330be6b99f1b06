#!/bin/bash
# Session 16 batch B: tmp_gpu/reader_probe.py (span4, span4_tail, tma with the shared-memory attribute) under MPS,
# three rounds, then the fused call at 256 x 64K (tpspec bench exchange --tp 1) twice.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/b; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; md5sum tmp_gpu/reader_probe.py csrc/ll_exchange/ll_exchange.cu >> $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
s=$(date +%s); timeout 200 python3 tmp_gpu/reader_probe.py 3 > $R/reader-probe.txt 2>&1
echo "reader probe rc=$? $(( $(date +%s) - s )) s"; grep -v "^round [01]" $R/reader-probe.txt
for i in 1 2; do timeout 80 python3 -m tpspec bench exchange --out /tmp/b$i --tp 1 --rows 256 --widths 65536 --ag-iters 2 > $R/tp1-256x64K-$i.txt 2>&1; cp /tmp/b$i/exchange.json $R/tp1-256x64K-$i.json; grep -E "local_(fused|read)" $R/tp1-256x64K-$i.txt | head -8; done
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt
cd $OUT && tar czf b.tgz b && rm -rf b
