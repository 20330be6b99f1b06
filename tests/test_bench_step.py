"""`tpspec bench step --device cpu --quick` writes a valid JSON and PNG, and both selection
paths pick identical tokens."""

from __future__ import annotations

import json

from tpspec.bench import step
from tpspec.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_step_quick_cpu_writes_json_and_png(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "step", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "step.json").read_text())
    assert report["benchmark"] == "step" and report["columns"] == step.COLUMNS
    meta = report["meta"]
    assert meta["tp"] == 2 and meta["device"] == "cpu" and meta["vocab_size"] == step.QUICK_VOCAB
    assert meta["tokens_equal"] and all(meta["tokens_equal"].values())
    rows = [dict(zip(report["columns"], r)) for r in report["rows"]]
    # one row per (batch, mode, path)
    cells = {(r["batch"], r["mode"], r["path"]) for r in rows}
    assert cells == {(b, m, p) for b in step.QUICK_BATCHES for m in step.MODES for p in step.PATHS}
    for r in rows:
        assert r["forward_ms"] > 0 and r["select_ms"] > 0
        assert abs(r["step_ms"] - r["forward_ms"] - r["select_ms"]) < 1e-2
        assert 0 < r["select_share_%"] < 100
        assert r["rows"] == r["batch"] * (r["draft_len"] + 1)
    assert (out / "step.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_step_rejects_bad_arguments(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="--modes"):
        main(["bench", "step", "--device", "cpu", "--quick", "--modes", "beam", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="positive"):
        main(["bench", "step", "--device", "cpu", "--quick", "--batch", "0", "--out", str(tmp_path)])


def test_tokens_equal_compares_both_paths_on_every_rank():
    import torch

    def records(gather_out, sharded_out):
        base = {"batch": 1, "mode": "greedy", "rows": 3, "forward_ms": 1.0, "select_ms": 1.0}
        return [dict(base, path="sharded", first_output=sharded_out),
                dict(base, path="gather", first_output=gather_out)]

    same = torch.tensor([5, -1, -1, 5, 6, 7])
    _, equal = step.summarize([records(same, same), records(same, same)], draft_len=2)
    assert equal == {"B=1 greedy": True}
    other_rank = torch.tensor([5, -1, -1, 5, 6, 8])  # rank 1 disagrees on one row's target token
    _, equal = step.summarize([records(same, same), records(other_rank, other_rank)], draft_len=2)
    assert equal == {"B=1 greedy": False}
    _, equal = step.summarize([records(same, other_rank), records(same, same)], draft_len=2)
    assert equal == {"B=1 greedy": False}
