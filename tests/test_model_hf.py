"""tpspec's model against Hugging Face transformers (a reference no one here wrote), at TP = 1,
and the checkpoint / config errors of the loader."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_helpers import allocate_slots, greedy_generate, make_batch
from tpspec.mapping import Mapping
from tpspec.model import (CheckpointError, ModelConfig, TPLlamaForCausalLM, check_split, load_model,
                          make_tiny_checkpoint)

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 9, 200, 17, 3, 250], [1, 44], [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 7]]
STEPS = 12


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with spread (HF's 0.02 init gives near-tied logits): norms ~1, biases ~0.1, linears ~1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif "lm_head" in name:
                p.copy_(2.0 * noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)


def _hf_checkpoint(tmp_path, kind: str):
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if kind == "llama3":  # llama3 rope scaling, attention + MLP biases, untied head
        cfg = transformers.LlamaConfig(**common, attention_bias=True, mlp_bias=True, rope_theta=50000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "linear":  # linear rope scaling, tied embeddings
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":  # Mistral without a sliding window: Llama's layout under another name
        cfg = transformers.MistralConfig(**common, sliding_window=None, rope_theta=1e6)
        model = transformers.MistralForCausalLM(cfg)
    else:  # Qwen2: q/k/v biases, tied embeddings
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    _randomize(model, seed=1234)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    model.eval()
    path = str(tmp_path / kind)
    model.save_pretrained(path)
    return model, path


def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("kind", ["llama3", "linear", "qwen2", "mistral"])
def test_matches_transformers(tmp_path, kind):
    hf, path = _hf_checkpoint(tmp_path, kind)
    model = load_model(path)
    assert model.config.architecture == {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(
        kind, "LlamaForCausalLM")
    allocate_slots(model, 4)
    for slot, prompt in enumerate(PROMPTS):
        ours = model(make_batch([(slot, 0, prompt)], list(range(len(prompt))))).gather()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    # Greedy continuations, all prompts decoded together in one batch (padded attention path).
    ours = greedy_generate(model, PROMPTS, STEPS)
    assert ours == [_hf_greedy(hf, p, STEPS) for p in PROMPTS]


def test_tiny_checkpoint_is_a_transformers_llama(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=3, vocab_size=509)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model = load_model(path)
    allocate_slots(model, 1)
    prompt = [1, 400, 2, 508, 77]
    ours = model(make_batch([(0, 0, prompt)], list(range(5)))).gather()
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(torch.tensor([prompt])).logits[0], atol=2e-5, rtol=1e-5)
    assert greedy_generate(model, [prompt], 8) == [_hf_greedy(hf, prompt, 8)]


def test_tiny_checkpoint_deterministic_draft_and_cli(tmp_path):
    from tpspec.cli import main

    assert main(["make-tiny-model", str(tmp_path / "a"), "--draft", str(tmp_path / "d")]) == 0
    make_tiny_checkpoint(tmp_path / "b")
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    wd = load_file(tmp_path / "d" / "model.safetensors")
    assert not any(k.startswith("model.layers.1.") for k in wd)  # the draft keeps the first layer only
    assert all(torch.equal(wd[k], wa[k]) for k in wd)
    cfg, dcfg = ModelConfig.from_pretrained(tmp_path / "a"), ModelConfig.from_pretrained(tmp_path / "d")
    assert (cfg.num_layers, dcfg.num_layers, dcfg.vocab_size) == (2, 1, cfg.vocab_size)
    assert cfg.eos_token_id == 2 and cfg.eos_token_ids == [2]
    for tp in (1, 2, 4, 8):  # the default tiny model splits over every TP size the library targets
        check_split(cfg, Mapping(world_size=tp, rank=tp - 1))
    if (tmp_path / "a" / "tokenizer.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
        ids = tok("hi there")["input_ids"]
        assert tok.decode(ids) == "hi there" and max(ids) < cfg.vocab_size


def test_sharded_checkpoint_with_index(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "one", seed=5)
    weights = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(weights)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for fname in ("config.json", "generation_config.json"):
        (sharded / fname).write_text((tmp_path / "one" / fname).read_text())
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: weights[k] for k in keys}, sharded / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = load_model(path), load_model(sharded)
    assert b.load_stats.bytes_read == a.load_stats.bytes_read == a.load_stats.checkpoint_bytes
    for (name, pa, _), (_, pb, _) in zip(a.shard_plan(), b.shard_plan()):
        assert torch.equal(pa, pb), name


# ------------------------------------------------------------------ malformed checkpoints and configs
def _rewrite_config(path, **changes):
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", tokenizer=False)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    missing = dict(weights)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)
    bad = dict(weights)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 128)
    save_file(bad, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\[48, 128\].*\[32, 128\]"):
        load_model(path)
    with open(file, "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read safetensors file.*model.safetensors"):
        load_model(path)
    os.remove(file)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture.*GPT2LMHeadModel"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3.*low_freq_factor"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, "sliding_window=64"),
        ({"num_key_value_heads": 3}, "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ],
)
def test_unsupported_configs_are_named(tmp_path, changes, message):
    path = make_tiny_checkpoint(tmp_path / "c", tokenizer=False)
    _rewrite_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_transformers5_rope_parameters_are_read():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_theta == 500.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4 and cfg.eos_token_ids == []


def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                num_layers=1, num_heads=8, num_kv_heads=2, head_dim=16)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize(
    "cfg, tp, message",
    [
        (_cfg(), 3, "num_attention_heads=8 cannot be split over tp_size=3"),
        (_cfg(num_heads=12, num_kv_heads=3), 4, "num_key_value_heads=3 cannot be replicated over tp_size=4"),
        (_cfg(num_heads=6, num_kv_heads=3), 2, "num_key_value_heads=3 cannot be split over tp_size=2"),
        (_cfg(intermediate_size=250), 4, "intermediate_size=250 cannot be split over tp_size=4"),
        (_cfg(vocab_size=5), 4, "vocab_size=5 cannot be split over tp_size=4"),
    ],
)
def test_splits_that_do_not_divide_are_named(cfg, tp, message):
    with pytest.raises(ValueError, match=message):
        TPLlamaForCausalLM(cfg, Mapping(world_size=tp, rank=1))


def test_kv_heads_replicated_when_fewer_than_ranks():
    from tpspec.model.layers import split_heads

    cfg = _cfg()  # 8 query heads, 2 KV heads
    splits = [split_heads(cfg, 8, r) for r in range(8)]
    assert [s.kv_start for s in splits] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(s.q_heads == 1 and s.kv_heads == 1 for s in splits)
    # Query head r belongs to KV group r // 4, which is the KV head rank r holds.
    assert all(s.q_start // (cfg.num_heads // cfg.num_kv_heads) == s.kv_start for s in splits)


def test_tp_without_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="TP process group is not initialized"):
        TPLlamaForCausalLM(_cfg(), Mapping(world_size=2, rank=0))
