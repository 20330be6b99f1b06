"""Triton kernels on CPU through Triton's interpreter: the test side starts a case script in a
subprocess with ``TRITON_INTERPRET=1`` (it must be set before Triton is imported); the script side
runs a group of checks per dtype and says ``<check> torch.<dtype>: ok`` for each. And the same
kernels compiled for Hopper without a GPU (:func:`compile_for_hopper`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
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
    """Run ``tests/<script> *args DTYPE`` under the interpreter, one process per dtype, as many side
    by side as the machine has cores (the interpreter keeps one core busy); each must exit 0 and
    report its dtype as ok."""
    width = max(1, os.cpu_count() or 1)
    for start in range(0, len(dtypes), width):
        wave = dtypes[start:start + width]
        procs = []
        for d in wave:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            procs.append((d, out, err, subprocess.Popen([sys.executable, str(TESTS / script), *args, d],
                                                        env=interpreter_env(), cwd=ROOT, stdout=out, stderr=err,
                                                        text=True)))
        try:
            for d, out, err, proc in procs:
                proc.wait(timeout=600)
                out.seek(0)
                err.seek(0)
                _assert_ok(proc.returncode, out.read(), err.read(), (d,))
        finally:
            for _, out, err, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out.close()
                err.close()


class InterpretedRun:
    """:func:`run_interpreted`'s run started now and checked later, so that several run side by
    side (the interpreter keeps one core busy): its output goes to files under ``logs``;
    :meth:`check` waits for it and asserts what :func:`run_interpreted` does; :meth:`close` ends it."""

    def __init__(self, script: str, args: list[str], dtypes: tuple[str, ...], logs: Path) -> None:
        from started import Started

        self.dtypes = dtypes
        self.run = Started([sys.executable, str(TESTS / script), *args, *dtypes], ROOT, interpreter_env(),
                           logs=logs, name="-".join([Path(script).stem, *args, *dtypes]))

    def check(self, timeout_s: float = 600) -> None:
        _assert_ok(*self.run.output(timeout_s), self.dtypes)

    def close(self) -> None:
        self.run.close()


class InterpretedGroups:
    """Every group of a case script in each of its dtypes, one process each, all started at once:
    a test module's interpreted checks then share the machine's cores instead of leaving one idle
    while a single-dtype group runs. ``check(group)`` waits for that group's runs and asserts them;
    ``close()`` ends whatever still runs."""

    def __init__(self, script: str, groups: dict[str, tuple[str, ...]], logs: Path) -> None:
        self.runs = {group: [InterpretedRun(script, [group], (dtype,), logs) for dtype in dtypes]
                     for group, dtypes in groups.items()}

    def check(self, group: str) -> None:
        for run in self.runs[group]:
            run.check()

    def close(self) -> None:
        for runs in self.runs.values():
            for run in runs:
                run.close()


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


def resource_usage(asm: dict) -> dict[str, int]:
    """Registers a thread (``REG``) and its local-memory stack in bytes (``STACK``: spilled values)
    of a kernel compiled by :func:`compile_for_hopper`, as ``cuobjdump -res-usage`` (shipped with
    Triton) reads them from its cubin."""
    import re

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    assert tool.exists(), f"{tool} is missing: this triton ships no cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(asm["cubin"])
        cubin.flush()
        out = subprocess.run([str(tool), "-res-usage", cubin.name], capture_output=True, text=True, timeout=60)
    found = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
    assert out.returncode == 0 and found, out.stdout + out.stderr
    return {"REG": int(found.group(1)), "STACK": int(found.group(2))}
