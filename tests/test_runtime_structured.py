"""Structured outputs and logit controls through ``LLM`` on the tiny model (CPU).

Every sampled structured output (T = 1) parses and validates: JSON against its schema, a regex
by fullmatch, a choice by membership, a Lark grammar by its language. Greedy and seeded
structured outputs are the same with speculation off, n-gram drafts, a draft model and an
EAGLE-3 head (strict acceptance); rejection acceptance keeps every output valid; TP 1, 2 and 4
give the same tokens (deterministic mode: the logits are then the same bits at every TP size).
The grammar's end ends a request (``"stop"``). ``logit_bias`` +100 forces its token,
``allowed_token_ids`` keeps every token in the set, ``bad_words`` never appear (greedy and
sampled, with speculation). Bad schemas, regexes, grammars and token ids raise ``ValueError``
before any rank sees the request, and the LLM stays usable."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tpspec import LLM, SamplingParams, StructuredOutputsParams
from tpspec.runtime.llm import tiny_model_path
from tpspec.runtime.structured import TokenConstraints, bad_words_token_ids, compile_grammar, ll_tokenizer
from tpspec.runtime.tokenizer import load_tokenizer
from tpspec.testing import run_ranks

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "pet": {"enum": ["cat", "dog", "bird"]}}}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}
FLAGS = {"type": "object", "additionalProperties": False, "required": ["ok", "level"],
         "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}}}
EMAIL = r"[a-z]{1,6}@[a-z]{1,5}\.(com|org|net)"
PHONE = r"\d{3}-\d{4}"
COLORS = ["red", "green", "blue", "yellow"]
SUM = 'start: "(" NUM ("+" NUM)? ("+" NUM)? ")"\nNUM: /[0-9]{1,2}/'
SUM_LANGUAGE = r"\([0-9]{1,2}(\+[0-9]{1,2}){0,2}\)"

# (constraint, how an output is checked). Compact JSON: bounded schemas then have bounded outputs.
KINDS = [
    (StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), ("json", PERSON)),
    (StructuredOutputsParams(json=json.dumps(DIGITS), disable_any_whitespace=True), ("json", DIGITS)),
    (StructuredOutputsParams(json=FLAGS, disable_any_whitespace=True), ("json", FLAGS)),
    (StructuredOutputsParams(regex=EMAIL), ("regex", EMAIL)),
    (StructuredOutputsParams(regex=PHONE), ("regex", PHONE)),
    (StructuredOutputsParams(choice=COLORS), ("choice", COLORS)),
    (StructuredOutputsParams(grammar=SUM), ("regex", SUM_LANGUAGE)),
]
PROMPTS = ["The cat", "Once upon a time", "A dog ran", "The river", "Tom said"]
MAX_TOKENS = 64  # above every bounded output's length in tokens


def check_output(text: str, check: tuple) -> None:
    kind, spec = check
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "regex":
        assert re.fullmatch(spec, text), (text, spec)
    else:
        assert text in spec, (text, spec)


def structured_batch(count: int, *, seed: int | None = None, temperature: float = 1.0, **extra):
    """``count`` requests cycling through :data:`KINDS` and :data:`PROMPTS`: (prompts, params, checks)."""
    prompts, params, checks = [], [], []
    for i in range(count):
        so, check = KINDS[i % len(KINDS)]
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(temperature=temperature, seed=None if seed is None else seed + i,
                                     max_tokens=MAX_TOKENS, structured_outputs=so, **extra))
        checks.append(check)
    return prompts, params, checks


# ------------------------------------------------------------------ one rank's grammar state

@pytest.fixture(scope="module")
def tokenizers():
    hf = load_tokenizer(tiny_model_path())
    return hf, ll_tokenizer(hf, 512, [2])


def _allowed(bits: np.ndarray) -> set[int]:
    return set(np.nonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))[0].tolist())


def test_masks_after_drafts_leave_the_matcher_where_it_was(tokenizers):
    hf, ll = tokenizers
    grammar = compile_grammar(StructuredOutputsParams(regex=r"(cat|car|dog)s?"), ll)
    state = TokenConstraints(512, grammar=grammar, tokenizer=ll, eos_token_ids=[2])
    first = state.mask()
    words = ("cat", "car", "dog", "cats", "cars", "dogs")
    texts = {hf.decode([t]) for t in _allowed(first)}
    assert "c" in texts and "d" in texts and all(any(w.startswith(x) for w in words) for x in texts)
    c = hf.encode("c", add_special_tokens=False)
    after_c = state.mask(c)
    moved = TokenConstraints(512, grammar=grammar, tokenizer=ll, eos_token_ids=[2])
    moved.commit(c[0])
    assert np.array_equal(after_c, moved.mask())  # the mask after a draft is the mask after that token
    assert all(hf.decode([t])[0] in "ar" for t in _allowed(after_c))
    assert np.array_equal(state.mask(), first)  # drafts consumed, masked, rolled back
    rejected = hf.encode("x", add_special_tokens=False)
    assert np.array_equal(state.mask(rejected), np.full(16, -1, np.int32))  # past a rejected draft: unused rows
    assert np.array_equal(state.mask(rejected + c), np.full(16, -1, np.int32))
    for t in hf.encode("cat", add_special_tokens=False):
        state.commit(t)
    assert not state.finished and 2 in _allowed(state.mask())  # accepting: EOS or "s"
    state.commit(hf.encode("s", add_special_tokens=False)[0])
    assert state.finished and _allowed(state.mask()) == {2}  # complete: only EOS
    fresh = TokenConstraints(512, grammar=grammar, tokenizer=ll, eos_token_ids=[2])
    with pytest.raises(RuntimeError, match="breaks the request's grammar"):
        fresh.commit(rejected[0])


@pytest.mark.parametrize("so", [StructuredOutputsParams(grammar='root ::= "yes" | "no"'),  # GBNF
                                StructuredOutputsParams(grammar='start: "yes" | "no"'),  # Lark
                                StructuredOutputsParams(choice=["yes", "no"])])
def test_grammar_syntaxes_compile_to_the_same_language(tokenizers, so):
    hf, ll = tokenizers
    state = TokenConstraints(512, grammar=compile_grammar(so, ll), tokenizer=ll, eos_token_ids=[2])
    assert {hf.decode([t])[0] for t in _allowed(state.mask())} == {"y", "n"}
    for t in hf.encode("no", add_special_tokens=False):
        state.commit(t)
    assert state.finished


def test_structural_tag_allows_free_text_until_its_trigger(tokenizers):
    hf, ll = tokenizers
    tag = {"type": "structural_tag", "triggers": ["<f="],
           "structures": [{"begin": "<f=add>", "schema": {"type": "object"}, "end": "</f>"}]}
    state = TokenConstraints(512, grammar=compile_grammar(StructuredOutputsParams(structural_tag=json.dumps(tag)), ll),
                             tokenizer=ll, eos_token_ids=[2])
    assert len(_allowed(state.mask())) > 200  # free text
    for t in hf.encode("Hi <f=add>", add_special_tokens=False):
        state.commit(t)
    assert {hf.decode([t]) for t in _allowed(state.mask())} == {"{"}  # inside the tag: its JSON schema


def test_allowed_tokens_and_bad_words_by_vllms_rule(tokenizers):
    hf, _ = tokenizers
    words = bad_words_token_ids(["ab", ". The", "x"], hf, 512)
    # "ab" / " ab" and "x" / " x" keep their length with a space; ". The" / " . The" does not.
    assert words == ((68, 69), (103, 69), (17, 125), (91,), (389,))
    state = TokenConstraints(512, allowed=[17, 68, 69, 91, 125, 2], bad_words=words, eos_token_ids=[2])
    assert _allowed(state.mask()) == {17, 68, 69, 125, 2}  # allowed tokens, minus the one-token word "x"
    assert _allowed(state.mask([68])) == {17, 68, 125, 2}  # "a" then "b" would say "ab"
    state.commit(17)
    assert _allowed(state.mask()) == {17, 68, 69, 2}  # "." just generated: " The" banned
    assert _allowed(state.mask([2])) == {17, 68, 69, 125, 2}
    only_x = TokenConstraints(512, allowed=[91, 389], bad_words=words, eos_token_ids=[2])
    assert _allowed(only_x.mask()) == {2}  # nothing left: the request may only end
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad_words_token_ids(["zebra"], hf, 50)


def _traffic_worker(rank: int, world: int, requests) -> dict:
    """An engine at TP ``world`` running ``requests``, with its exchange's collectives counted."""
    from tpspec import distributed as D
    from tpspec.mapping import Mapping
    from tpspec.runtime.config import EngineConfig
    from tpspec.runtime.engine import Engine
    from tpspec.vocab_parallel import VocabShardedLogits

    engine = Engine(EngineConfig(tiny_model_path(), world, "cpu", "float32", max_batch_size=8, max_seq_len=256,
                                 eos_token_ids=(2,), exchange="allgather"),
                    Mapping(world, rank, world), "cpu")
    ex = engine.exchange
    seen = {"bytes": 0, "rows": 0, "gathers": 0}
    keys = ex.max_keys

    def max_keys(values, *, channel=1):
        seen["bytes"] += values.numel() * 8 * D.group_size(ex.group)
        seen["rows"] += values.numel()
        return keys(values, channel=channel)

    def refuse(*args, **kwargs):
        seen["gathers"] += 1
        raise AssertionError("a selection gathered rows")

    ex.max_keys = max_keys
    ex.gather_rows = ex.sum_rows = refuse
    VocabShardedLogits.gather = refuse
    results = engine.generate(requests)
    return {"seen": seen, "tokens": [r.token_ids for r in results]}


def test_masked_rows_cross_ranks_as_8_byte_keys(tokenizers):
    """TP 2: structured requests (greedy and T = 1) exchange one 8-byte key a row a rank, like any
    row: nothing of their masks crosses, far below one float32 logits row / 8 (256 bytes)."""
    from tpspec.runtime.config import Request

    hf, ll = tokenizers
    requests = []
    for i, (so, check) in enumerate(KINDS):
        grammar = compile_grammar(so, ll)
        for j, t in enumerate((0.0, 1.0)):
            requests.append(Request(2 * i + j, tuple(hf.encode(PROMPTS[i % len(PROMPTS)])),
                                    SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS, structured_outputs=so),
                                    MAX_TOKENS, (2,), grammar=grammar))
    per_rank = run_ranks(_traffic_worker, 2, requests)
    assert per_rank[0]["tokens"] == per_rank[1]["tokens"]
    for i, (so, check) in enumerate(KINDS):
        for j in range(2):
            check_output(hf.decode(per_rank[0]["tokens"][2 * i + j], skip_special_tokens=True), check)
    seen = per_rank[0]["seen"]
    assert seen["gathers"] == 0 and seen["rows"] > 100
    assert seen["bytes"] / seen["rows"] == 16 < 4 * 512 / 8


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", max_num_seqs=32) as llm:
        yield llm


def test_200_sampled_structured_outputs_all_validate(llm):
    prompts, params, checks = structured_batch(200)
    outs = llm.generate(prompts, params)
    for out, check in zip(outs, checks):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", (sample.text, check)
        check_output(sample.text, check)
    assert len({o.outputs[0].text for o in outs}) > 50  # T = 1: the noise decides, not one answer per kind


def test_filtered_and_penalised_structured_outputs_validate(llm):
    prompts, params, checks = structured_batch(28, seed=100, temperature=0.9, top_p=0.8, top_k=20, min_p=0.05,
                                               repetition_penalty=1.3, presence_penalty=0.5)
    for out, check in zip(llm.generate(prompts, params), checks):
        assert out.outputs[0].finish_reason == "stop"
        check_output(out.outputs[0].text, check)


def test_grammar_end_stops_and_length_cuts(llm):
    so = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=20, structured_outputs=so))[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.stop_reason is None
    # The grammar ends after its last token: no EOS is generated for it.
    assert len(out.token_ids) < 20 and not set(out.token_ids) & set(llm.eos_token_ids), out.token_ids
    person = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    cut = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=2, structured_outputs=person))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 2 and cut.text.startswith("{")


def test_streamed_structured_output_equals_batch(llm):
    so, check = KINDS[0]
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=MAX_TOKENS, structured_outputs=so)
    whole = llm.generate("The cat", params)[0].outputs[0]
    text = "".join(c.text for out in llm.generate("The cat", params, stream=True) for c in out.outputs)
    assert text == whole.text
    check_output(text, check)


SPECS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "draft model": {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle3", "model": "tiny", "num_speculative_tokens": 2},
}


def _greedy_and_seeded(spec, tp: int = 1, acceptance: str | None = None, **llm_kwargs):
    """Tokens of 7 greedy then 7 seeded structured requests (every kind once each)."""
    if spec is not None and acceptance is not None:
        spec = dict(spec, acceptance=acceptance)
    prompts, greedy, checks = structured_batch(len(KINDS), temperature=0.0)
    _, seeded, _ = structured_batch(len(KINDS), seed=40)
    with LLM("tiny", tensor_parallel_size=tp, max_num_seqs=16, speculative_config=spec, **llm_kwargs) as llm:
        outs = llm.generate(prompts + prompts, greedy + seeded)
    for out, check in zip(outs, checks + checks):
        check_output(out.outputs[0].text, check)
    return [list(o.outputs[0].token_ids) for o in outs], sum(o.outputs[0].stats.num_accepted_drafts for o in outs)


@pytest.fixture(scope="module")
def reference_tokens():
    tokens, _ = _greedy_and_seeded(None)
    return tokens


@pytest.mark.parametrize("name", ["ngram", "draft model", "eagle3"])
def test_structured_outputs_do_not_depend_on_the_drafter(reference_tokens, name):
    """Strict acceptance: a draft is kept only where it equals the masked target's choice, so the
    greedy and seeded outputs are those of plain decoding; drafts the grammar rejects are never
    emitted (every output validates)."""
    tokens, accepted = _greedy_and_seeded(SPECS[name])
    assert tokens == reference_tokens
    assert accepted > 0


@pytest.mark.slow
def test_rejection_acceptance_keeps_outputs_valid(reference_tokens):
    """Rejection sampling with sampled draft-model drafts (drafted under the masks): greedy rows
    equal plain decoding, sampled rows all validate."""
    tokens, _ = _greedy_and_seeded(SPECS["draft model"], acceptance="rejection")
    assert tokens[:len(KINDS)] == reference_tokens[:len(KINDS)]


@pytest.fixture(scope="module")
def deterministic_reference():
    tokens, _ = _greedy_and_seeded(SPECS["ngram"], tp=1, deterministic=True, max_model_len=128)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_same_tokens_at_tp_1_2_4(deterministic_reference, tp):
    """Deterministic mode (the logits are the same bits at every TP size): the masked rows, each
    rank masking its own columns, pick the same tokens at TP 1, 2 and 4."""
    tokens, _ = _greedy_and_seeded(SPECS["ngram"], tp=tp, deterministic=True, max_model_len=128)
    assert tokens == deterministic_reference


def test_same_tokens_at_tp_2_default_mode(reference_tokens):
    """Default mode at TP 2 (the tiny model in float32 is far from ties): the same tokens as TP 1."""
    tokens, _ = _greedy_and_seeded(None, tp=2)
    assert tokens == reference_tokens


# ------------------------------------------------------------------ logit controls

def _contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


@pytest.fixture(scope="module")
def spec_llm():
    with LLM("tiny", tensor_parallel_size=2, max_num_seqs=8,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        yield llm


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans(spec_llm, temperature):
    forced = spec_llm.tokenizer.encode(" dog", add_special_tokens=False)[-1]
    out = spec_llm.generate("The cat sat", SamplingParams(temperature=temperature, seed=1, max_tokens=12,
                                                          logit_bias={forced: 100}))[0].outputs[0]
    assert out.token_ids == [forced] * 12
    base = spec_llm.generate("The cat sat", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    banned = spec_llm.generate("The cat sat", SamplingParams(temperature=temperature, seed=1, max_tokens=12,
                                                             logit_bias={base[0]: -100}))[0].outputs[0]
    assert base[0] not in banned.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_keep_every_token_in_the_set(spec_llm, temperature):
    allowed = [spec_llm.tokenizer.encode(w, add_special_tokens=False)[-1] for w in (" the", " cat", " dog", ".")]
    outs = spec_llm.generate(["The cat sat", "Once upon"] * 3,
                             [SamplingParams(temperature=temperature, seed=s, max_tokens=16, ignore_eos=True,
                                             allowed_token_ids=allowed) for s in range(6)])
    for out in outs:
        assert len(out.outputs[0].token_ids) == 16 and set(out.outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("words", [[". The"], ["."]])
def test_bad_words_never_appear(spec_llm, temperature, words):
    """vLLM's rule: a word's last token is banned where its other tokens were just generated (a
    one-token word always); each word as written (leading spaces stripped) and, when that keeps its
    length, with a leading space (``bad_words_token_ids``)."""
    from tpspec.runtime.structured import bad_words_token_ids

    sequences = bad_words_token_ids(words, spec_llm.tokenizer, spec_llm.vocab_size)
    prompts = ["The cat sat", "The cat sat on the mat", "Once upon a time"]
    plain = spec_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert any(_contains(list(o.outputs[0].token_ids), s) for o in plain for s in sequences)  # it can fail
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=24, ignore_eos=True, bad_words=words)
              for s in range(len(prompts))]
    outs = [list(o.outputs[0].token_ids) for o in spec_llm.generate(prompts, params)]
    for tokens in outs:
        assert not any(_contains(tokens, s) for s in sequences), tokens
    if len(sequences[0]) > 1:  # the word's first tokens alone stay allowed
        assert any(sequences[0][0] in tokens for tokens in outs)


def test_controls_combine_with_structured_outputs(spec_llm):
    so = StructuredOutputsParams(choice=["red", "green", "blue"])
    red = spec_llm.tokenizer.encode("red", add_special_tokens=False)
    out = spec_llm.generate("The cat", SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs=so,
                                                      logit_bias={red[0]: 100}))[0].outputs[0]
    assert out.text == "red" and out.finish_reason == "stop"
    out = spec_llm.generate("The cat", SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs=so,
                                                      bad_words=["red", "blue"]))[0].outputs[0]
    assert out.text == "green"


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("so,match", [
    (StructuredOutputsParams(regex="a(b"), "(?s)regex is invalid.*unclosed group"),
    (StructuredOutputsParams(json="{not json"), "json is not valid JSON"),
    (StructuredOutputsParams(json={"type": "bogus"}), "(?s)json is invalid.*bogus"),
    (StructuredOutputsParams(json={"$ref": "#/nowhere"}), "json is invalid"),
    (StructuredOutputsParams(grammar="start: foo"), "(?s)grammar is invalid.*foo"),
    (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
    (StructuredOutputsParams(structural_tag={"structures": []}), "structural_tag"),
])
def test_bad_grammars_raise_before_the_ranks(llm, so, match):
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=match):
        llm.generate(["The cat", "A dog"], [good, SamplingParams(structured_outputs=so)])
    assert len(llm.generate("The cat", good)[0].outputs[0].token_ids) == 4  # still usable


@pytest.mark.parametrize("params,match", [
    (dict(logit_bias={512: 1.0}), r"logit_bias: token ids outside \[0, 512\)"),
    (dict(allowed_token_ids=[1, 600]), r"allowed_token_ids: token ids outside"),
])
def test_token_ids_outside_the_vocabulary_raise(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate("The cat", SamplingParams(**params))


def test_attention_dp_refuses_logit_controls():
    with LLM("tiny", tensor_parallel_size=2, attention_dp=True, max_num_seqs=2) as llm:
        for params in (dict(structured_outputs=StructuredOutputsParams(choice=["a"])), dict(logit_bias={5: 1.0}),
                       dict(allowed_token_ids=[5]), dict(bad_words=["the"])):
            with pytest.raises(ValueError, match="not supported with attention DP"):
                llm.generate("The cat", SamplingParams(**params))


def test_logprobs_stay_raw_under_controls(spec_llm):
    """Logprobs are those of the raw logits: a token forced by a +100 bias keeps its raw logprob."""
    forced = spec_llm.tokenizer.encode(" dog", add_special_tokens=False)[-1]
    plain = spec_llm.generate("The cat sat", SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0]
    biased = spec_llm.generate("The cat sat", SamplingParams(temperature=0, max_tokens=1, logprobs=20,
                                                             logit_bias={forced: 100}))[0].outputs[0]
    assert biased.token_ids == [forced] and plain.token_ids != [forced]
    raw = biased.logprobs[0][forced].logprob
    assert raw < -1.0 and abs(raw - biased.cumulative_logprob) < 1e-9  # not ~0, as under the bias
    # The row's top logprobs are the plain request's: the bias changed the draw, not the logprobs.
    assert {t: lp.logprob for t, lp in biased.logprobs[0].items() if t != forced} == {
        t: lp.logprob for t, lp in plain.logprobs[0].items() if t != forced and lp.rank <= 20}
