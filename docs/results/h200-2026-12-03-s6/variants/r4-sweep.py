"""Greedy local stage: blocks per SM x source (TPSPEC_LL_SOURCE_DIR), CUDA graph, cold rotation."""
import itertools
import sys

import torch

from tpspec.bench.exchange import _time_graph, cold_copies
from tpspec.exchange import ll as L

ex = L.LLKeyExchange(None, max_rows=256, num_channels=1)
tag = sys.argv[1]
for rows, width in ((256, 65536), (256, 16384), (64, 65536), (8, 65536), (1, 16384)):
    x = torch.randn(rows, width, device="cuda").mul_(3).to(torch.bfloat16)
    pool = [x] + [x.clone() for _ in range(cold_copies(x, 20) - 1)]
    cyc = itertools.cycle(pool)
    for bps in (2, 3, 4):
        L.GREEDY_BLOCKS_PER_SM = bps
        us = _time_graph(lambda: ex.argmax_logits(next(cyc), 0, vocab_size=width), 20, 50, lambda: None)
        print(f"{tag} {rows}x{width} bps={bps}: {us:.2f} us ({100 * x.numel() * 2 / us / 1e3 / 4250:.1f} % of 4.25 TB/s)",
              flush=True)
ex.check()
ex.close()
