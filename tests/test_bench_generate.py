"""`tpspec bench generate --device cpu --quick` writes a valid JSON and PNG, and the forced
acceptance rates reach the ranks (measured accepted drafts per step)."""

from __future__ import annotations

import json

import pytest
import torch

from tpspec.bench import generate
from tpspec.cli import main
from tpspec.speculative.forced import FORCE_ENV

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_generate_quick_cpu_writes_json_and_png(tmp_path, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "2")  # the bench sets its own rates; an inherited value must not leak
    out = tmp_path / "bench"
    assert main(["bench", "generate", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "generate.json").read_text())
    assert report["benchmark"] == "generate" and report["columns"] == generate.COLUMNS
    rows = {r[0]: dict(zip(report["columns"], r)) for r in report["rows"]}
    assert list(rows) == ["no-spec", "forced=0", "forced=1.5", "forced=3"]
    meta = report["meta"]
    for r in rows.values():
        assert r["tokens"] == r["requests"] * meta["max_new_tokens"] and r["requests"] == 2
        assert r["vs_hf"] == "-"
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
    with pytest.raises(SystemExit, match="--num-prompts"):
        main(["bench", "generate", "--device", "cpu", "--quick", "--num-prompts", "1,0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--baseline runs with --launcher mp"):
        main(["bench", "generate", "--device", "cpu", "--quick", "--baseline", "hf", "--launcher", "ray",
              "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="on CUDA devices only"):
        main(["bench", "generate", "--device", "cpu", "--quick", "--baseline", "hf", "--hf-compile",
              "--out", str(tmp_path)])


def test_bench_generate_hf_baseline_same_prompts_and_tokens(tmp_path):
    """--baseline hf: transformers on the tiny checkpoint (the same weights), the same prompt ids and
    max_new_tokens, greedy, EOS ignored, at each batch size: its rows, the ratios, and the same tokens
    as tpspec's (fp32 on CPU), which shows both sides generated the same thing."""
    out = tmp_path / "bench"
    assert main(["bench", "generate", "--device", "cpu", "--quick", "--tp", "1", "--baseline", "hf",
                 "--num-prompts", "1,2", "--out", str(out)]) == 0
    report = json.loads((out / "generate.json").read_text())
    rows = [dict(zip(report["columns"], r)) for r in report["rows"]]
    assert [(r["config"], r["requests"]) for r in rows] == [("no-spec", 1), ("hf", 1), ("no-spec", 2), ("hf", 2)]
    meta = report["meta"]
    for ours, theirs in zip(rows[::2], rows[1::2]):
        assert ours["tokens"] == theirs["tokens"] == ours["requests"] * meta["max_new_tokens"]
        assert ours["vs_hf"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"], rel=1e-3)
    assert meta["baseline"] == "hf" and meta["baseline_status"] == "done" and meta["rates"] == []
    assert meta["hf_compile"] is False and meta["hf_same_weights"] is True
    assert meta["hf_tokens_equal"] == {"1": True, "2": True}
    assert meta["transformers"]
    assert (out / "generate.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("path", ["shape:llama-3-8b,num_layers=2", "shape:llama-3.2-1b,num_layers=1",
                                  "shape:qwen2.5-7b,num_layers=1,vocab_size=4096"])
def test_hf_baseline_builds_the_same_shape(path):
    """A shape path: transformers' model from the shape's config.json fields has exactly tpspec's
    parameters, name for name and shape for shape (built on the meta device: shapes, no memory)."""
    from tpspec.bench.hf_baseline import build_hf_model
    from tpspec.mapping import Mapping
    from tpspec.model.llama import TPLlamaForCausalLM
    from tpspec.model.shapes import config_from_path

    hf, same_weights = build_hf_model(path, "meta", "bfloat16")
    assert same_weights is False and hf.dtype == torch.bfloat16
    ours = TPLlamaForCausalLM(config_from_path(path), Mapping(1, 0), device="meta", dtype=torch.bfloat16)
    hf_shapes = {name: tuple(p.shape) for name, p in hf.named_parameters()}
    # Tied embeddings (Llama 3.2 1B): transformers lists the one tensor once, tpspec's head names it too.
    expected = {spec.name: tuple(spec.full_shape) for _, _, specs in ours.shard_plan() for spec in specs}
    assert hf_shapes == expected


def test_bench_generate_deterministic_cost(tmp_path):
    """--deterministic --rates none: the default and the deterministic mode side by side, the ratio."""
    out = tmp_path / "bench"
    assert main(["bench", "generate", "--device", "cpu", "--quick", "--tp", "1", "--deterministic", "--rates", "none",
                 "--out", str(out)]) == 0
    rows = {r[0]: dict(zip(generate.COLUMNS, r)) for r in json.loads((out / "generate.json").read_text())["rows"]}
    assert list(rows) == ["no-spec", "no-spec det"]
    det = rows["no-spec det"]
    assert det["vs_default"] == pytest.approx(det["tokens_per_s"] / rows["no-spec"]["tokens_per_s"], rel=1e-3)
    assert rows["no-spec"]["vs_default"] == "-"


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
