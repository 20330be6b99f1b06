#!/bin/bash
# Prepared in session 20 (no device was lent), for the next device session. From the repo root,
#   bash docs/results/h200-2026-12-05-s20/scripts/run_next.sh PART
# part 1: the LL GPU tests (the wave test's rerun); HEAD with floors (greedy, read-only launch, reads + Philox);
#         s19 (0ab67ee's source) against HEAD: b33f464's key-schedule mend, untimed so far
# part 2: ablations a1-a4 against HEAD (wrong tokens, timing only): where the Gumbel call's time over the floor goes
# part 3: pre2 (candidate: a sampled chunk's first logits load beside the row's inputs): check, then against HEAD
# part 4: ps and psn (candidate: pruned quads tile after tile for every larger chunk): checks, then against HEAD
# part 5: HEAD, ps and psn on the bench's lm rows (HEAD's sampled_span skips noise there; ps has no skip rule);
#         ps and psn with every sampled call at two blocks an SM (--b2: ps needs no one-tile chunks)
# part 6: the reads + Philox floor fed by TMA bulk copies (tma patch, scripts/probe_floor.py): does the floor add
#         its reads and its Philox because a thread keeps only one tile in flight? (checks its words first)
# part 7: pst (candidate: ps with 16-bit tiles streamed into shared memory by TMA, 4 tiles ahead): checks, timing
# part 8: psns (candidate: psn with sampled_span's skip rule): checks, then on lm and randn rows against HEAD
# part 9 (added in session 21, whose host-code changes no GPU has run yet): the other GPU tests: tpspec check on
#         CUDA (with cupy its LL rows must now PASS, the kernel's keys in §8.7), the model and the runtime's graphs
# Each part is under 4 minutes. Results go to $OUT/pPART, tarred (the device returns few loose files).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; HERE=$REPO/docs/results/h200-2026-12-05-s20; R=$OUT/p$1; mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt; T0=$(date +%s)
for v in a1 a2 a3 a4 s19 pre2 ps psn tma pst psns; do
  mkdir -p $REPO/tmp_gpu/src/$v
  python3 $HERE/scripts/apply_patch.py csrc/ll_exchange/ll_exchange.cu $HERE/patches/$v.diff \
    $REPO/tmp_gpu/src/$v/ll_exchange.cu || echo "patch $v FAILED"
done
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/src/*/ll_exchange.cu tpspec/exchange/ll.py tpspec/bench/exchange.py >> $R/date.txt
SHAPES=1x16384,1x65536,8x16384,8x32768,8x65536,32x16384,32x32768,64x16384,128x16384,256x16384,256x65536
src_of() { [ $1 = head ] && echo $REPO/csrc/ll_exchange || echo $REPO/tmp_gpu/src/$1; }
probe() {  # label [--floors] [--lm]: one process, its own NVRTC build of the label's source
  local s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(src_of $1) PYTHONPATH=$REPO timeout 100 python3 $HERE/scripts/probe_ablation.py $1 $SHAPES \
    $2 $3 > $R/probe-$1-$(date +%s%N).txt 2>&1
  echo "== probe $1 $2 $3 rc=$? $(( $(date +%s) - s )) s"
}
check() {  # label shapes: launch/ll_kernel_check.py (bit-exact against the torch reference) on the label's source
  local s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(src_of $1) PYTHONPATH=$REPO timeout 100 python3 launch/ll_kernel_check.py > $R/check-$1.txt 2>&1
  echo "check $1 rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-$1.txt)"
  s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(src_of $1) PYTHONPATH=$REPO timeout 100 python3 launch/ll_kernel_check.py --shapes $2 \
    > $R/checkx-$1.txt 2>&1
  echo "checkx $1 rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/checkx-$1.txt)"
}
case $1 in
  1) s=$(date +%s); timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
     echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/ll-gpu.txt)"
     probe head --floors; probe s19; probe head ;;
  2) probe head; probe a1; probe a2; probe a3; probe a4; probe head ;;
  3) check pre2 1x16384,5x16384,8x16384,32x16384,2x65536,8x32768,8x65536
     probe head; probe pre2; probe head; probe pre2 ;;
  4) XS=32x32768,64x16384,128x16384,256x16384,64x65536,3x65536,200x20000
     check ps $XS; check psn $XS; probe head; probe ps; probe psn ;;
  5) probe head --lm; probe ps --lm; probe psn --lm; probe ps --b2; probe psn --b2; probe head ;;
  6) s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$(src_of tma) PYTHONPATH=$REPO timeout 150 python3 $HERE/scripts/probe_floor.py \
       1x65536,8x65536,32x16384,64x16384,64x65536,128x65536,256x16384,256x65536 > $R/floor-tma.txt 2>&1
     echo "floor tma rc=$? $(( $(date +%s) - s )) s"; cat $R/floor-tma.txt | grep -v Warning ;;
  7) check pst 32x32768,64x16384,128x16384,256x16384,64x65536,3x65536,200x20000
     probe head; probe pst; probe ps; probe pst ;;
  9) s=$(date +%s); timeout 230 python3 -m pytest -v -p no:cacheprovider tests/test_check_gpu.py tests/test_model_gpu.py \
       tests/test_runtime_gpu.py > $R/gpu-tests.txt 2>&1
     echo "gpu tests rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/gpu-tests.txt)" ;;
  8) check psns 32x32768,64x16384,128x16384,256x16384,64x65536,3x65536,200x20000
     probe head --lm; probe psns --lm; probe psns; probe head ;;
esac
cat $R/probe-*.txt 2>/dev/null | grep -v "^label" | sort -k2,2n -k3,3n -s
date -u >> $R/date.txt; rm -rf $REPO/tmp_gpu
cd $OUT && tar czf p$1.tgz p$1 && rm -rf p$1; echo "total $(( $(date +%s) - T0 )) s"
