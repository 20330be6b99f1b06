"""`tpspec bench step --device cpu --quick` writes a valid JSON and PNG, and both selection
paths pick identical tokens."""

from __future__ import annotations

import json

import pytest

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
    _check_roofline(out, step.QUICK_ROOFLINE_CONTEXTS, step.QUICK_ROOFLINE_BATCHES)


def _check_roofline(out, contexts, batches):
    report = json.loads((out / "step_roofline.json").read_text())
    assert report["columns"] == step.ROOFLINE_COLUMNS
    rows = [dict(zip(report["columns"], r)) for r in report["rows"]]
    assert {(r["context"], r["batch"]) for r in rows} == {(c, b) for c in contexts for b in batches}
    for r in rows:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and 0 < r["select_share_%"] < 100
        assert abs(r["ratio"] - r["step_ms"] / r["floor_ms"]) < 0.01 * r["ratio"] + 0.01
        # The floor's KV bytes on a rank: every request reads context + 1 entries of 2 layers x K and V x
        # 1 KV head (2 over TP = 2) x 16 dims, fp32 (the table rounds to 10 kB).
        assert abs(r["kv_read_MB"] - r["batch"] * (r["context"] + 1) * 2 * 2 * 1 * 16 * 4 / 1e6) <= 0.006
        assert r["graphed"] is False  # CPU: eager
    assert (out / "step_roofline.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_bench_step_real_shape_with_fewer_layers(tmp_path):
    """A real model shape (Qwen2.5 7B's layer: 28 heads, 4 KV heads, head_dim 128, q/k/v biases) built with
    random weights on the rank, one layer and a small vocabulary so it runs on CPU."""
    out = tmp_path / "shape"
    assert main(["bench", "step", "--device", "cpu", "--quick", "--tp", "1", "--model-shape", "qwen2.5-7b",
                 "--num-layers", "1", "--vocab-size", "2048", "--modes", "greedy", "--batch", "1",
                 "--roofline-batch", "2", "--contexts", "16", "--iters", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    meta = json.loads((out / "step.json").read_text())["meta"]
    assert meta["model_path"] == "shape:qwen2.5-7b,num_layers=1,vocab_size=2048" and meta["vocab_size"] == 2048
    assert all(meta["tokens_equal"].values())
    row = dict(zip(step.ROOFLINE_COLUMNS, json.loads((out / "step_roofline.json").read_text())["rows"][0]))
    # One Qwen2.5-7B layer + the 2048-row LM head, fp32, without the embedding table.
    layer = 3584 * (3584 + 2 * 512) + (3584 + 2 * 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert abs(row["weight_MB"] - (layer + 2048 * 3584 + 3584) * 4 / 1e6) < 0.1
    # 2 requests x 17 entries x 4 KV heads x 128 dims x K and V, fp32.
    assert abs(row["kv_read_MB"] - 2 * 17 * 4 * 128 * 2 * 4 / 1e6) < 0.01


def test_bench_step_rejects_bad_arguments(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="--modes"):
        main(["bench", "step", "--device", "cpu", "--quick", "--modes", "beam", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="positive"):
        main(["bench", "step", "--device", "cpu", "--quick", "--batch", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--num-layers needs --model-shape"):
        main(["bench", "step", "--device", "cpu", "--quick", "--num-layers", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="num_layers must be a positive int"):
        main(["bench", "step", "--device", "cpu", "--quick", "--model-shape", "llama-3-8b", "--num-layers", "0",
              "--out", str(tmp_path)])


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
