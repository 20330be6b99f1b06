"""Triton kernels on CPU through Triton's interpreter: the test side starts a case script in a
subprocess with ``TRITON_INTERPRET=1`` (it must be set before Triton is imported); the script side
runs a group of checks per dtype and says ``<check> torch.<dtype>: ok`` for each. And the same
kernels compiled for Hopper without a GPU (:func:`compile_for_hopper`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
has_triton = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not has_triton, reason="needs triton")


def interpreter_env(**extra: str) -> dict[str, str]:
    """This process's environment with Triton's interpreter on, the repository and ``tests/`` on
    ``PYTHONPATH``, and ``extra`` set."""
    return {**os.environ, "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]), **extra}


def _assert_ok(returncode: int, stdout: str, stderr: str, dtypes: tuple[str, ...]) -> None:
    assert returncode == 0, stdout + stderr
    for d in dtypes:
        assert f"torch.{d}: ok" in stdout, stdout


def run_interpreted(script: str, args: list[str], dtypes: tuple[str, ...]) -> None:
    """Run ``tests/<script> *args *dtypes`` under the interpreter; it must exit 0 and report every
    dtype as ok."""
    proc = subprocess.run([sys.executable, str(TESTS / script), *args, *dtypes], env=interpreter_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    _assert_ok(proc.returncode, proc.stdout, proc.stderr, dtypes)


class InterpretedRun:
    """:func:`run_interpreted`'s run started now and checked later, so that several run side by
    side (the interpreter keeps one core busy): its output goes to files under ``logs``;
    :meth:`check` waits for it and asserts what :func:`run_interpreted` does; :meth:`close` ends it."""

    def __init__(self, script: str, args: list[str], dtypes: tuple[str, ...], logs: Path) -> None:
        from started import Started

        self.dtypes = dtypes
        self.run = Started([sys.executable, str(TESTS / script), *args, *dtypes], ROOT, interpreter_env(),
                           logs=logs, name="-".join([Path(script).stem, *args]))

    def check(self, timeout_s: float = 600) -> None:
        _assert_ok(*self.run.output(timeout_s), self.dtypes)

    def close(self) -> None:
        self.run.close()


def run_checks(checks: dict[str, list[Callable[[str, Any], None]]], group: str, device: str,
               dtypes: list[Any]) -> None:
    """Every check of ``group`` on ``device`` in each dtype, each reported as it passes."""
    for dtype in dtypes:
        for check in checks[group]:
            check(device, dtype)
            print(f"{check.__name__} {dtype}: ok", flush=True)


def interpreted_main(checks: dict[str, list[Callable[[str, Any], None]]], kernels: Any) -> None:
    """A case script's ``__main__``: ``script GROUP DTYPE...`` on CPU under the interpreter."""
    import torch

    assert kernels.INTERPRETED, "run with TRITON_INTERPRET=1 (set before triton is imported)"
    group, *names = sys.argv[1:]
    run_checks(checks, group, "cpu", [getattr(torch, name) for name in names])


def compile_for_hopper(fn: Any, signature: dict[str, str], constants: dict[str, Any], *,
                       aligned_pointers: bool = False, multiples_of_16: tuple[str, ...] = (),
                       **options: Any) -> dict:
    """``fn`` (a ``@triton.jit`` kernel) compiled for sm_90 without a GPU (Triton's own ptxas):
    ``signature`` types its arguments (``"*bf16"``, ``"i32"``, ...), ``constants`` its constexprs,
    ``options`` the launch's (``num_warps``, ``enable_fp_fusion``, ...); ``aligned_pointers``: every
    pointer argument 16-byte aligned, as a launch with torch's tensors specializes it;
    ``multiples_of_16``: integer arguments a launch specializes as multiples of 16 (as it does any
    such value of an argument not in ``do_not_specialize``). Returns the ``asm`` dict (``"ptx"``,
    ``"cubin"``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    divisible = [name for name, kind in signature.items() if kind.startswith("*")] if aligned_pointers else []
    divisible += list(multiples_of_16)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible} or None
    signature = dict(signature, **{name: "constexpr" for name in constants})
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options).asm
