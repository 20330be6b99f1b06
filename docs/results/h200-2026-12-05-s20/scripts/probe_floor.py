"""Session 20 probe (prepared on CPU, for the next device session): the reads + Philox floor kernel
against the same work fed by TMA bulk copies (the `tma` patch's ll_philox_floor_tma_bf16, 2 / 4 / 8
tiles of 4096 columns in flight a block), one rank, under a CUDA graph (the bench's timer and
cold-logits rotation), with the greedy and Gumbel fused calls beside them. First checks that
both floor kernels write the same words. Usage (the patched source in TPSPEC_LL_SOURCE_DIR):
PYTHONPATH=$REPO probe_floor.py 8x65536,256x65536"""
import itertools, os, sys
import numpy as np
import torch, torch.distributed as dist
import tpspec.exchange.ll as L
from tpspec.bench.exchange import bench_logits, philox_floor_call, _time_graph, cold_copies
from tpspec.exchange.cuda_module import THREADS_PER_BLOCK

shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")]
STAGES = (2, 4, 8)
TILE_BYTES = 4096 * 2
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29619")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.cuda.set_device(0)
ll = L.LLKeyExchange(dist.group.WORLD, max_rows=256, num_channels=1)
tma = ll._module.get_function("ll_philox_floor_tma_bf16")
tma.max_dynamic_shared_size_bytes = max(STAGES) * TILE_BYTES
ll._kernels["ll_philox_floor_tma_bf16"] = tma
gen = torch.Generator().manual_seed(5)
nop = lambda: None


def tma_floor_call(cycle, rows, width, stages, out):
    chunk, chunks = L.plan_chunks(rows, width, 2, ll.plan_sms, sampled=True)

    def call():
        x = next(cycle)
        ll._launch("ll_philox_floor_tma_bf16", rows * chunks, stages * TILE_BYTES,
                   (np.uint64(x.data_ptr()), np.int64(x.stride(0)), np.int32(width), np.int32(chunk),
                    np.int32(chunks), np.uint32(7), np.uint64(out.data_ptr()), np.int32(stages)))
    return call


print("rows width plan same_words greedy_us gumbel_us floor_us " + " ".join(f"tma{s}_us" for s in STAGES))
for rows, width in shapes:
    logits = bench_logits(rows, width, "randn", gen).to("cuda", torch.bfloat16)
    chunk, chunks = L.plan_chunks(rows, width, 2, ll.plan_sms, sampled=True)
    words = rows * chunks * (THREADS_PER_BLOCK // 32)
    # The check: one launch of each floor kernel on the same logits writes the same words.
    ref = torch.zeros(words, dtype=torch.int32, device="cuda")
    ll._launch("ll_philox_floor_bf16", rows * chunks, 0,
               (np.uint64(logits.data_ptr()), np.int64(logits.stride(0)), np.int32(width), np.int32(chunk),
                np.int32(chunks), np.uint32(7), np.uint64(ref.data_ptr())))
    same = []
    for stages in STAGES:
        got = torch.full((words,), -1, dtype=torch.int32, device="cuda")
        tma_floor_call(itertools.repeat(logits), rows, width, stages, got)()
        torch.cuda.synchronize()
        same.append(bool(torch.equal(got, ref)))
    pool = [logits] + [logits.clone() for _ in range(cold_copies(logits, 20) - 1)]
    cycle = itertools.cycle(pool)
    kw = dict(temperature=torch.full((rows,), 0.8, device="cuda"),
              seeds=torch.arange(rows, device="cuda") + 7, offsets=torch.arange(rows, device="cuda") * 32)
    greedy = _time_graph(lambda: ll.argmax_logits(next(cycle), 0, vocab_size=width), 20, 50, nop)
    gumbel = _time_graph(lambda: ll.argmax_logits(next(cycle), 0, vocab_size=width, **kw), 20, 50, nop)
    floor = _time_graph(philox_floor_call(ll, cycle, rows, width), 20, 50, nop)
    out = torch.zeros(words, dtype=torch.int32, device="cuda")
    tmas = [_time_graph(tma_floor_call(cycle, rows, width, s, out), 20, 50, nop) for s in STAGES]
    print(f"{rows} {width} {chunk}x{chunks} {'/'.join('yes' if v else 'NO' for v in same)} {greedy:.2f} {gumbel:.2f} "
          f"{floor:.2f} " + " ".join(f"{t:.2f}" for t in tmas), flush=True)
ll.close(); dist.destroy_process_group()
