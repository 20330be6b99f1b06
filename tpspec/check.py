"""``tpspec check``: the determinism contract (docs/determinism.md), run on the user's own machines.

Every property (numbered by the rules of docs/determinism.md) is one row of a pass/fail table,
with its evidence (rows compared, mismatches, p-values). The exit code is 0 only when
no row fails. A row reads PASS only when every part of it ran; a row whose layer is
missing from this build or does not apply on this device (the LL exchange and CUDA graphs
on CPU) reads SKIP with the reason, and a row of which only a part could run (the
exchange-level half of the CUDA-graph row when the runtime's half needs more GPUs than
there are) reads PARTIAL with what did not run and why. Neither fails the run.

Three ways to run it:

* ``tpspec check --tp N --launcher mp|torchrun|ray [--device cpu|cuda] [--quick]``
  (``mp``: N local processes; ``torchrun``: the command itself runs on every rank,
  rank 0 prints; ``ray``: one Ray actor per rank, through the runtime's launcher; the
  command line lives in :mod:`tpspec.check_cli`);
* ``pytest --pyargs tpspec.check`` (one test per property; ``TPSPEC_CHECK_TP``,
  ``TPSPEC_CHECK_DEVICE``, ``TPSPEC_CHECK_QUICK`` choose the run);
* inside any process group: ``run_suite(SuiteContext.create(...))`` on every rank, or
  ``tpspec.testing.run_ranks(tpspec.check.suite_worker, N)``.

The checks themselves live in :mod:`tpspec.check_tests` (re-exported here); this module
runs them on the ranks, merges every rank's results into one row per property and
prints the table.

Test hook: ``TPSPEC_TEST_PERTURB_RANK=r`` makes the suite's own exchange wrapper flip the
first token of every selection on rank ``r`` (the library's exchanges are untouched), so
the suite can show that it catches ranks that disagree.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

from . import distributed as D
from .validation import resolve_device
from .check_tests import (
    DEFAULT_SEED,
    EMULATED_TP_SIZES,
    FAIL,
    P_VALUE_THRESHOLD,
    PARTIAL,
    PASS,
    PERTURB_ENV,
    PROPERTIES,
    RANK_CHECKS,
    SKIP,
    TITLES,
    CheckResult,
    PerturbedExchange,
    Skip,
    SuiteContext,
    adversarial_logits,
    chi_square,
    driver_checks,
    emulated_tokens,
    run_suite,
    splittable_tp_sizes,
    suite_worker,
)

__all__ = [  # the suite's public names, most of them defined in tpspec.check_tests
    "DEFAULT_SEED", "EMULATED_TP_SIZES", "FAIL", "PARTIAL", "P_VALUE_THRESHOLD", "PASS", "PERTURB_ENV", "PROPERTIES",
    "RANK_CHECKS", "SKIP", "TITLES", "CheckResult", "PerturbedExchange", "Skip",
    "SuiteContext", "adversarial_logits", "chi_square", "combine", "driver_checks", "emulated_tokens",
    "exit_code", "format_results", "merge_rank_results", "order_results", "run_mp", "run_ray", "run_suite",
    "run_torchrun", "splittable_tp_sizes", "suite_worker",
]


# ----------------------------------------------------------------------- merging, table

def merge_rank_results(per_rank: list[list[dict[str, Any]]]) -> list[CheckResult]:
    """One result per property from every rank's: FAIL when any rank failed (its detail
    first), SKIP when every rank skipped, PARTIAL when a rank reported PARTIAL or some ranks
    skipped what others ran, else PASS; rows from rank 0, mismatches summed, smallest p."""
    by_key: dict[str, list[CheckResult]] = {}
    for rank_results in per_rank:
        for r in rank_results:
            r = r if isinstance(r, CheckResult) else CheckResult(**r)
            by_key.setdefault(r.key, []).append(r)
    merged = []
    for key, results in by_key.items():
        failed = [(i, r) for i, r in enumerate(results) if r.status == FAIL]
        statuses = {r.status for r in results}
        if failed:
            status = FAIL
        elif statuses == {SKIP}:
            status = SKIP
        else:
            status = PASS if statuses == {PASS} else PARTIAL
        if failed and key != "ranks_agree" and len(results) > 1:
            detail = "; ".join(f"rank {i}: {r.detail}" for i, r in failed[:2])
        else:
            detail = results[0].detail if not failed else failed[0][1].detail
        if key == "ranks_agree":  # computed collectively: every rank holds the same numbers
            mismatches = results[0].mismatches
        else:
            mismatches = sum(r.mismatches for r in results)
        ps = [r.p_value for r in results if r.p_value is not None]
        merged.append(CheckResult(key, status, results[0].rows, mismatches, min(ps) if ps else None, detail))
    return merged


def combine(a: CheckResult, b: CheckResult) -> CheckResult:
    """Two parts of one property (e.g. the exchange-level and the runtime-level CUDA-graph
    checks): FAIL if either failed; SKIP only if both skipped; PASS only if both passed;
    otherwise PARTIAL, whose detail says what did not run and why. Evidence added up."""
    if a.status == SKIP and b.status == SKIP:
        return CheckResult(a.key, SKIP, detail="; ".join(dict.fromkeys(d for d in (a.detail, b.detail) if d)))
    if SKIP in (a.status, b.status):
        ran, skipped = (a, b) if b.status == SKIP else (b, a)
        status = FAIL if ran.status == FAIL else PARTIAL
        return dataclasses.replace(ran, status=status, detail=f"{ran.detail}; not run: {skipped.detail}")
    statuses = {a.status, b.status}
    status = FAIL if FAIL in statuses else (PASS if statuses == {PASS} else PARTIAL)
    ps = [p for p in (a.p_value, b.p_value) if p is not None]
    return CheckResult(a.key, status, a.rows + b.rows, a.mismatches + b.mismatches, min(ps) if ps else None,
                       f"{a.detail}; {b.detail}")


def order_results(results: list[CheckResult]) -> list[CheckResult]:
    """Table order of the determinism contract (docs/determinism.md), one row per property (several results of one property are
    combined); properties nobody reported read SKIP."""
    by_key: dict[str, CheckResult] = {}
    for r in results:
        by_key[r.key] = combine(by_key[r.key], r) if r.key in by_key else r
    ordered = [by_key.pop(key, CheckResult(key, SKIP, detail="not run by this launcher")) for key, _ in PROPERTIES]
    return ordered + list(by_key.values())


def format_results(results: list[CheckResult], *, color: bool = False) -> str:
    """The pass/fail table: property, result, rows compared, mismatches, p-value, detail."""
    header = ["property", "result", "rows", "mismatches", "p-value", "detail"]
    body = [[r.title, r.status, str(r.rows) if r.status != SKIP else "-",
             str(r.mismatches) if r.status != SKIP else "-",
             f"{r.p_value:.3g}" if r.p_value is not None else "-", r.detail] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header[:-1])]
    paint = {PASS: "\033[32m", PARTIAL: "\033[33m", FAIL: "\033[31;1m", SKIP: "\033[33m"}

    def line(cells: list[str], status: str | None = None) -> str:
        parts = []
        for i, cell in enumerate(cells[:-1]):
            text = cell.rjust(widths[i]) if i >= 2 else cell.ljust(widths[i])
            if i == 1 and color and status:
                text = f"{paint[status]}{text}\033[0m"
            parts.append(text)
        return "  ".join(parts + [cells[-1]])

    lines = [line(header), "  ".join("-" * w for w in widths) + "  ------"]
    lines += [line(row, r.status) for row, r in zip(body, results)]
    counts = {status: sum(r.status == status for r in results) for status in (PASS, PARTIAL, FAIL, SKIP)}
    lines.append(f"{counts[PASS]} passed, {counts[PARTIAL]} partial, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    return "\n".join(lines)


def exit_code(results: list[CheckResult]) -> int:
    """0 when no property failed (PARTIAL and SKIP do not fail), else 1."""
    return 1 if any(r.status == FAIL for r in results) else 0


# ---------------------------------------------------------------------------- launchers

def run_mp(tp: int, device: str = "cpu", *, quick: bool = False, seed: int = DEFAULT_SEED,
           timeout_s: float = 600.0, skip: frozenset[str] = frozenset()) -> list[CheckResult]:
    """The whole suite on ``tp`` fresh local processes (``run_ranks``); returns the merged rows."""
    from .testing import RankError, rank_backend, run_ranks, shared_gpu_mps

    # Ranks sharing GPUs: without MPS every cross-process wait of the LL exchange costs a time slice (ms).
    with shared_gpu_mps(device, tp) as why:
        if why is not None:
            print(f"tpspec check: MPS not started ({why}); ranks sharing a GPU will time-slice", file=sys.stderr)
        try:
            per_rank = run_ranks(suite_worker, tp, device, quick, seed, frozenset(skip), timeout_s=timeout_s,
                                 backend=rank_backend(device, tp))
            results = merge_rank_results(per_rank)
        except RankError as exc:
            results = [CheckResult("ranks_agree", FAIL,
                                   detail=f"the rank processes failed: {str(exc).splitlines()[0]}")]
            print(exc, file=sys.stderr)
    return results + driver_checks(tp, device, quick=quick, seed=seed, launcher="mp", skip=skip)


def run_torchrun(tp: int | None, device: str = "cpu", *, quick: bool = False, seed: int = DEFAULT_SEED,
                 skip: frozenset[str] = frozenset()) -> tuple[list[CheckResult], int]:
    """The suite as one rank of a torchrun job (every rank runs this); returns the merged
    rows (the same on every rank) and this rank's index."""
    if os.environ.get("RANK") is None or os.environ.get("WORLD_SIZE") is None:
        raise RuntimeError("--launcher torchrun: RANK/WORLD_SIZE are not set; start it as "
                           "`torchrun --nproc-per-node N -m tpspec check --launcher torchrun`")
    world = int(os.environ["WORLD_SIZE"])
    if tp is not None and tp != world:
        raise ValueError(f"--tp {tp} differs from torchrun's WORLD_SIZE={world}")
    from .runtime.launchers import GroupSpec, InProcessExecutor

    # The group stays up after the call: the driver checks below run LLMs on it.
    executor = InProcessExecutor(GroupSpec(world, device, backend="gloo" if device == "cpu" else None))
    executor.start()
    rank = executor.local_rank or 0
    mine = executor.call(suite_on_rank, quick, seed, frozenset(skip))[rank]
    everyone = D.all_gather_object(mine)
    results = merge_rank_results(everyone)
    return (results + driver_checks(world, device, quick=quick, seed=seed, launcher="torchrun", skip=skip),
            rank)


def suite_on_rank(ctx: Any, quick: bool, seed: int, skip: frozenset[str]) -> list[dict[str, Any]]:
    """Executor call: the rank-level suite on this rank's device, as plain dicts."""
    ctx_device = str(ctx.device) if ctx.device.type == "cuda" else "cpu"
    return [dataclasses.asdict(r) for r in run_suite(SuiteContext.create(ctx_device, quick=quick, seed=seed), skip)]


def run_ray(tp: int, device: str = "cpu", *, quick: bool = False, seed: int = DEFAULT_SEED,
            timeout_s: float = 600.0, skip: frozenset[str] = frozenset()) -> list[CheckResult]:
    """The suite on ``tp`` Ray actors, one per rank, through the runtime's Ray executor (a
    placement group of ``{"GPU": 1}`` bundles, or ``{"CPU": 1}`` on CPU; every actor of a
    node sees all of that node's GPUs). Joins the cluster ``RAY_ADDRESS`` names, else starts
    a local Ray for the run. Bounded waits: a rank that makes no progress within
    ``timeout_s`` fails the run."""
    from .runtime.launchers import GroupSpec, RayExecutor

    spec = GroupSpec(tp, device, backend="nccl" if device == "cuda" else "gloo", num_threads=1)
    with RayExecutor(spec, init_timeout_s=timeout_s, timeout_s=timeout_s) as executor:
        per_rank = executor.call(suite_on_rank, quick, seed, frozenset(skip))
    return merge_rank_results(per_rank) + driver_checks(tp, device, quick=quick, seed=seed, launcher="ray",
                                                        skip=skip)


# ----------------------------------------------------------------- pytest --pyargs tpspec.check

_PYTEST_CACHE: dict[str, CheckResult] | None = None


def _pytest_results() -> dict[str, CheckResult]:
    """The suite run once per pytest session (``TPSPEC_CHECK_TP`` ranks, default 2)."""
    global _PYTEST_CACHE
    if _PYTEST_CACHE is None:
        tp = int(os.environ.get("TPSPEC_CHECK_TP", "2"))
        device = resolve_device(os.environ.get("TPSPEC_CHECK_DEVICE") or "auto")
        quick = os.environ.get("TPSPEC_CHECK_QUICK", "") not in ("", "0")
        _PYTEST_CACHE = {r.key: r for r in order_results(run_mp(tp, device, quick=quick))}
    return _PYTEST_CACHE


def _make_pytest_test(key: str) -> Callable[[], None]:
    def test() -> None:
        import pytest

        result = _pytest_results()[key]
        if result.status == SKIP:
            pytest.skip(result.detail)
        if result.status == PARTIAL:  # what ran held, but the property is not fully checked here
            pytest.skip(f"partial: {result.detail}")
        assert result.status == PASS, f"{result.title}: {result.mismatches} mismatches; {result.detail}"

    test.__name__ = test.__qualname__ = f"test_{key}"
    test.__doc__ = f"SPEC: {TITLES[key]}"
    return test


for _key, _ in PROPERTIES:
    globals()[f"test_{_key}"] = _make_pytest_test(_key)
del _key
