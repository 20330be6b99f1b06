#!/bin/bash
# Session 16 batch G: the new GPU test on the final kernel and on the old one (must fail), the other GPU tests.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
REPO=$PWD; R=$OUT/g; mkdir -p $R; date -u > $R/date.txt; md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/kern/old/ll_exchange.cu tests/test_ll_gpu.py >> $R/date.txt
s=$(date +%s); timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py -k larger_than_one_wave > $R/wave-final.txt 2>&1
echo "wave test final rc=$? $(( $(date +%s) - s )) s"; tail -1 $R/wave-final.txt
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$REPO/tmp_gpu/kern/old timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py -k larger_than_one_wave > $R/wave-old.txt 2>&1
echo "wave test old kernel rc=$? $(( $(date +%s) - s )) s"; tail -1 $R/wave-old.txt; grep -m2 -E "LLTimeoutError|assert" $R/wave-old.txt
s=$(date +%s); timeout 70 python3 -m pytest -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-gpu.txt 2>&1
echo "other gpu tests rc=$? $(( $(date +%s) - s )) s"; tail -1 $R/other-gpu.txt
date -u >> $R/date.txt; cd $OUT && tar czf g.tgz g && rm -rf g
