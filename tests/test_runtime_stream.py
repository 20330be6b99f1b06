"""Streaming and continuous batching through ``LLM``: a stream's deltas join to the batch
output; requests added between steps join the running batch and give the tokens they give
alone (plain TP and attention DP, n-gram speculation); aborted requests leave the batch."""

from __future__ import annotations

import pytest

from tpspec import LLM, SamplingParams
from tpspec.model.tiny import make_tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
PROMPTS = ["one two three one two three", "The cat sat on the mat.", [5, 6, 7, 8, 5, 6, 7], "Hello"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        yield str(make_tiny_checkpoint(tmp_path_factory.mktemp("stream") / "tiny", seed=0))


@pytest.fixture(scope="module")
def llm(ckpt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        with LLM(ckpt, tensor_parallel_size=2, speculative_config=NGRAM, max_num_seqs=3) as llm:
            yield llm


def _joined(stream) -> dict:
    """``{(request_id, index): (text, token_ids, logprobs, cumulative_logprob, finish_reason,
    stop_reason)}`` from a stream: the deltas joined, the last cumulative logprob."""
    acc: dict = {}
    finished = []
    for out in stream:
        assert out.request_id not in finished, "output after the request finished"
        for c in out.outputs:
            text, ids, lps, _, _, _ = acc.get((out.request_id, c.index), ("", [], None, None, None, None))
            if c.logprobs is not None:
                lps = (lps or []) + c.logprobs
            acc[(out.request_id, c.index)] = (text + c.text, ids + c.token_ids, lps, c.cumulative_logprob,
                                              c.finish_reason, c.stop_reason)
        if out.finished:
            finished.append(out.request_id)
    assert sorted(finished) == sorted({rid for rid, _ in acc})
    return acc


def test_stream_deltas_join_to_the_batch_output(llm):
    params = [SamplingParams(temperature=0, max_tokens=16, logprobs=2),
              SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=14, logprobs=0),
              SamplingParams(temperature=0, max_tokens=12, stop=["e"]), SamplingParams(temperature=0.7, seed=1)]
    batch = llm.generate(PROMPTS, params)
    streamed = _joined(llm.generate(PROMPTS, params, stream=True))
    want = {(str(int(o.request_id) + len(PROMPTS)), c.index): (c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
                                                               c.finish_reason, c.stop_reason)
            for o in batch for c in o.outputs}
    assert streamed == want
    assert all(v[2] is not None and len(v[2]) == len(v[1]) for k, v in want.items() if k[0] in ("4", "5")), want


@pytest.mark.parametrize("adp", [False, True], ids=["tp2", "tp2-adp"])
def test_requests_added_between_steps_give_their_alone_tokens(ckpt, adp):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(ckpt, tensor_parallel_size=2, attention_dp=adp, speculative_config=NGRAM, max_num_seqs=2) as llm:
        alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in PROMPTS]
        got: dict[str, list[int]] = {}
        ids = [llm.add_request(PROMPTS[0], greedy)]
        for step in range(40):
            if step in (2, 3, 7):  # arrivals while others run; 2 slots: one waits for a free slot
                ids.append(llm.add_request(PROMPTS[len(ids)], greedy))
            for out in llm.step():
                got[out.request_id] = got.get(out.request_id, []) + out.outputs[0].token_ids
            if len(ids) == len(PROMPTS) and not llm.has_unfinished_requests():
                break
        assert not llm.has_unfinished_requests()
    assert [got[i] for i in ids] == alone


def test_abort_request_leaves_the_batch(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    keep = llm.add_request(PROMPTS[2], greedy)
    drop = llm.add_request(PROMPTS[1], greedy)
    seen: dict[str, list[int]] = {keep: [], drop: []}
    for _ in range(2):
        for out in llm.step():
            seen[out.request_id] += out.outputs[0].token_ids
    llm.abort_request(drop)
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == keep
            seen[keep] += out.outputs[0].token_ids
    assert seen[keep] == llm.generate(PROMPTS[2], greedy)[0].outputs[0].token_ids
    assert 0 < len(seen[drop]) < 30


def test_an_abandoned_stream_leaves_the_llm_usable(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    stream = llm.generate(PROMPTS[:2], greedy, stream=True)
    next(stream)
    stream.close()  # the caller stops reading: both requests leave the batch
    assert not llm.has_unfinished_requests()
    alone = llm.generate(PROMPTS[0], greedy)[0].outputs[0].token_ids
    assert len(alone) == 20
