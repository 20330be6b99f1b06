"""Session 19 probe: one rank, the fused Gumbel call and the reads + Philox floor kernel under a
CUDA graph (the bench's timer, inputs and cold-logits rotation) with SAMPLED_BLOCKS_PER_SM set
to each value given, at each shape. Usage: probe_bpsm.py 4,2,1 8x16384,8x65536"""
import itertools, os, sys
import torch, torch.distributed as dist
import tpspec.exchange.ll as L
from tpspec.bench.exchange import bench_logits, philox_floor_call, _time_graph, cold_copies

bpsms = [int(x) for x in sys.argv[1].split(",")]
shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(",")]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29613")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.cuda.set_device(0)
ll = L.LLKeyExchange(dist.group.WORLD, max_rows=256, num_channels=1)
gen = torch.Generator().manual_seed(5)
nop = lambda: None
print("bpsm rows width plan kernel fused_gumbel_us floor_us greedy_us")
for rows, width in shapes:
    logits = bench_logits(rows, width, "randn", gen).to("cuda", torch.bfloat16)
    pool = [logits] + [logits.clone() for _ in range(cold_copies(logits, 20) - 1)]
    cycle = itertools.cycle(pool)
    kw = dict(temperature=torch.full((rows,), 0.8, device="cuda"),
              seeds=torch.arange(rows, device="cuda") + 7, offsets=torch.arange(rows, device="cuda") * 32)
    greedy = _time_graph(lambda: ll.argmax_logits(next(cycle), 0, vocab_size=width), 20, 50, nop)
    for b in bpsms:
        L.SAMPLED_BLOCKS_PER_SM = b
        plan = L.plan_chunks(rows, width, 2, ll.plan_sms, True)
        kern = L.fused_kernel_name(torch.bfloat16, plan[0], True)
        g = _time_graph(lambda: ll.argmax_logits(next(cycle), 0, vocab_size=width, **kw), 20, 50, nop)
        f = _time_graph(philox_floor_call(ll, cycle, rows, width), 20, 50, nop)
        print(f"{b} {rows} {width} {plan[0]}x{plan[1]} {kern} {g:.2f} {f:.2f} {greedy:.2f}", flush=True)
    L.SAMPLED_BLOCKS_PER_SM = 4
ll.close(); dist.destroy_process_group()
