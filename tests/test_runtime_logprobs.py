"""Logprobs as vLLM reports them, through ``LLM`` on CPU: ``CompletionOutput.logprobs`` holds
``Logprob(logprob, rank, decoded_token)`` objects (the token first, then the N most likely ranked
1..N, each id decoded alone), in ``generate`` and in a stream alike; ``prompt_logprobs=N`` gives
``RequestOutput.prompt_logprobs`` (None, then one dict per prompt token) equal to the log-softmax
of transformers' logits, the same at TP 1 and 2 and with the prompt chunked or not in
deterministic mode."""

from __future__ import annotations

import pytest
import torch

from tpspec import LLM, Logprob, SamplingParams
from tpspec.runtime.llm import tiny_model_path

PROMPTS = ["The cat sat on the", {"prompt_token_ids": [231, 447, 472, 152, 319, 425, 219, 307]}]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", max_num_seqs=4, max_model_len=128) as llm:
        yield llm


def test_logprob_objects_as_vllm(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=2, ignore_eos=True)
    tok = llm.get_tokenizer()
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    outside = 0
    for c in outs:
        assert len(c.logprobs) == len(c.token_ids) == 12
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)))
        for t, entry in zip(c.token_ids, c.logprobs):
            assert next(iter(entry)) == t and all(isinstance(v, Logprob) for v in entry.values())
            assert all(v.decoded_token == tok.decode([i]) for i, v in entry.items())
            top = sorted((i for i in entry if entry[i].rank <= 2), key=lambda i: entry[i].rank)
            assert [entry[i].rank for i in top] == [1, 2] and entry[top[0]].logprob >= entry[top[1]].logprob
            if t not in top:  # drawn outside the top 2: ranked below them
                outside += 1
                assert entry[t].rank > 2 and entry[t].logprob <= entry[top[1]].logprob
    assert outside > 0  # T = 1 draws some tokens outside the top 2
    # A stream reports the same objects.
    streamed: dict[str, list] = {}
    for out in llm.generate(PROMPTS, params, stream=True):
        streamed.setdefault(out.request_id, []).extend(out.outputs[0].logprobs or [])
    assert [streamed[k] for k in sorted(streamed, key=int)] == [c.logprobs for c in outs]


# --- prompt logprobs ------------------------------------------------------------------------

LONG = [231, 447, 472, 152, 319, 425, 219, 307, 399, 295, 138, 101, 361, 92, 411, 182, 357, 82, 154, 173, 380,
        383, 182, 334, 84, 427, 193, 111, 186, 98, 340, 101, 5, 9, 200, 31]
PROMPT_PROMPTS = [{"prompt_token_ids": LONG}, "The cat sat on the mat and then", {"prompt_token_ids": [7]}]


def _prompt_logprobs(tp: int, *, chunk: int = 512, deterministic: bool = False, n: int = 1, **kw):
    """prompt logprobs (top 5) of PROMPT_PROMPTS beside a sampled neighbour; ``chunk``: the step's token budget."""
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=4, prompt_logprobs=5, n=n, ignore_eos=True)] * 3
    params.append(SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))
    with LLM("tiny", tensor_parallel_size=tp, dtype="float32", deterministic=deterministic, max_num_seqs=4,
             max_model_len=128, max_num_batched_tokens=chunk, **kw) as llm:
        outs = llm.generate(PROMPT_PROMPTS + ["Once upon a time"], params)
    assert outs[3].prompt_logprobs is None  # not asked
    return [o.prompt_logprobs for o in outs[:3]], outs


def test_prompt_logprobs_match_transformers():
    transformers = pytest.importorskip("transformers")
    got, outs = _prompt_logprobs(1, n=2)
    assert all(len(o.outputs) == 2 for o in outs[:3])  # two samples, the prompt scored once
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path(), torch_dtype=torch.float32).eval()
    worst = 0.0
    for out, lps in zip(outs[:3], got):
        ids = out.prompt_token_ids
        assert len(lps) == len(ids) and lps[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
        for j in range(1, len(ids)):
            entry, row = lps[j], ref[j - 1]
            assert next(iter(entry)) == ids[j] and all(isinstance(v, Logprob) for v in entry.values())
            top = row.topk(5).indices.tolist()
            assert sorted((v.rank, t) for t, v in entry.items() if t in top) == [(r + 1, t) for r, t in enumerate(top)]
            for t, v in entry.items():
                worst = max(worst, abs(v.logprob - float(row[t])))
            if entry[ids[j]].rank > 5:
                assert entry[ids[j]].rank == int((row >= row[ids[j]]).sum())
            assert all(isinstance(v.decoded_token, str) for v in entry.values())
    assert worst < 1e-5, worst


@pytest.fixture(scope="module")
def deterministic_tp1():
    return _prompt_logprobs(1, deterministic=True)[0]


def test_prompt_logprobs_tp2_equal_tp1_in_deterministic_mode(deterministic_tp1):
    assert _prompt_logprobs(2, deterministic=True)[0] == deterministic_tp1


def test_prompt_logprobs_with_speculation_equal_without_in_deterministic_mode(deterministic_tp1):
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert _prompt_logprobs(1, deterministic=True, speculative_config=ngram)[0] == deterministic_tp1


def test_chunked_prefill_gives_the_prompt_logprobs_of_one_chunk(deterministic_tp1):
    """The long prompt in chunks of 8 tokens beside the others: bit for bit in deterministic mode,
    within 1e-5 in the default mode (the kernels' rounding depends on the chunk's shape)."""
    assert _prompt_logprobs(1, chunk=8, deterministic=True)[0] == deterministic_tp1
    one, chunked = _prompt_logprobs(1)[0], _prompt_logprobs(1, chunk=8)[0]
    for a, b in zip(one, chunked):
        for x, y in zip(a[1:], b[1:]):
            assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)


def test_prompt_logprobs_in_a_stream_and_bad_values(llm):
    params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1)
    whole = llm.generate(PROMPTS[:1], params)[0].prompt_logprobs
    firsts = [out.prompt_logprobs for out in llm.generate(PROMPTS[:1], params, stream=True)]
    assert firsts[0] == whole and all(p is None for p in firsts[1:])  # once, with the first tokens
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
