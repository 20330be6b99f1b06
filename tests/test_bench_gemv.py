"""``tpspec bench gemv`` on CPU (a smoke run of the table, JSON and PNG with F.linear; the timings
and the Triton GEMV's rows are the GPU's business) and its argument errors."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tpspec.cli import main


def test_bench_gemv_writes_its_table(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "gemv", "--device", "cpu", "--model-shape", "llama-3.2-1b", "--tp", "2",
                 "--vocab-size", "1000", "--batch", "1,3", "--iters", "1", "--kernels", "torch",
                 "--out", str(out)]) == 0
    data = json.loads((out / "gemv.json").read_text())
    # llama-3.2-1b: hidden 2048, 32 heads (8 KV) of 64, intermediate 8192; TP 2 halves heads and MLP.
    assert data["meta"]["shapes"] == {"qkv": [1536, 2048], "o": [2048, 1024], "gate_up": [8192, 2048],
                                      "down": [2048, 4096], "lm_head": [500, 2048]}
    rows = [dict(zip(data["columns"], r)) for r in data["rows"]]
    assert [(r["linear"], r["batch"]) for r in rows][:4] == [("qkv", 1), ("qkv", 3), ("o", 1), ("o", 3)]
    assert len(rows) == 10
    assert all(r["kernel"] == "torch" and r["speedup_vs_torch"] == 1 and r["us"] > 0 and r["max_abs_err"] == 0
               for r in rows)
    assert set(data["meta"]["step_us_estimate"]["torch"]) == {"1", "3"}
    assert (out / "gemv.png").exists()
    assert "max_abs_err" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--kernels", "torch,magic"], "unknown \\['magic'\\]"),
    (["--tp", "3"], "cannot be split over tp_size=3"),
    (["--batch", "0"], "--batch"),
    (["--batch", "65"], "at most 64 rows"),
])
def test_bench_gemv_argument_errors(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "gemv", "--device", "cpu", "--out", str(tmp_path), *argv])


def test_bench_gemv_triton_on_cpu_needs_the_interpreter(tmp_path):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    why = "TRITON_INTERPRET=1" if importlib.util.find_spec("triton") else "needs the triton package"
    with pytest.raises(SystemExit, match=why):
        main(["bench", "gemv", "--device", "cpu", "--kernels", "triton", "--out", str(tmp_path)])
