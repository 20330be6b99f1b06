"""Speculative drafters for real model shapes with random weights: the Llama 3.2 1B draft-model
shape and random EAGLE-3 heads (``shape-eagle3:NAME``), shrunk to one layer and a small
vocabulary, on a shrunken target on CPU (the 1B shape itself, the smallest Llama 3 shape, keeps
the tests quick; the 8B pairing is checked by its sizes). Random drafts are almost never
accepted, so strict acceptance reproducing plain greedy decoding shows only that rejected drafts
change nothing; forced acceptance then makes every draft accepted, and each token the target
emits after accepted drafts must be plain greedy decoding's next token after them."""

from __future__ import annotations

import pytest
import torch

from tpspec import LLM, SamplingParams
from tpspec.model.eagle3 import Eagle3Config
from tpspec.model.shapes import DRAFT_SHAPES, eagle3_shape_path, shape_config, shape_path, spread_draft_ids
from tpspec.speculative import FORCE_ENV

TARGET = "shape:llama-3.2-1b,num_layers=1,vocab_size=4096"
DRAFT = "shape:llama-3.2-1b,num_layers=1,vocab_size=4096"
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_per_rank():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        yield


def _generate(spec: dict | None) -> list[list[int]]:
    with LLM(TARGET, dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=2,
             max_model_len=64) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    return _generate(None)


@pytest.mark.parametrize("method,model", [("draft_model", DRAFT), ("eagle3", "shape-eagle3:llama-3.2-1b")],
                         ids=["draft_model", "eagle3"])
def test_shape_drafter_greedy_equals_plain_greedy(baseline, method, model):
    got = _generate({"method": method, "model": model, "num_speculative_tokens": 3})
    assert got == baseline and all(len(t) == GREEDY.max_tokens for t in got)


@pytest.mark.filterwarnings("ignore::tpspec.speculative.forced.ForcedAcceptanceWarning")
@pytest.mark.parametrize("method,model", [("draft_model", DRAFT), ("eagle3", "shape-eagle3:llama-3.2-1b")],
                         ids=["draft_model", "eagle3"])
def test_shape_drafter_accepted_drafts_are_verified(monkeypatch, method, model):
    """Every draft accepted (forced, 3 a step): the drafts enter the KV cache and the target's token
    after them is its greedy token given them, i.e. plain greedy decoding of the prompt followed by
    everything emitted before it. The reference's best token beats its second by a margin far above
    rounding, so the default mode's verification-vs-prefill rounding cannot flip it."""
    k, max_tokens = 3, 9
    monkeypatch.setenv(FORCE_ENV, str(k))
    with LLM(TARGET, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64,
             speculative_config={"method": method, "model": model, "num_speculative_tokens": k}) as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens))]
    monkeypatch.delenv(FORCE_ENV)
    prefixes, emitted = [], []
    for prompt, out in zip(PROMPTS, outs):
        assert out.stats.accepted_drafts_per_step == [k, k] and len(out.token_ids) == max_tokens, out.stats
        # The prefill emits token 0; each step then emits k accepted drafts and the target's token.
        for j in (0, k + 1, 2 * k + 2):
            prefixes.append(prompt + out.token_ids[:j])
            emitted.append(out.token_ids[j])
    with LLM(TARGET, dtype="float32", device="cpu", max_num_seqs=len(prefixes), max_model_len=64) as llm:
        refs = [o.outputs[0] for o in llm.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=1,
                                                                            logprobs=2))]
    assert [r.token_ids[0] for r in refs] == emitted
    for r in refs:
        best, second = sorted((lp.logprob for lp in r.logprobs[0].values()), reverse=True)[:2]
        assert best - second > 1e-4, r.logprobs[0]


def test_llama_3_2_1b_shape_fields():
    cfg = shape_config("llama-3.2-1b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size) == (2048, 8192, 16, 32, 8, 64, 128256)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert DRAFT_SHAPES["llama-3-8b"] == "llama-3.2-1b" and cfg.vocab_size == shape_config("llama-3-8b").vocab_size
    assert shape_path("llama-3.2-1b", 1, 4096) == DRAFT


def test_eagle3_shape_config_sizes_the_head_for_the_target():
    target = shape_config("llama-3-8b")
    cfg = Eagle3Config.from_shape(eagle3_shape_path("llama-3-8b"), target)
    assert cfg.hidden_size == 4096 and cfg.layer.num_heads == 32 and cfg.layer.num_kv_heads == 8
    assert cfg.draft_vocab_size == 32000 and cfg.target_vocab_size == 128256
    assert cfg.aux_layer_ids == (2, 16, 29) and cfg.layer.num_layers == 1
    small = Eagle3Config.from_pretrained("shape-eagle3:llama-3-8b,draft_vocab_size=100",
                                         shape_config("llama-3-8b", 1, 4096))
    assert small.draft_vocab_size == 100 and small.aux_layer_ids == (0, 0, 0)
    ids = spread_draft_ids(32000, 128256)
    assert ids[0] == 0 and int(ids[-1]) < 128256 and bool((ids[1:] > ids[:-1]).all()) and ids.dtype == torch.int64
    gaps = ids[1:] - ids[:-1]
    assert int(gaps.max()) - int(gaps.min()) <= 1  # spread evenly
    # The default draft vocabulary: 32000, at most half the target's.
    half = Eagle3Config.from_pretrained("shape-eagle3:llama-3-8b", shape_config("llama-3-8b", 1, 4096))
    assert half.draft_vocab_size == 2048


def test_shape_models_are_bfloat16_under_llm_auto():
    """``dtype="auto"`` takes a shape's own dtype (bfloat16), as a checkpoint's ``torch_dtype``."""
    from tpspec.validation import resolve_dtype

    for name in ("llama-3-8b", "llama-3.2-1b", "qwen2.5-7b"):
        assert resolve_dtype("auto", "cpu", checkpoint_dtype=shape_config(name).torch_dtype) == "bfloat16", name


def test_shape_drafter_errors_before_any_worker():
    with pytest.raises(ValueError, match="hidden_size=4096 does not match"):
        LLM(TARGET, dtype="float32", speculative_config={"method": "eagle3", "model": "shape-eagle3:llama-3-8b"})
    with pytest.raises(ValueError, match="unknown model shape 'nope'"):
        LLM(TARGET, dtype="float32", speculative_config={"method": "eagle3", "model": "shape-eagle3:nope"})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        LLM(TARGET, dtype="float32",
            speculative_config={"method": "eagle3", "model": "shape-eagle3:llama-3.2-1b,draft_vocab_size=5000"})
    with pytest.raises(ValueError, match="method 'eagle3' only"):
        LLM(TARGET, dtype="float32",
            speculative_config={"method": "draft_model", "model": "shape-eagle3:llama-3.2-1b"})
    with pytest.raises(ValueError, match="vocab_size 128256 differs from the target's 4096"):
        LLM(TARGET, dtype="float32", speculative_config={"method": "draft_model", "model": "shape:llama-3.2-1b"})
