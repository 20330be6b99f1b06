"""`tpspec bench generate --device cpu --quick` writes a valid JSON and PNG, and the forced
acceptance rates reach the ranks (measured accepted drafts per step)."""

from __future__ import annotations

import json

import pytest

from tpspec.bench import generate
from tpspec.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_generate_quick_cpu_writes_json_and_png(tmp_path, monkeypatch):
    monkeypatch.setenv(generate.FORCE_ENV, "2")  # the bench sets its own rates; an inherited value must not leak
    out = tmp_path / "bench"
    assert main(["bench", "generate", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "generate.json").read_text())
    assert report["benchmark"] == "generate" and report["columns"] == generate.COLUMNS
    rows = {r[0]: dict(zip(report["columns"], r)) for r in report["rows"]}
    assert list(rows) == ["no-spec", "forced=0", "forced=1.5", "forced=3"]
    meta = report["meta"]
    for r in rows.values():
        assert r["tokens"] == meta["num_prompts"] * meta["max_new_tokens"]
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
    assert rows["no-spec"]["accepted_per_step"] == 0 and rows["no-spec"]["draft_len"] == 0
    assert rows["forced=0"]["accepted_per_step"] == 0
    # min(rate, draft_len) = 3 drafts every step, the last step cut to the token budget:
    # 1 token from the context step, then steps of 4 tokens, the stats counting emitted ones.
    generated = meta["max_new_tokens"] - 1
    steps = -(-generated // 4)
    assert rows["forced=3"]["accepted_per_step"] == round((generated - steps) / steps, 3)
    assert 1.0 <= rows["forced=1.5"]["accepted_per_step"] <= 2.0
    assert (out / "generate.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_generate_rejects_bad_rates(tmp_path):
    with pytest.raises(SystemExit, match="--rates"):
        main(["bench", "generate", "--device", "cpu", "--quick", "--rates", "-1", "--out", str(tmp_path)])


def test_bench_generate_eagle3_forced(tmp_path):
    """The EAGLE-3 head drafts (K forwards a step) and the forced rate still reaches the ranks."""
    out = tmp_path / "bench"
    assert main(["bench", "generate", "--device", "cpu", "--quick", "--spec", "eagle3", "--rates", "3", "--tp", "1",
                 "--out", str(out)]) == 0
    report = json.loads((out / "generate.json").read_text())
    rows = {r[0]: dict(zip(report["columns"], r)) for r in report["rows"]}
    assert list(rows) == ["no-spec", "forced=3"] and report["meta"]["drafter"] == "eagle3"
    generated = report["meta"]["max_new_tokens"] - 1
    steps = -(-generated // 4)
    assert rows["forced=3"]["accepted_per_step"] == round((generated - steps) / steps, 3)
    with pytest.raises(SystemExit, match="--spec eagle3 needs --draft-model DIR"):
        main(["bench", "generate", "--device", "cpu", "--quick", "--spec", "eagle3", "--model", str(tmp_path)])


def test_bench_generate_model_shape_default_drafters(tmp_path):
    """A model shape drafts without --draft-model: the Llama 3.2 1B shape (shrunk alike) or a random
    EAGLE-3 head of the target shape (which tests/test_shape_drafters.py runs end to end); the
    forced rate still reaches the ranks."""
    from tpspec.bench.generate import default_draft_model
    from tpspec.cli import build_parser

    def drafter(*argv: str) -> str:
        argv = ["bench", "generate", "--model-shape", "llama-3-8b", *argv]
        return default_draft_model(build_parser(argv).parse_args(argv))

    assert drafter("--spec", "eagle3") == "shape-eagle3:llama-3-8b"
    assert drafter("--spec", "draft_model") == "shape:llama-3.2-1b"
    assert drafter("--spec", "draft_model", "--num-layers", "4", "--vocab-size", "4096") == \
        "shape:llama-3.2-1b,num_layers=2,vocab_size=4096"
    out = tmp_path / "bench"
    assert main(["bench", "generate", "--device", "cpu", "--quick", "--model-shape", "llama-3-8b", "--num-layers", "1",
                 "--vocab-size", "4096", "--dtype", "float32", "--spec", "draft_model", "--rates", "3", "--tp", "1",
                 "--out", str(out)]) == 0
    report = json.loads((out / "generate.json").read_text())
    rows = {r[0]: dict(zip(report["columns"], r)) for r in report["rows"]}
    assert list(rows) == ["no-spec", "forced=3"]
    assert report["meta"]["draft_model"] == "shape:llama-3.2-1b,num_layers=1,vocab_size=4096"
    generated = report["meta"]["max_new_tokens"] - 1
    steps = -(-generated // 4)
    assert rows["forced=3"]["accepted_per_step"] == round((generated - steps) / steps, 3)


def test_bench_generate_model_shape_without_draft_shape():
    with pytest.raises(SystemExit, match="--spec draft_model needs --draft-model with --model-shape qwen2.5-7b"):
        main(["bench", "generate", "--device", "cpu", "--quick", "--model-shape", "qwen2.5-7b", "--spec",
              "draft_model"])
