"""Session 22 probe (session 20's, with --b4 and the kernel named from the grid): one rank, the fused Gumbel
call under a CUDA graph (the bench's timer, inputs and cold-logits rotation) at each shape, with
whatever source TPSPEC_LL_SOURCE_DIR names (the ablations give wrong tokens: timing only).
With --floors, also the greedy call, the read-only launch and the reads + Philox floor kernel;
with --lm, the bench's lm rows instead of randn (columns far below the top can skip their noise);
with --b2, every sampled call planned at two blocks an SM (no four-an-SM plans for one-tile chunks);
with --b4, at four blocks an SM.
Usage: PYTHONPATH=$REPO probe_ablation.py LABEL 8x16384,8x65536 [--floors] [--lm] [--b2]"""
import itertools, os, sys
import torch, torch.distributed as dist
import tpspec.exchange.ll as L
from tpspec.bench.exchange import bench_logits, philox_floor_call, read_floor_call, _time_graph, cold_copies

label = sys.argv[1]
shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(",")]
floors = "--floors" in sys.argv[3:]
kind = "lm" if "--lm" in sys.argv[3:] else "randn"
b2 = "--b2" in sys.argv[3:]
b4 = "--b4" in sys.argv[3:]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29617")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.cuda.set_device(0)
ll = L.LLKeyExchange(dist.group.WORLD, max_rows=256, num_channels=1)
if b2:  # after the buffers are sized for four an SM; plan_chunks then never takes four
    L.SAMPLED_BLOCKS_PER_SM = L.SAMPLED_BLOCKS_PER_SM_FIRST
if b4:  # every sampled call at four blocks an SM (32 x 32K and 64 x 16K: 2048-column pruned quads)
    L.SAMPLED_BLOCKS_PER_SM_FIRST = L.SAMPLED_BLOCKS_PER_SM
gen = torch.Generator().manual_seed(5)
nop = lambda: None
print("label rows width plan kernel gumbel_us" + (" greedy_us read_floor_us philox_floor_us" if floors else ""))
for rows, width in shapes:
    logits = bench_logits(rows, width, kind, gen).to("cuda", torch.bfloat16)
    pool = [logits] + [logits.clone() for _ in range(cold_copies(logits, 20) - 1)]
    cycle = itertools.cycle(pool)
    kw = dict(temperature=torch.full((rows,), 0.8, device="cuda"),
              seeds=torch.arange(rows, device="cuda") + 7, offsets=torch.arange(rows, device="cuda") * 32)
    plan = L.plan_chunks(rows, width, 2, ll.plan_sms, True)
    try:
        kern = L.fused_kernel_name(torch.bfloat16, plan[0], True, grid_blocks=rows * plan[1], num_sms=ll.plan_sms)
    except TypeError:  # a6e58d0's host code: no _tiles kernels
        kern = L.fused_kernel_name(torch.bfloat16, plan[0], True)
    g = _time_graph(lambda: ll.argmax_logits(next(cycle), 0, vocab_size=width, **kw), 20, 50, nop)
    line = f"{label}{'-lm' if kind == 'lm' else ''}{'-b2' if b2 else ''}{'-b4' if b4 else ''} {rows} {width} {plan[0]}x{plan[1]} {kern} {g:.2f}"
    if floors:
        gr = _time_graph(lambda: ll.argmax_logits(next(cycle), 0, vocab_size=width), 20, 50, nop)
        rf = _time_graph(read_floor_call(ll, cycle, rows, width), 20, 50, nop)
        pf = _time_graph(philox_floor_call(ll, cycle, rows, width), 20, 50, nop)
        line += f" {gr:.2f} {rf:.2f} {pf:.2f}"
    print(line, flush=True)
ll.close(); dist.destroy_process_group()
