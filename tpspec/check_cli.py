"""``tpspec check``: the command line of the determinism suite (:mod:`tpspec.check`). Its
arguments are defined here, apart from the suite, so ``tpspec check --help`` imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=None, help="ranks of the TP group (default: 2; torchrun: WORLD_SIZE)")
    parser.add_argument("--launcher", choices=("mp", "torchrun", "ray"), default="mp",
                        help="mp: local processes; torchrun: run under torchrun on every rank; ray: Ray actors")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (seconds)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of every input the suite builds (default: the suite's own fixed seed)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before unfinished ranks fail the run")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--skip", default="", metavar="KEYS",
                        help="comma-separated keys of properties not to run (an unknown key's error lists them)")


def run(args: argparse.Namespace) -> int:
    from . import distributed as D
    from .check import (DEFAULT_SEED, PASS, TITLES, exit_code, format_results, order_results, run_mp, run_ray,
                        run_torchrun)
    from .validation import resolve_device

    if args.seed is None:
        args.seed = DEFAULT_SEED
    try:
        device = resolve_device(args.device or "auto")
    except ValueError as exc:
        raise SystemExit(f"tpspec check: --device: {exc}") from None
    if args.tp is not None and args.tp < 1:
        raise SystemExit(f"tpspec check: --tp must be >= 1, got {args.tp}")
    skip = frozenset(k.strip() for k in args.skip.split(",") if k.strip())
    unknown = sorted(skip - set(TITLES))
    if unknown:
        raise SystemExit(f"tpspec check: unknown --skip keys {unknown}; known: {', '.join(TITLES)}")
    started = time.monotonic()
    rank = 0
    try:
        if args.launcher == "torchrun":
            results, rank = run_torchrun(args.tp, device, quick=args.quick, seed=args.seed, skip=skip)
            tp = D.group_size()
        elif args.launcher == "ray":
            tp = args.tp or 2
            results = run_ray(tp, device, quick=args.quick, seed=args.seed, timeout_s=args.timeout, skip=skip)
        else:
            tp = args.tp or 2
            results = run_mp(tp, device, quick=args.quick, seed=args.seed, timeout_s=args.timeout, skip=skip)
    except (RuntimeError, ValueError) as exc:  # the launcher could not run the suite at all
        raise SystemExit(f"tpspec check: {exc}") from None
    results = order_results(results)
    code = exit_code(results)
    if rank == 0:
        print(f"tpspec check: TP={tp}, launcher={args.launcher}, device={device}, "
              f"{'quick' if args.quick else 'full'}, seed={args.seed}, {time.monotonic() - started:.1f} s")
        print(format_results(results, color=sys.stdout.isatty() and "NO_COLOR" not in os.environ))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tp": tp, "launcher": args.launcher, "device": device, "quick": args.quick,
                           "seed": args.seed, "passed": code == 0,
                           "complete": all(r.status == PASS for r in results),
                           "results": [dataclasses.asdict(r) | {"title": r.title} for r in results]}, f, indent=2)
    if args.launcher == "torchrun":
        D.destroy_distributed()
    return code
