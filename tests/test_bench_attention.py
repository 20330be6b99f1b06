"""``tpspec bench attention`` on CPU (a smoke run of the table, JSON and PNG; the timings are the
GPU's business) and its argument errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from interpreted import interpreter_env, needs_triton

from tpspec.cli import main


def test_bench_attention_writes_its_table(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "attention", "--device", "cpu", "--model-shape", "llama-3.2-1b", "--tp", "2",
                 "--batch", "1,3", "--context", "40", "--query-len", "1,4", "--iters", "1", "--backends", "torch",
                 "--out", str(out)]) == 0
    data = json.loads((out / "attention.json").read_text())
    assert data["meta"]["heads"] == 16 and data["meta"]["kv_heads"] == 4 and data["meta"]["head_dim"] == 64
    rows = [dict(zip(data["columns"], r)) for r in data["rows"]]
    assert [(r["batch"], r["query_len"]) for r in rows] == [(1, 1), (3, 1), (1, 4), (3, 4)]
    assert all(r["backend"] == "torch" and r["speedup_vs_torch"] == 1 and r["us_per_layer"] > 0 for r in rows)
    assert (out / "attention.png").exists()
    assert "us_per_layer" in capsys.readouterr().out


@needs_triton
def test_bench_attention_runs_each_split_count(tmp_path):
    """``--num-splits``: the triton backend once per split count (under Triton's interpreter on
    CPU), the torch backend once, each triton row naming its split count."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "tpspec", "bench", "attention", "--device", "cpu", "--model-shape",
                           "llama-3.2-1b", "--tp", "4", "--batch", "2", "--context", "40", "--query-len", "1,4",
                           "--iters", "1", "--backends", "torch,triton", "--num-splits", "1,3", "--out", str(out)],
                          env=interpreter_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "attention.json").read_text())
    rows = [dict(zip(data["columns"], r)) for r in data["rows"]]
    assert [(r["query_len"], r["backend"], r["num_splits"]) for r in rows] == [
        (1, "torch", "-"), (1, "triton", 1), (1, "triton", 3), (4, "torch", "-"), (4, "triton", 1), (4, "triton", 3)]
    assert all(r["us_per_layer"] > 0 and r["speedup_vs_torch"] > 0 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--backends", "torch,magic"], "unknown \\['magic'\\]"),
    (["--backends", "auto"], "unknown \\['auto'\\]"),
    (["--tp", "3"], "--tp 3 does not split"),
    (["--batch", "0"], "--batch"),
    (["--context", "4", "--query-len", "8"], "--query-len 8 exceeds --context 4"),
    (["--num-splits", "2", "--backends", "torch"], "--num-splits sets the triton backend's launches"),
    (["--num-splits", "0", "--backends", "triton"], "--num-splits"),
    (["--num-splits", "65", "--backends", "triton"], "--num-splits: at most 64 splits"),
])
def test_bench_attention_argument_errors(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "attention", "--device", "cpu", "--out", str(tmp_path), *argv])
