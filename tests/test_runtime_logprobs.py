"""Logprobs as vLLM reports them, through ``LLM`` on CPU: ``CompletionOutput.logprobs`` holds
``Logprob(logprob, rank, decoded_token)`` objects (the token first, then the N most likely ranked
1..N, each id decoded alone), in ``generate`` and in a stream alike."""

from __future__ import annotations

import pytest

from tpspec import LLM, Logprob, SamplingParams

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
