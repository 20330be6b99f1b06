"""Session 20, on the CPU: how many columns a warp-local running bound leaves to score exactly.

For the bench rows (randn x 3, or lm-like), T = 0.8, a block of 256 threads, QPT quads a thread a tile: per
warp-tile, the columns whose upper bound reaches the warp's running bound (ps: every column estimated) and the
quads whose loose reach does (psq: one estimate a quad, from its smallest word). Run from the repo root:
PYTHONPATH=. python3 docs/results/h200-2026-12-05-s20/scripts/warp_bound_sim.py"""
import sys, torch
from tpspec import keys
torch.manual_seed(0)
tab = keys.gumbel_bound_table().double()
G = tab[:528]; c0 = float(tab[528]); REL = 2.0**-16
def ub(a): return a + (c0 + REL * a.abs())
def lb(a): return a - (c0 + REL * a.abs())
def run(rows, width, chunk, qpt, T=0.8, kind="randn"):
    if kind == "randn":
        x = torch.randn(rows, width) * 3
    else:
        x = torch.randn(rows, width) * 2.5; x[:, torch.randint(0, width, (8,))] += 25
    t = x.to(torch.bfloat16).double() / T
    cols = torch.arange(width)
    w = keys.philox_words(torch.arange(rows) + 7, torch.arange(rows) * 32, cols)
    est = t + G[keys.gumbel_bucket_index(w)]
    tilec = 4 * qpt * 256
    ps_counts, psq_counts, tiles = [], [], 0
    for r in range(rows):
        for b0 in range(0, width, chunk):
            for wp in range(8):
                low_ps = -float("inf"); low_q = -float("inf")
                n_ps = n_q = 0; nt = 0
                for tile in range(b0, min(width, b0 + chunk), tilec):
                    idx = []
                    for j in range(qpt):
                        base = tile + 4 * (32 * wp + j * 256)
                        q0 = base + 4 * torch.arange(32)
                        idx.append(q0)
                    q0 = torch.cat(idx); q0 = q0[q0 < min(width, b0 + chunk)]
                    if len(q0) == 0: continue
                    nt += 1
                    c = (q0.reshape(-1, 1) + torch.arange(4)).reshape(-1)
                    e = est[r, c]
                    low_ps = max(low_ps, float(lb(e).max()))
                    n_ps += int((ub(e) >= low_ps).sum())
                    # psq: per quad, max t and the min word's column
                    tq = t[r, c].reshape(-1, 4); wq = w[r, c].reshape(-1, 4)
                    mi = wq.argmin(1)
                    gq = G[keys.gumbel_bucket_index(wq.gather(1, mi[:, None]).squeeze(1))]
                    reach = ub(tq.max(1).values + gq)
                    low_q = max(low_q, float(lb(tq.gather(1, mi[:, None]).squeeze(1) + gq).max()))
                    cand = reach >= low_q
                    n_q += int(cand.sum())
                ps_counts.append(n_ps / max(nt, 1)); psq_counts.append(n_q / max(nt, 1)); tiles = nt
    print(f"{rows}x{width} chunk {chunk} qpt {qpt} {kind}: tiles/warp {tiles}, exact/warp-tile ps {sum(ps_counts)/len(ps_counts):.2f}, cand quads/warp-tile psq {sum(psq_counts)/len(psq_counts):.2f}")
for rows, width, chunk in ((4, 16384, 4096), (2, 65536, 16384), (1, 65536, 65536)):
    for kind in ("randn", "lm"):
        run(rows, width, chunk, 2, kind=kind)
