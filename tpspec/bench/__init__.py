"""``tpspec bench``: benchmarks that compare our path with the baselines side by side.

Each benchmark is a module of this package exposing ``add_arguments(parser)`` and
``run(args) -> int``; it prints a table and writes ``<out>/<name>.json`` and
``<out>/<name>.png`` through :mod:`tpspec.bench.report`. Only the chosen benchmark's module is
imported, when its name is parsed (``bench serve``, a client, never imports torch).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any, Sequence

BENCHMARKS: dict[str, tuple[str, str]] = {
    "exchange": ("tpspec.bench.exchange", "LL exchange vs all-gather of keys vs all-gather of full logits"),
    "step": ("tpspec.bench.step", "one speculative decode step: sharded selection vs full-logit gather; the "
                                  "runtime's steps against the roofline"),
    "generate": ("tpspec.bench.generate", "end-to-end tokens/s with and without speculation, and against "
                                          "Hugging Face transformers"),
    "serve": ("tpspec.bench.serve", "an OpenAI-compatible server under load: throughput, TTFT, TPOT, ITL, E2EL"),
    "attention": ("tpspec.bench.attention", "the paged attention backends alone at a model's attention shapes"),
    "gemv": ("tpspec.bench.gemv", "the decode-sized linears alone: cuBLAS (F.linear) vs the Triton GEMV"),
}


def seconds_per_call(fn: Any, iters: int, *, cuda: bool, warmups: int = 1) -> float:
    """Seconds per call of ``fn()`` after ``warmups`` untimed calls (compilation, allocation). On
    CUDA the warm-up runs on a side stream, ``fn`` is captured once in a CUDA graph and the
    graph is timed over ``iters`` replays after 3 untimed ones (CUDA events); elsewhere ``iters``
    eager calls are timed."""
    import time

    if not cuda:
        for _ in range(warmups):
            fn()
        start_s = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start_s) / iters
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / 1000.0 / iters


def number_list(text: str | None, default: Sequence[Any], *, option: str, kind: type = int,
                minimum: float = 1) -> list[Any]:
    """The comma-separated numbers of a command-line ``option`` (``default`` when it is not
    given); ``SystemExit`` naming the option for anything else than ``kind`` values >= ``minimum``."""
    if text is None:
        return list(default)
    what = "integers" if kind is int else "numbers"
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{option}: expected comma-separated {what}, got {text!r}") from None
    if not values or min(values) < minimum:
        bound = f"positive {what}" if minimum == 1 else f"{what} >= {minimum:g}"
        raise SystemExit(f"{option}: expected {bound}, got {text!r}")
    return values


def bench_device(device: str | None, command: str) -> str:
    """``--device`` resolved (default: cuda when available); ``SystemExit`` naming the
    command for a device this host does not have."""
    from ..validation import resolve_device

    try:
        return resolve_device(device or "auto")
    except ValueError as exc:
        raise SystemExit(f"{command}: --device: {exc}") from None


def model_shape_path(args: argparse.Namespace, command: str) -> str | None:
    """The ``shape:`` model path of ``--model-shape`` (with ``--num-layers`` / ``--vocab-size``),
    None without it; ``SystemExit`` naming the command when ``--model`` is given too."""
    from ..model.shapes import shape_path

    if args.model_shape is None:
        return None
    if args.model != "tiny":
        raise SystemExit(f"{command}: give --model or --model-shape, not both")
    try:
        return shape_path(args.model_shape, args.num_layers, args.vocab_size)
    except ValueError as exc:
        raise SystemExit(f"{command}: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..cli import lazy_subcommands

    sub = lazy_subcommands(parser, dest="benchmark", metavar="BENCHMARK")
    for name, (module_name, help_text) in BENCHMARKS.items():
        cmd = sub.add_lazy(name, lambda p, m=module_name: _add_benchmark_arguments(p, m), help=help_text,
                           description=help_text)
        cmd.set_defaults(_bench_module=module_name)
        cmd.add_argument("--out", default="bench-out", help="folder for the JSON and PNG (default: bench-out)")


def _add_benchmark_arguments(parser: argparse.ArgumentParser, module_name: str) -> None:
    """The chosen benchmark's own arguments (its module is imported only now)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return  # not built yet: running it reports so
    module.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module(args._bench_module)
    except ImportError as exc:
        raise SystemExit(f"tpspec bench {args.benchmark}: not available in this build ({exc})")
    return int(module.run(args) or 0)
