"""Text in the driver: incremental detokenization, stop strings, the chat template and the
checkpoint's generation defaults (tiny model, TP = 1 and 2 on CPU)."""

from __future__ import annotations

import json

import pytest

from tpspec import LLM, SamplingParams
from tpspec.model.tiny import make_tiny_checkpoint
from tpspec.runtime.tokenizer import IncrementalDetokenizer, load_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        yield str(make_tiny_checkpoint(tmp_path_factory.mktemp("text") / "tiny", seed=0))


@pytest.fixture(scope="module")
def llm(ckpt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        with LLM(ckpt, tensor_parallel_size=2, speculative_config=NGRAM) as llm:
            yield llm


def test_incremental_text_equals_full_decode_and_never_splits_a_character(ckpt):
    tok = load_tokenizer(ckpt)
    text = "héllo wörld ☃ — ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # byte-level: multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, [5, 6])
    for t in ids:
        detok.add(t)
        assert "\ufffd" not in detok.text
        assert text.startswith(detok.text)
    assert detok.text == text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_at_the_completing_token(ckpt, include):
    tok = load_tokenizer(ckpt)
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [5], stop=["STOP", "zzz"], include_stop=include)
    fed = 0
    while not detok.add(ids[fed]):
        fed += 1
    assert ids[fed] == tok.encode("P", add_special_tokens=False)[0]  # stopped at the token that ends "STOP"
    assert detok.text == ("abc STOP" if include else "abc ") and detok.stop_reason == "STOP"
    held = IncrementalDetokenizer(tok, [5], stop=["a"], min_tokens=1)  # the first token may not stop
    a, b, _ = tok.encode("aba", add_special_tokens=False)
    assert (held.add(a), held.add(b), held.add(a)) == (False, False, True) and held.text == "ab"


def test_generate_with_stop_strings(llm):
    """A stop string taken from the greedy output ends every speculative and plain run at the same
    token; the text stops before it, ``stop_reason`` names it, token ids are a prefix."""
    prompt = "one two three four one two three four"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert len(full.text) >= 6, full
    stop = full.text[3:5]
    cut = full.text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert full.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < len(full.token_ids)
    with LLM(llm.model_path, tensor_parallel_size=1) as plain:  # no speculation: the same cut
        again = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert (again.text, again.token_ids) == (out.text, out.token_ids)


def test_skip_special_tokens_decides_whether_eos_is_in_the_text(llm):
    """EOS forced by ``logit_bias`` past ``ignore_eos``: left out of the text by default (vLLM's
    ``skip_special_tokens=True``), written out with ``False``; the token ids hold it either way."""
    eos = llm.eos_token_ids[0]
    params = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    skipped = llm.generate("The cat", SamplingParams(**params))[0].outputs[0]
    kept = llm.generate("The cat", SamplingParams(**params, skip_special_tokens=False))[0].outputs[0]
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    special = load_tokenizer(llm.model_path).decode([eos])
    assert skipped.text == "" and kept.text == special * 3 and special


def test_chat_uses_the_checkpoint_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids == tok.encode("System: Be brief.\nUser: Hello\nAssistant:", add_special_tokens=False)
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids}, SamplingParams(temperature=0, max_tokens=4))
    assert out.outputs[0].token_ids == direct[0].outputs[0].token_ids
    two = llm.chat([messages, messages[1:]], SamplingParams(temperature=0, max_tokens=4))
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="message 0 must be a dict"):
        llm.chat([{"role": "user"}])


def test_generation_config_defaults(ckpt, tmp_path):
    """``generation_config="auto"`` takes the checkpoint's sampling defaults and EOS ids when
    ``generate`` gets no sampling params; ``"vllm"`` ignores them."""
    import shutil

    path = tmp_path / "with-defaults"
    shutil.copytree(ckpt, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update({"top_k": 1, "max_new_tokens": 5, "eos_token_id": [2, 77]})
    (path / "generation_config.json").write_text(json.dumps(gen))
    with LLM(str(path), tensor_parallel_size=1) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.top_k, defaults.max_tokens, defaults.is_greedy) == (1, 5, True)
        assert 77 in llm.eos_token_ids
        out = llm.generate([[5, 6, 7]])[0].outputs[0]
        ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
        assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    with LLM(str(path), tensor_parallel_size=1, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        assert 77 not in llm.eos_token_ids
