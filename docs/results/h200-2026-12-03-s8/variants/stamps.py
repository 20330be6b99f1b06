"""Diagnostic: per-phase timestamps of the fused kernel (variant tmp_gpu/v_stamp), one rank.

Stamps (thread 0 of each block): 0 entry, 1 inputs ready, 2 span done (sampled: after the
survivors), 3 after block_max, 5/6 around the sampled survivors' barrier, block 0: 4 after
gathering the block lines, 7 after the exchange. Prints medians over calls, in ns from the
earliest block's entry (globaltimer) and per-block clock64 deltas.
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

os.environ["TPSPEC_LL_SOURCE_DIR"] = os.environ.get("STAMP_SRC", "tmp_gpu/v_stamp")
GRAPH = "--graph" in sys.argv
SHAPES = ((1, 16384),) if "--small" in sys.argv else ((1, 16384), (8, 65536))
sys.path.insert(0, ".")
from tpspec.exchange import cuda_module  # noqa: E402
from tpspec.exchange.ll import LLKeyExchange  # noqa: E402

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29613")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.cuda.set_device(0)
ll = LLKeyExchange(dist.group.WORLD, max_rows=256, num_channels=1)
import cupy as cp  # noqa: E402

mod = cuda_module.load_module(0)
g = mod.get_global("g_stamps")
stamps = cp.ndarray((1024, 48), dtype=cp.uint64, memptr=g)
for rows, width in SHAPES:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, width, generator=gen).to("cuda", torch.bfloat16)
    for mode in ("greedy", "gumbel"):
        kw = {}
        if mode == "gumbel":
            kw = dict(temperature=torch.full((rows,), 0.8, device="cuda"),
                      seeds=torch.arange(rows, device="cuda", dtype=torch.int64) + 11,
                      offsets=torch.zeros(rows, device="cuda", dtype=torch.int64))
        for _ in range(20):
            ll.argmax_logits(logits, 0, **kw)
        samples = []
        if GRAPH:  # the bench's setting: calls back to back inside one graph (L2-warm logits here)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(30):
                    ll.argmax_logits(logits, 0, **kw)
            for _ in range(3):
                graph.replay()
        for _ in range(40):
            stamps.fill(0)
            torch.cuda.synchronize()
            if GRAPH:
                graph.replay()  # the stamps are those of its last call
            else:
                ll.argmax_logits(logits, 0, **kw)
            torch.cuda.synchronize()
            samples.append(stamps.get())
        a = np.stack(samples).astype(np.int64)  # [calls, block, 16]
        used = a[0, :, 0] != 0
        nb = int(used.sum())
        gt = a[:, :nb, 0::2]
        ck = a[:, :nb, 1::2]
        t0 = gt[:, :, 0].min(axis=1, keepdims=True)
        rel = np.where(gt != 0, gt - t0[:, :, None], -1)
        print(f"\n{rows} x {width} {mode} ({'graph' if GRAPH else 'eager'}): {nb} blocks")
        names = ["entry", "inputs", "span", "blockmax", "gathered(b0)", "tiles done", "surv.sync", "exchanged(b0)",
                 "tile loaded", "pass1 done", "bound shared", "pass2 done", "score 1 begin", "score 1 end", "score 2 end",
                 "xchg sync1", "published", "waited", "xchg sync2", "chunks reduced"]
        for k, name in enumerate(names):
            col = rel[:, :, k]
            valid = col >= 0
            if not valid.any():
                continue
            med_all = np.median(np.where(valid, col, np.nan), axis=0)
            b0 = np.median(col[:, 0]) if valid[:, 0].all() else float("nan")
            print(f"  {k:2d} {name:14s} ns: b0 {b0:6.0f} med {np.nanmedian(med_all):6.0f} max {np.nanmax(med_all):6.0f}")
        for k in range(1, 20):
            d = np.where((ck[:, :, k] != 0), ck[:, :, k] - ck[:, :, 0], -1)
            if (d >= 0).any():
                print(f"  clk 0->{k}: med {np.median(d[d >= 0]):6.0f} b0 {np.median(d[:, 0]):6.0f}")
ll.close()
dist.destroy_process_group()
