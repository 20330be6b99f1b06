"""``tpspec bench exchange``: the LL exchange against the all-gather baselines.

On CUDA, ``--tp N`` rank processes share the GPUs of this node (several per GPU when
there are fewer GPUs than ranks, through MPS: CUDA IPC works between processes on one
GPU, NCCL does not, so the group is bootstrapped with gloo). Per shape (rows x slice
width, bf16) and mode (greedy, Gumbel) it times:

* ``ll_fused``       LLKeyExchange.argmax_logits, one launch (all ranks concurrently);
* ``ll_max_keys``    the bare exchange of [rows] keys (LL), and ``ll_argmax_tokens``;
* ``local_fused``    the fused kernel of one rank alone (a 1-rank LL group): the local
                     stage, with its effective HBM bandwidth;
* ``local_torch``    torch.max + pack (greedy) / keys.local_row_keys (Gumbel): the
                     local stage of the all-gather path;
* ``local_torch_max`` (greedy) ``torch.max(x, dim=-1)`` alone, the baseline the figures
                     quote for the fused kernel (no key packing);
* ``local_philox_floor`` (Gumbel) the fused kernel's reads plus the Philox block of
                     every column and nothing else: the floor the noise sets
                     when no column can be ruled out before its noise;
* ``local_read_floor`` (greedy) one launch with the greedy grid that reads the slice
                     with the greedy rows' loop and stores a max per block, with no
                     hand-off between blocks and no exchange: what launch and reads
                     cost alone;
* ``ag_keys``        torch.max + pack + all-gather of keys (the fallback exchange);
* ``ag_logits``      all-gather of the full logits slice + argmax (what vLLM/SGLang do).

``graph`` rows replay a CUDA graph of ``--calls-per-graph`` calls ``--replays`` times, after
warm-up replays, and report the median of five windows, per call; ``eager`` rows call from
Python (median of 3 rounds). On one GPU the all-gather baselines run over gloo (NCCL refuses
two ranks on one GPU), which says nothing about NCCL on real GPUs: they are labelled so.
``--device cpu --quick`` runs the all-gather variants on CPU ranks (gloo), tiny sizes.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from . import bench_device, number_list, report

if TYPE_CHECKING:
    import torch

DEFAULT_ROWS = (1, 8, 64, 256)
DEFAULT_WIDTHS = (16384, 32768, 65536)
QUICK_ROWS = (1, 8)
QUICK_WIDTHS = (1024, 4096)


# --------------------------------------------------------------------------- timing

GRAPH_WARMUP_REPLAYS = 2  # untimed replays queued ahead of the timed ones
GRAPH_WINDOWS = 5  # timed stretches of back-to-back replays


def _graph_windows_us(fn: Callable[[], Any], calls: int, replays: int, barrier: Callable[[], None]) -> list[float]:
    """µs per call of ``fn`` captured ``calls`` times in one CUDA graph, for each of (up to)
    ``GRAPH_WINDOWS`` stretches that together replay it ``replays`` times back to back.

    Rank processes leave the CPU barrier at different times. The warm-up replays, queued
    with the timed ones, take that up: the ranks that start first wait inside them for the
    last, and every rank's timed replays then start in step. A window is a whole stretch,
    not one replay: an event between every two replays slows each call under MPS."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    barrier()
    for _ in range(GRAPH_WARMUP_REPLAYS):
        graph.replay()
    windows = max(1, min(GRAPH_WINDOWS, replays))
    sizes = [replays // windows + (1 if i < replays % windows else 0) for i in range(windows)]
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(windows + 1)]
    marks[0].record()
    for size, mark in zip(sizes, marks[1:]):
        for _ in range(size):
            graph.replay()
        mark.record()
    marks[-1].synchronize()
    del graph
    return [a.elapsed_time(b) * 1000.0 / (calls * size) for a, b, size in zip(marks, marks[1:], sizes)]


def _time_graph(fn: Callable[[], Any], calls: int, replays: int, barrier: Callable[[], None]) -> float:
    """µs per call of ``fn`` under a CUDA graph: the median window of ``_graph_windows_us``
    (a rank that stalls while queueing its replays slows one window, not the figure). The
    bare exchanges call ``_graph_windows_us`` themselves to keep the windows' mean too."""
    return statistics.median(_graph_windows_us(fn, calls, replays, barrier))


def _time_eager(fn: Callable[[], Any], iters: int, barrier: Callable[[], None], device: torch.device) -> float:
    """µs per call of ``fn`` called ``iters`` times from Python (median of 3 rounds)."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    barrier()
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(rounds)


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the HBM ceiling we compare with."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1000.0) / 1e9


# --------------------------------------------------------------------------- worker

COLD_BYTES = 256 << 20  # several times the L2 of current GPUs (H100/H200: 50 MB)


def cold_copies(logits: torch.Tensor, calls: int) -> int:
    """How many copies of ``logits`` one CUDA graph of ``calls`` calls rotates through so that
    each call reads data no earlier call left in L2 (1 on CPU)."""
    if logits.device.type != "cuda":
        return 1
    nbytes = max(1, logits.numel() * logits.element_size())
    return max(1, min(calls, -(-COLD_BYTES // nbytes)))


def bench_logits(rows: int, width: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """float32 ``[rows, width]`` logits of the benchmark. ``randn``: N(0, 3^2), where the
    kernel's pruning can skip no column's noise (the worst case for Gumbel). ``lm``: like a
    language model's, N(0, 2.5^2) with 12 columns a row lifted to 18-19, where columns far
    below the top skip it."""
    import torch

    if kind == "randn":
        return torch.randn(rows, width, generator=gen).mul_(3)
    if kind == "lm":
        logits = torch.randn(rows, width, generator=gen).mul_(2.5)
        top = torch.randint(0, width, (rows, 12), generator=gen)
        return logits.scatter_(1, top, 18.0 + torch.rand(rows, 12, generator=gen))
    raise ValueError(f"unknown logits kind {kind!r} (randn or lm)")


def _floor_kernel(ll: Any, name: str) -> Any:
    """Kernel ``name`` of ``ll_floors.cu``, the benchmark references (compiled here only:
    the exchange never loads them), on the exchange's device."""
    from ..exchange import cuda_module

    return cuda_module.load_module(ll.device.index, cuda_module.FLOORS_FILE).get_function(name)


def philox_floor_call(ll: Any, cycle: Any, rows: int, width: int) -> Callable[[], None]:
    """One launch of the source's ``ll_philox_floor_bf16`` over the next bf16 logits of
    ``cycle``: the fused kernel's reads plus the Philox block of every column, nothing
    else. The contract fixes that noise, so where no column can be ruled out before its noise
    (``--logits randn``), no exact sampled kernel can beat this floor."""
    import numpy as np
    import torch

    from ..exchange.ll_plan import plan

    launch = plan(rows, width, "bfloat16", "sampled", ll.plan_sms)
    chunk, chunks = launch.chunk, launch.chunks
    kernel = _floor_kernel(ll, "ll_philox_floor_bf16")
    out = torch.zeros(launch.blocks * (launch.threads // 32), dtype=torch.int32, device=ll.device)

    def call() -> None:
        x = next(cycle)
        ll._launch(kernel, rows * chunks, 0,
                   (np.uint64(x.data_ptr()), np.int64(x.stride(0)), np.int32(width), np.int32(chunk),
                    np.int32(chunks), np.uint32(7), np.uint64(out.data_ptr())))

    return call


def read_floor_call(ll: Any, cycle: Any, rows: int, width: int) -> Callable[[], None]:
    """One launch of the source's ``ll_read_floor_bf16`` over the next bf16 logits of
    ``cycle``, with the greedy call's grid: the reads and a max key per block, stored with
    no hand-off between blocks and no exchange (the launch and reads of a greedy call)."""
    import numpy as np
    import torch

    from ..exchange.ll_plan import plan

    launch = plan(rows, width, "bfloat16", "greedy", ll.plan_sms)
    chunk, chunks = launch.chunk, launch.chunks
    kernel = _floor_kernel(ll, "ll_read_floor_bf16")
    out = torch.zeros(launch.blocks, dtype=torch.int64, device=ll.device)

    def call() -> None:
        x = next(cycle)
        ll._launch(kernel, rows * chunks, 0,
                   (np.uint64(x.data_ptr()), np.int64(x.stride(0)), np.int32(width), np.int32(chunk),
                    np.int32(chunks), np.uint64(out.data_ptr())))

    return call


def _bench_worker(rank: int, world_size: int, cfg: dict) -> list[dict]:
    import torch

    from .. import distributed as D
    from .. import keys as K
    from ..exchange import AllGatherKeyExchange, Channel

    group = D.tp_group()
    on_cuda = cfg["device"] == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    def barrier() -> None:
        D.all_gather_object(None, group)

    dtype = torch.bfloat16 if on_cuda else torch.float32
    ag = AllGatherKeyExchange(group, device=device)
    ll = solo = None
    solo_groups = []
    if on_cuda:
        from ..exchange.ll import LLKeyExchange

        ll = LLKeyExchange(group, max_rows=max(cfg["rows"]), num_channels=2)
        solo = ll  # at --tp 1 the exchange is the local stage alone
        if world_size > 1:
            # One-rank groups, created by every rank (collective), for the local stage alone.
            import torch.distributed as dist

            solo_groups = [dist.new_group([r], backend="gloo") for r in range(world_size)]
            solo = LLKeyExchange(solo_groups[rank], max_rows=max(cfg["rows"]), num_channels=1)
    copy_gbps = copy_bandwidth_gbps(device) if on_cuda and rank == 0 else None
    results: list[dict] = []

    def record(variant: str, how: str, rows: int, width: int, mode: str, us: float, **extra: Any) -> None:
        results.append(dict(variant=variant, how=how, rows=rows, width=width, mode=mode, us=us, **extra))

    gen = torch.Generator().manual_seed(1000 + rank)
    for rows in cfg["rows"]:
        keys = torch.randint(-(2**62), 2**62, (rows,), generator=gen).to(device)
        local_max = torch.randn(rows, generator=gen).to(device=device, dtype=dtype)
        local_arg = torch.randint(0, 1000, (rows,), generator=gen).to(device)
        if on_cuda:
            for variant, call in (("ll_max_keys", lambda: ll.max_keys(keys, channel=Channel.TARGET)),
                                  ("ll_argmax_tokens", lambda: ll.argmax_tokens(local_max, local_arg, 0, channel=Channel.TARGET))):
                per_window = _graph_windows_us(call, cfg["calls"], cfg["replays"], barrier)
                record(variant, "graph", rows, 0, "-", statistics.median(per_window),
                       us_mean=statistics.fmean(per_window))
            record("ll_max_keys", "eager", rows, 0, "-", _time_eager(lambda: ll.max_keys(keys), cfg["iters"],
                                                                     barrier, device))
        record("ag_max_keys", "eager", rows, 0, "-",
               _time_eager(lambda: ag.max_keys(keys), cfg["ag_iters"], barrier, device))
        for width in cfg["widths"]:
            logits = bench_logits(rows, width, cfg["logits"], gen).to(device=device, dtype=dtype)
            # Copies to rotate through, so timed calls read cold logits from HBM, not from L2.
            pool = [logits] + [logits.clone() for _ in range(cold_copies(logits, cfg["calls"]) - 1)]
            cycle = itertools.cycle(pool)
            offset = rank * width
            vocab = world_size * width
            nbytes = logits.numel() * logits.element_size()
            for mode in ("greedy", "gumbel"):
                kw: dict[str, Any] = {}
                if mode == "gumbel":
                    kw = dict(rows=K.SamplingRows(torch.full((rows,), 0.8, device=device),
                                                  torch.arange(rows, device=device) + 7,
                                                  torch.arange(rows, device=device) * 32))

                def torch_local() -> torch.Tensor:
                    x = next(cycle)
                    if mode == "greedy":  # what an engine does: max, canonical -0, pack (graph-capturable)
                        values, idx = x.max(dim=-1)
                        values = values.float()
                        values = torch.where(values == 0, torch.zeros_like(values), values)
                        return (K.ordered_high_bits(values) << 32) | (K.MASK32 - (idx + offset))
                    # keys.local_row_keys syncs (Philox column range): eager only.
                    return K.local_row_keys(x, offset, vocab_size=vocab, **kw)

                def torch_max_only() -> Any:
                    return torch.max(next(cycle), dim=-1)

                def ag_keys() -> torch.Tensor:
                    return K.unpack_indices(ag.max_keys(torch_local()))

                def ag_logits() -> torch.Tensor:
                    full = torch.empty(world_size * rows, width, dtype=dtype, device=device)
                    D.all_gather_into(full, logits, group)
                    full = full.view(world_size, rows, width).permute(1, 0, 2).reshape(rows, -1)
                    return full.float().argmax(dim=-1)

                if on_cuda:
                    us = _time_graph(lambda: ll.argmax_logits(next(cycle), offset, vocab_size=vocab, channel=Channel.DRAFT, **kw),
                                     cfg["calls"], cfg["replays"], barrier)
                    record("ll_fused", "graph", rows, width, mode, us)
                    us = _time_eager(lambda: ll.argmax_logits(next(cycle), offset, vocab_size=vocab, **kw),
                                     cfg["iters"], barrier, device)
                    record("ll_fused", "eager", rows, width, mode, us)
                    barrier()
                    if rank == 0:  # the local stage alone: one process on the GPU
                        nop = lambda: None  # noqa: E731
                        us = _time_graph(lambda: solo.argmax_logits(next(cycle), offset, vocab_size=vocab, **kw),
                                         cfg["calls"], cfg["replays"], nop)
                        record("local_fused", "graph", rows, width, mode, us,
                               hbm_gbps=nbytes / us / 1e3, hbm_pct=100 * nbytes / us / 1e3 / copy_gbps)
                        if mode == "greedy":
                            us = _time_graph(read_floor_call(solo, cycle, rows, width), cfg["calls"],
                                             cfg["replays"], nop)
                            record("local_read_floor", "graph", rows, width, mode, us,
                                   hbm_gbps=nbytes / us / 1e3, hbm_pct=100 * nbytes / us / 1e3 / copy_gbps)
                            us = _time_graph(torch_max_only, cfg["calls"], cfg["replays"], nop)
                            record("local_torch_max", "graph", rows, width, mode, us,
                                   hbm_gbps=nbytes / us / 1e3, hbm_pct=100 * nbytes / us / 1e3 / copy_gbps)
                            us, how = _time_graph(torch_local, cfg["calls"], cfg["replays"], nop), "graph"
                        else:
                            us, how = _time_eager(torch_local, cfg["ag_iters"], nop, device), "eager"
                        record("local_torch", how, rows, width, mode, us,
                               hbm_gbps=nbytes / us / 1e3, hbm_pct=100 * nbytes / us / 1e3 / copy_gbps)
                        if mode == "gumbel":
                            us = _time_graph(philox_floor_call(solo, cycle, rows, width), cfg["calls"],
                                             cfg["replays"], nop)
                            record("local_philox_floor", "graph", rows, width, mode, us,
                                   hbm_gbps=nbytes / us / 1e3, hbm_pct=100 * nbytes / us / 1e3 / copy_gbps)
                    barrier()
                else:
                    us = _time_eager(torch_local, cfg["iters"], barrier, device)
                    record("local_torch", "eager", rows, width, mode, us)
                    if mode == "greedy":
                        us = _time_eager(torch_max_only, cfg["iters"], barrier, device)
                        record("local_torch_max", "eager", rows, width, mode, us)
                record("ag_keys", "eager", rows, width, mode, _time_eager(ag_keys, cfg["ag_iters"], barrier, device))
                if mode == "greedy":
                    record("ag_logits", "eager", rows, width, mode,
                           _time_eager(ag_logits, cfg["ag_iters"], barrier, device))
    if ll is not None:
        ll.check()
        if solo is not ll:
            solo.close()
        ll.close()
    for row in results:
        row["rank"] = rank
    if copy_gbps is not None:
        results.append(dict(variant="copy_bandwidth", how="-", rows=0, width=0, mode="-", us=0.0,
                            hbm_gbps=copy_gbps, rank=rank))
    return results


# ------------------------------------------------------------------------ reporting

COLUMNS = ("tp", "rows", "width", "mode", "variant", "how", "us_per_call", "vs_ag_keys", "hbm_GBps", "hbm_pct")


def summarize(per_rank: list[list[dict]], tp: int, ag_label: str) -> tuple[list[list[Any]], dict]:
    """Rows of the table: per (variant, how, rows, width, mode) the slowest rank's µs."""
    merged: dict[tuple, dict] = {}
    extras: dict[str, Any] = {}
    for rank_rows in per_rank:
        for r in rank_rows:
            if r["variant"] == "copy_bandwidth":
                extras["copy_bandwidth_GBps"] = r["hbm_gbps"]
                continue
            key = (r["variant"], r["how"], r["rows"], r["width"], r["mode"])
            if key not in merged or r["us"] > merged[key]["us"]:
                merged[key] = r
    baseline = {(k[2], k[3], k[4]): v["us"] for k, v in merged.items() if k[0] == "ag_keys"}
    table = []
    for key in sorted(merged, key=lambda k: (k[2], k[3], k[4], k[0], k[1])):
        r = merged[key]
        base = baseline.get((key[2], key[3], key[4]))
        variant = r["variant"] + (f" ({ag_label})" if r["variant"].startswith("ag_") else "")
        table.append([
            tp, r["rows"], r["width"], r["mode"], variant, r["how"], round(r["us"], 3),
            round(base / r["us"], 2) if base and r["us"] > 0 else "",
            round(r["hbm_gbps"], 1) if "hbm_gbps" in r else "",
            round(r["hbm_pct"], 1) if "hbm_pct" in r else "",
        ])
    extras["local_fused_streaming"] = streaming_bandwidth(merged, extras.get("copy_bandwidth_GBps"))
    extras["gumbel_vs_greedy"] = gumbel_costs(merged)
    extras["greedy_vs_read_floor"] = greedy_costs(merged)
    extras["greedy_vs_torch_max"] = torch_max_speedups(merged)
    extras["exchange_mean_vs_median"] = exchange_means(per_rank)
    return table, extras


def _greedy_pairs(merged: dict[tuple, dict], partner: str) -> list[tuple[tuple, dict, dict]]:
    """``(key, local_fused row, partner row)`` per shape where the greedy local stage and the
    ``partner`` variant were both graphed with positive times, by rows then width."""
    out = []
    for key, fused in sorted(merged.items(), key=lambda kv: (kv[0][2], kv[0][3])):
        if key[:2] != ("local_fused", "graph") or key[4] != "greedy":
            continue
        other = merged.get((partner, "graph", key[2], key[3], "greedy"))
        if other is not None and fused["us"] > 0 and other["us"] > 0:
            out.append((key, fused, other))
    return out


UNEVEN_RATIO = 1.2  # a bare exchange whose mean window is this far above its median


def exchange_means(per_rank: list[list[dict]]) -> list[dict]:
    """Per graphed bare exchange (``ll_max_keys`` / ``ll_argmax_tokens``) and row count: the
    slowest rank's median window (what the table shows) beside the largest mean over the
    windows of any rank, and ``uneven`` when the mean is ``UNEVEN_RATIO`` times the median or
    more: some window was slowed (a rank stalled, and the others' calls waited for it)."""
    medians: dict[tuple, float] = {}
    means: dict[tuple, float] = {}
    for rank_rows in per_rank:
        for r in rank_rows:
            if "us_mean" in r:
                key = (r["variant"], r["rows"])
                medians[key] = max(medians.get(key, 0.0), r["us"])
                means[key] = max(means.get(key, 0.0), r["us_mean"])
    return [dict(variant=k[0], rows=k[1], median_us=round(medians[k], 3), mean_us=round(means[k], 3),
                 uneven=means[k] >= UNEVEN_RATIO * medians[k])
            for k in sorted(medians, key=lambda k: (k[1], k[0]))]


def torch_max_speedups(merged: dict[tuple, dict]) -> list[dict]:
    """Per shape with the greedy local stage and ``torch.max`` alone both graphed: how many
    times faster the fused call is. Empty on CPU."""
    return [dict(rows=key[2], width=key[3], greedy_us=fused["us"], torch_max_us=base["us"],
                 speedup=round(base["us"] / fused["us"], 2))
            for key, fused, base in _greedy_pairs(merged, "local_torch_max")]


def greedy_costs(merged: dict[tuple, dict]) -> list[dict]:
    """Per shape with the greedy local stage and the read-only floor both graphed: their µs
    and share of copy bandwidth per call, and the call as a multiple of the floor."""
    return [dict(rows=key[2], width=key[3], greedy_us=fused["us"], floor_us=floor["us"],
                 greedy_pct=fused.get("hbm_pct"), floor_pct=floor.get("hbm_pct"),
                 greedy_vs_floor=round(fused["us"] / floor["us"], 2))
            for key, fused, floor in _greedy_pairs(merged, "local_read_floor")]


def gumbel_costs(merged: dict[tuple, dict]) -> list[dict]:
    """Per shape with both local stages graphed: the Gumbel call and the Philox-only floor
    (when timed) as multiples of the greedy call. Empty on CPU (no fused kernel)."""
    def us(variant: str, rows: int, width: int, mode: str) -> float | None:
        r = merged.get((variant, "graph", rows, width, mode))
        return r["us"] if r and r["us"] > 0 else None

    out = []
    shapes = sorted({(k[2], k[3]) for k in merged if k[0] == "local_fused" and k[1] == "graph"})
    for rows, width in shapes:
        greedy, gumbel = us("local_fused", rows, width, "greedy"), us("local_fused", rows, width, "gumbel")
        if greedy is None or gumbel is None:
            continue
        floor = us("local_philox_floor", rows, width, "gumbel")
        out.append(dict(rows=rows, width=width, greedy_us=greedy, gumbel_us=gumbel, floor_us=floor,
                        gumbel_vs_greedy=round(gumbel / greedy, 2),
                        floor_vs_greedy=round(floor / greedy, 2) if floor is not None else None))
    return out


def streaming_bandwidth(merged: dict[tuple, dict], copy_gbps: float | None) -> list[dict]:
    """The local stage's bandwidth without its fixed cost (launch, ramp-up, the hand-off
    of block keys, the exchange tail): at the largest row count, extra bytes over extra
    time between the narrowest and the widest slice, per mode. Empty without two widths."""
    out = []
    for mode in ("greedy", "gumbel"):
        points = {(k[2], k[3]): v for k, v in merged.items()
                  if k[0] == "local_fused" and k[1] == "graph" and k[4] == mode and "hbm_gbps" in v}
        if not points:
            continue
        rows = max(r for r, _ in points)
        widths = sorted(w for r, w in points if r == rows)
        if len(widths) < 2:
            continue
        narrow, wide = points[(rows, widths[0])], points[(rows, widths[-1])]
        extra_us = wide["us"] - narrow["us"]
        if extra_us <= 0:
            continue
        bytes_per_col = wide["hbm_gbps"] * 1e3 * wide["us"] / (rows * widths[-1])  # element size
        gbps = rows * (widths[-1] - widths[0]) * bytes_per_col / extra_us / 1e3
        out.append(dict(mode=mode, rows=rows, widths=[widths[0], widths[-1]], us=[narrow["us"], wide["us"]],
                        GBps=round(gbps, 1), pct_of_copy=round(100 * gbps / copy_gbps, 1) if copy_gbps else None))
    return out


def _plot(table: list[list[Any]]) -> Callable[[Any], None]:
    def draw(ax: Any) -> None:
        widths = sorted({r[2] for r in table if r[2]})
        width = widths[-1] if widths else 0
        series: dict[str, list[tuple[int, float]]] = {}
        for r in table:
            if (r[2] == width or r[2] == 0) and isinstance(r[6], float):
                series.setdefault(f"{r[4]} {r[5]} {r[3]}", []).append((r[1], r[6]))
        styles = ("-", "--", ":", "-.")  # more series than colours: vary the line too
        for i, (name, points) in enumerate(sorted(series.items())):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="os^D"[i // 10 % 4],
                    linestyle=styles[i // 10 % 4], color=f"C{i % 10}", label=name)
        report.log_log_axes(ax, xlabel="rows", ylabel="µs per call (slowest rank)", legend_fontsize=6,
                            title=f"tpspec bench exchange, slice width {width}")
        ax.grid(True, which="both", alpha=0.3)

    return draw


# ---------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=2, help="rank processes (default 2)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda (default when available) or cpu (gloo, all-gather variants only)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few iterations")
    parser.add_argument("--rows", type=str, default=None, help="comma-separated row counts")
    parser.add_argument("--widths", type=str, default=None, help="comma-separated slice widths")
    parser.add_argument("--logits", choices=("randn", "lm"), default="randn",
                        help="randn: N(0, 9), the worst case for the Gumbel pruning; lm: a few columns far above "
                             "the rest, like a language model's")
    parser.add_argument("--calls-per-graph", type=int, default=20)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--iters", type=int, default=200, help="eager iterations of the LL variants")
    parser.add_argument("--ag-iters", type=int, default=20, help="eager iterations of the all-gather variants")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the rank processes are killed")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..testing import run_ranks, shared_gpu_mps

    if args.tp < 1:
        raise SystemExit("--tp must be >= 1")
    device = bench_device(args.device, "tpspec bench exchange")
    quick = args.quick
    cfg = dict(
        device=device,
        logits=args.logits,
        rows=number_list(args.rows, QUICK_ROWS if quick else DEFAULT_ROWS, option="--rows"),
        widths=number_list(args.widths, QUICK_WIDTHS if quick else DEFAULT_WIDTHS, option="--widths"),
        calls=max(1, args.calls_per_graph if not quick else min(args.calls_per_graph, 5)),
        replays=max(1, args.replays if not quick else min(args.replays, 5)),
        iters=max(1, args.iters if not quick else min(args.iters, 10)),
        ag_iters=max(1, args.ag_iters if not quick else min(args.ag_iters, 5)),
    )
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    ag_label = "gloo"  # the rank processes are bootstrapped with gloo (NCCL refuses ranks sharing a GPU)
    with shared_gpu_mps(device, args.tp) as mps_note:
        if mps_note is not None:
            print(f"warning: MPS is not running ({mps_note}); ranks sharing a GPU will time-slice (~ms per exchange)")
        per_rank = run_ranks(_bench_worker, args.tp, cfg, backend="gloo", timeout_s=args.timeout)
    table, extras = summarize(per_rank, args.tp, ag_label)
    meta = dict(cfg, tp=args.tp, gpus=gpus, mps=(mps_note is None) if device == "cuda" else None,
                mps_note=mps_note, allgather_backend=ag_label, **extras,
                note="ag_* variants use gloo (NCCL refuses several ranks on one GPU); local_* run on one "
                     "process alone; us_per_call is the slowest rank's")
    report.write_report(args.out, "exchange", columns=COLUMNS, rows=table, meta=meta, plot=_plot(table))
    for item in extras["gumbel_vs_greedy"]:
        floor = f", reads + Philox alone {item['floor_vs_greedy']}x" if item["floor_vs_greedy"] is not None else ""
        print(f"local stage {item['rows']} x {item['width']}: Gumbel {item['gumbel_vs_greedy']}x greedy{floor}")
    for item in extras["greedy_vs_read_floor"]:
        pct = (f" ({item['greedy_pct']:.1f} % vs {item['floor_pct']:.1f} % of copy bandwidth per call)"
               if item["greedy_pct"] is not None and item["floor_pct"] is not None else "")
        print(f"local stage {item['rows']} x {item['width']} greedy: {item['greedy_us']:.2f} us, one launch that "
              f"only reads {item['floor_us']:.2f} us: {item['greedy_vs_floor']}x{pct}")
    for item in extras["greedy_vs_torch_max"]:
        print(f"local stage {item['rows']} x {item['width']} greedy: {item['greedy_us']:.2f} us, torch.max alone "
              f"{item['torch_max_us']:.2f} us: {item['speedup']}x faster")
    for item in extras["local_fused_streaming"]:
        print(f"local stage streaming ({item['mode']}, {item['rows']} rows, slice {item['widths'][0]} -> "
              f"{item['widths'][1]}): {item['GBps']} GB/s ({item['pct_of_copy']} % of copy bandwidth)")
    for item in extras["exchange_mean_vs_median"]:
        if item["uneven"]:
            print(f"note: {item['variant']} at {item['rows']} rows: mean window {item['mean_us']:.2f} us against the "
                  f"median {item['median_us']:.2f} us shown (some window was slowed: a rank stalled)")
    return 0
