"""The README's user-facing programs run as documented: the examples, and `tpspec check`
under torchrun (each in its own processes, as a user would start it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tpspec.distributed import find_free_port

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path, timeout: float = 240) -> str:
    env = dict(os.environ, TPSPEC_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _torchrun(nproc: int) -> list[str]:
    port = find_free_port()  # a port of its own, so a stale rendezvous elsewhere cannot interfere
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}"]


def test_generate_example(tmp_path):
    out = _run([sys.executable, str(REPO / "examples" / "generate.py")], tmp_path)
    assert out.strip(), "the example printed nothing"


def test_speculative_example_reproduces_plain_decoding(tmp_path):
    out = _run([sys.executable, str(REPO / "examples" / "speculative.py")], tmp_path)
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in
            ("plain", "ngram/strict", "draft/strict", "draft/rejection")]
    assert [r[0] for r in rows] == ["plain", "ngram/strict", "draft/strict", "draft/rejection"], out
    assert all(r[1] == "True" for r in rows), out  # every configuration emits plain greedy's tokens


def test_torchrun_example(tmp_path):
    out = _run(_torchrun(2) + [str(REPO / "examples" / "torchrun_generate.py")], tmp_path)
    assert "tokens/s on 2 ranks" in out


def test_check_under_torchrun(tmp_path):
    report = tmp_path / "check.json"
    _run(_torchrun(2) + ["-m", "tpspec", "check", "--launcher", "torchrun", "--device", "cpu", "--quick",
                         "--json", str(report)], tmp_path)
    rows = {r["key"]: r["status"] for r in json.loads(report.read_text())["results"]}
    assert rows["ranks_agree"] == rows["generate_tp"] == rows["greedy_argmax"] == "PASS", rows
    assert "FAIL" not in rows.values()
