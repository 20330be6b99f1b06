"""``tpspec bench``: benchmarks that compare our path with the baselines side by side.

Each benchmark is a module of this package exposing ``add_arguments(parser)`` and
``run(args) -> int``; it prints a table and writes ``<out>/<name>.json`` and
``<out>/<name>.png`` through :mod:`tpspec.bench.report`.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "exchange": ("tpspec.bench.exchange", "LL exchange vs all-gather of keys vs all-gather of full logits"),
    "step": ("tpspec.bench.step", "one speculative decode step: sharded selection vs full-logit gather"),
    "generate": ("tpspec.bench.generate", "end-to-end tokens/s with and without speculation"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    sub.required = True
    for name, (module_name, help_text) in BENCHMARKS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_bench_module=module_name)
        cmd.add_argument("--out", default="bench-out", help="folder for the JSON and PNG (default: bench-out)")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # not built yet: running it reports so
        module.add_arguments(cmd)


def run(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module(args._bench_module)
    except ImportError as exc:
        raise SystemExit(f"tpspec bench {args.benchmark}: not available in this build ({exc})")
    return int(module.run(args) or 0)
