"""``tpspec bench gemv``: the decode-sized linears alone, cuBLAS (``F.linear``) against the Triton GEMV.

For one rank of ``--model-shape`` (default llama-3-8b) at ``--tp`` (default 1): the weights of one
layer's four linears (fused qkv, o_proj, fused gate_up, down_proj) and the LM head's vocabulary
shard, each ``[N, K]`` in ``--dtype`` (default bfloat16), times ``x [batch, K]`` for every
``--batch`` (default 1,2,4,8,16: decode and verification rows). ``--kernels`` (default
``torch,triton``): ``torch`` is ``F.linear``, ``triton`` is :func:`tpspec.model.gemv_triton.linear`.

On CUDA each configuration is one CUDA graph of many calls that rotate through enough copies of
the weight (at most 32) that every call reads it from memory, not from the L2 cache. The table
reports microseconds per call, the bytes a call moves (weight, input and output) over that time
(``GBps``), that as a share of the device-to-device copy bandwidth measured in the same run, the
speed-up over ``F.linear`` on the same configuration and the largest absolute difference from
``F.linear``'s output. The JSON's meta adds the step these times add up to (``num_layers``
layers and the LM head) per kernel and batch. On CPU (a smoke run; ``triton`` only under
``TRITON_INTERPRET=1``, and slow there) the calls run eagerly and the times mean little.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from . import bench_device, number_list, report, seconds_per_call
from .overrides import add_set_argument, apply_overrides, parse_overrides

if TYPE_CHECKING:
    import torch

COLUMNS = ["linear", "N", "K", "batch", "kernel", "us", "GBps", "pct_copy_bw", "speedup_vs_torch", "max_abs_err"]
KERNELS = ("torch", "triton")
L2_BYTES = 256 << 20  # several times the L2 of current GPUs: the copies one graph rotates through read more
MAX_COPIES = 32
MIN_CALLS = 32  # calls per graph, at least


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..model.shape_table import MODEL_SHAPES  # torch-free: --help imports no torch

    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama-3-8b",
                        help="the linears of this shape (default llama-3-8b)")
    parser.add_argument("--tp", type=int, default=1, help="one rank's shards at this TP size (default 1)")
    parser.add_argument("--vocab-size", type=int, default=None, help="the LM head's vocabulary (default: the shape's)")
    parser.add_argument("--kernels", default="torch,triton", help="comma-separated, of torch, triton (default both)")
    parser.add_argument("--batch", default=None, help="rows of x (default 1,2,4,8,16)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--iters", type=int, default=20, help="timed graph replays per configuration (default 20)")
    add_set_argument(parser)


def linear_shapes(cfg: Any, tp: int) -> dict[str, tuple[int, int]]:
    """``{name: (N, K)}`` of one rank's weights at TP ``tp``: qkv, o, gate_up, down, lm_head
    (``ValueError`` when the heads or the MLP do not split)."""
    from ..model.layers import split_evenly, split_heads
    from ..vocab_parallel import vocab_shard_bounds

    heads = split_heads(cfg, tp, 0)
    hd, hidden = cfg.head_dim, cfg.hidden_size
    _, inter = split_evenly("intermediate_size", cfg.intermediate_size, tp, 0)
    _, vocab_width, _ = vocab_shard_bounds(cfg.vocab_size, tp, 0)
    return {"qkv": ((heads.q_heads + 2 * heads.kv_heads) * hd, hidden), "o": (hidden, heads.q_heads * hd),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (vocab_width, hidden)}


def _time(fn: Any, x: torch.Tensor, weights: list[torch.Tensor], *, iters: int) -> float:
    """Seconds per call of ``fn(x, w)``, rotating through ``weights``."""
    calls = len(weights) * -(-MIN_CALLS // len(weights)) if x.is_cuda else len(weights)

    def run() -> None:
        for i in range(calls):
            fn(x, weights[i % len(weights)])

    return seconds_per_call(run, iters, cuda=x.is_cuda) / calls


def _kernels_or_exit(names: list[str], device: torch.device, dtype: torch.dtype, rows: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from ..model.linear import gemv_kernels

    fns: dict[str, Any] = {}
    for name in names:
        if name == "torch":
            fns[name] = F.linear
            continue
        kernels = gemv_kernels()
        if kernels is None:
            raise SystemExit("tpspec bench gemv: --kernels triton needs the triton package (pip install triton)")
        if rows > kernels.MAX_ROWS:
            raise SystemExit(f"tpspec bench gemv: --batch {rows}: the Triton GEMV takes at most {kernels.MAX_ROWS} rows")
        if kernels.INTERPRETED != (device.type == "cpu"):
            raise SystemExit("tpspec bench gemv: --kernels triton runs on CUDA, and on CPU only under Triton's "
                             "interpreter (set TRITON_INTERPRET=1 before triton is imported); "
                             f"device is {device}" + (" with the interpreter on" if kernels.INTERPRETED else ""))
        if kernels.INTERPRETED and dtype == torch.bfloat16:
            raise SystemExit("tpspec bench gemv: Triton's interpreter has no bfloat16 tl.dot: give --dtype float16 "
                             "or float32 on CPU")
        fns[name] = kernels.linear
    return fns


def run(args: argparse.Namespace) -> int:
    import torch

    from ..model.shapes import shape_config
    from .exchange import copy_bandwidth_gbps

    command = "tpspec bench gemv"
    overrides = parse_overrides(args.set, option=f"{command}: --set")
    apply_overrides(overrides)
    device = torch.device(bench_device(args.device, command))
    names = [k.strip() for k in args.kernels.split(",") if k.strip()]
    bad = [k for k in names if k not in KERNELS]
    if bad or not names:
        raise SystemExit(f"{command}: --kernels: unknown {bad or args.kernels!r}; known: {list(KERNELS)}")
    batches = number_list(args.batch, (1, 2, 4, 8, 16), option="--batch")
    if args.tp < 1:
        raise SystemExit(f"{command}: --tp must be a positive integer, got {args.tp}")
    try:
        cfg = shape_config(args.model_shape, vocab_size=args.vocab_size)
        shapes = linear_shapes(cfg, args.tp)
    except ValueError as exc:
        raise SystemExit(f"{command}: {exc}") from None
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, named by its index
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    fns = _kernels_or_exit(names, device, dtype, max(batches))
    elem = torch.empty((), dtype=dtype).element_size()
    copy_gbps = copy_bandwidth_gbps(device) if device.type == "cuda" else None
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for linear_name, (n, k) in shapes.items():
        w_bytes = n * k * elem
        copies = min(MAX_COPIES, max(1, -(-L2_BYTES // w_bytes))) if device.type == "cuda" else 1
        weights = [torch.empty(n, k, dtype=dtype, device=device).normal_(std=k**-0.5, generator=gen)
                   for _ in range(copies)]
        for b in batches:
            x = torch.empty(b, k, dtype=dtype, device=device).normal_(generator=gen)
            want = torch.nn.functional.linear(x, weights[0])
            base = None
            for name, fn in fns.items():
                err = (fn(x, weights[0]).float() - want.float()).abs().max().item()
                seconds = _time(fn, x, weights, iters=args.iters)
                gbps = (w_bytes + (b * k + b * n) * elem) / seconds / 1e9
                base = seconds if name == "torch" else base
                results.append(dict(linear=linear_name, N=n, K=k, batch=b, kernel=name, us=seconds * 1e6, GBps=gbps,
                                    pct_copy_bw=100.0 * gbps / copy_gbps if copy_gbps else None,
                                    speedup_vs_torch=base / seconds if base else None, max_abs_err=err))
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    step_us = {name: {b: sum(r["us"] * (1 if r["linear"] == "lm_head" else cfg.num_layers) for r in results
                             if r["kernel"] == name and r["batch"] == b) for b in batches} for name in fns}
    rows = [[r[c] if r[c] is not None else "-" for c in COLUMNS] for r in results]
    meta = dict(model_shape=args.model_shape, tp=args.tp, num_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
                dtype=args.dtype, device=str(device), iters=args.iters, copy_bandwidth_GBps=copy_gbps,
                graphs=device.type == "cuda", shapes={k: list(v) for k, v in shapes.items()},
                step_us_estimate=step_us, overrides=overrides)
    for name, by_batch in step_us.items():
        print(f"{name}: {cfg.num_layers} layers + LM head, us per step by batch: "
              + ", ".join(f"{b}: {us:.1f}" for b, us in by_batch.items()))

    def plot(ax: Any) -> None:
        for name in fns:
            for linear_name in shapes:
                pts = [(r["batch"], r["us"]) for r in results if r["kernel"] == name and r["linear"] == linear_name]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if name == "torch" else "s",
                        linestyle="-" if name == "torch" else "--", label=f"{name} {linear_name}")
        report.log_log_axes(ax, xlabel="batch (rows of x)", ylabel="microseconds per call", legend_fontsize=7,
                            title=f"decode linears, {args.model_shape} TP {args.tp}, {args.dtype}")

    report.write_report(args.out, "gemv", columns=COLUMNS, rows=rows, meta=meta, plot=plot)
    return 0
