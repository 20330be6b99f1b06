"""Penalties and logprobs through the runtime on CPU: greedy penalised generation equals a
step-by-step full-row reference; strict speculative decoding (n-gram drafts at TP = 2)
equals plain decoding at TP = 1 with penalties on, and so does rejection acceptance (the
same tokens at TP = 1 and 2, also with a draft model's or EAGLE-3 head's sampled, penalised
drafts); a request alone equals the same request after another
penalised request used its slot; logprobs match float64 ``log_softmax`` of the raw logits;
attention DP refuses them with a clear error; bad CLI values exit cleanly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpspec import LLM, Logprob, SamplingParams, SpeculativeConfig
from tpspec.model import ForwardBatch, load_model
from tpspec.model.tiny import make_tiny_checkpoint, make_tiny_eagle3_head

MAX_NEW = 14
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [42] * 8, [7], [300, 301, 302, 303, 300, 301]]
# Encourages repeats (repetition < 1, negative presence) that the frequency term then
# holds back: the n-gram drafter finds matches, and the counts steer every step.
PEN = dict(repetition_penalty=0.5, presence_penalty=-1.5, frequency_penalty=0.7)
GREEDY = dict(temperature=0.0, max_tokens=MAX_NEW)
PARAMS = [SamplingParams(**GREEDY, **PEN, logprobs=3),
          SamplingParams(temperature=0.9, seed=3, max_tokens=MAX_NEW, **PEN),
          SamplingParams(**GREEDY, **PEN), SamplingParams(**GREEDY, **PEN, logprobs=0)]


def completions(outputs):
    """The one completion of each request (n = 1)."""
    return [o.outputs[0] for o in outputs]


@pytest.fixture(scope="module", autouse=True)
def _one_thread_per_rank():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("penalty_models") / "tiny", seed=0))


@pytest.fixture(scope="module")
def drafters(ckpt, tmp_path_factory):
    """A draft model and an EAGLE-3 head for the tiny target."""
    root = tmp_path_factory.mktemp("penalty_drafters")
    return {"draft_model": str(make_tiny_checkpoint(root / "draft", seed=0, draft=True)),
            "eagle3": str(make_tiny_eagle3_head(root / "eagle3", ckpt))}


@pytest.fixture(scope="module")
def plain(ckpt):
    with LLM(ckpt, tensor_parallel_size=1, max_num_seqs=4) as llm:
        yield completions(llm.generate(PROMPTS, PARAMS))


@pytest.fixture(scope="module")
def spec_tp2(ckpt):
    """TP = 2, n-gram drafts, two slots for four requests (slots change owners)."""
    with LLM(ckpt, tensor_parallel_size=2, max_num_seqs=2,
             speculative_config=SpeculativeConfig("ngram", num_speculative_tokens=3)) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference_model(ckpt):
    model = load_model(ckpt, device="cpu", dtype=torch.float32)
    model.allocate_kv_cache(4, 16)  # one sequence of up to 64 tokens, pages 0..3
    return model


def full_row(model, tokens: list[int]) -> np.ndarray:
    """The full logits row after ``tokens``, recomputed from scratch (the plainest reference)."""
    n = len(tokens)
    batch = ForwardBatch(torch.tensor(tokens), torch.arange(n), [[0, 1, 2, 3]], [0], [n], torch.tensor([n - 1]))
    return model(batch).gather()[0].numpy()


def penalised(row: np.ndarray, prompt: list[int], output: list[int], params: SamplingParams) -> np.ndarray:
    x = row.astype(np.float32).copy()
    r, p, f = (np.float32(v) for v in (params.repetition_penalty, params.presence_penalty, params.frequency_penalty))
    for v in set(prompt) | set(output):
        x[v] = x[v] / r if x[v] > 0 else x[v] * r
    for v in set(output):
        x[v] = x[v] - f * np.float32(output.count(v)) - p
    return x


def test_greedy_penalties_equal_the_reference(plain, reference_model):
    for i in (0, 2, 3):
        prompt, params, out = PROMPTS[i], PARAMS[i], plain[i].token_ids
        want: list[int] = []
        for _ in range(MAX_NEW):
            want.append(int(np.argmax(penalised(full_row(reference_model, prompt + want), prompt, want, params))))
        assert out == want
    unpenalised: list[int] = []
    for _ in range(MAX_NEW):
        unpenalised.append(int(np.argmax(full_row(reference_model, PROMPTS[0] + unpenalised))))
    assert plain[0].token_ids != unpenalised  # the penalties matter here


def test_strict_speculative_equals_plain_with_penalties(plain, spec_tp2):
    spec = completions(spec_tp2.generate(PROMPTS, PARAMS))
    for i in (0, 2, 3):  # greedy requests: speculation and TP size change nothing
        assert spec[i].token_ids == plain[i].token_ids
    assert sum(o.stats.num_accepted_drafts for o in spec) > 0  # drafts were verified and kept
    # Seeded sampled request: the same tokens at TP = 1 under the same speculation.
    with LLM(spec_tp2.model_path, tensor_parallel_size=1, max_num_seqs=2,
             speculative_config=SpeculativeConfig("ngram", num_speculative_tokens=3)) as llm:
        assert completions(llm.generate(PROMPTS[1], PARAMS[1]))[0].token_ids == spec[1].token_ids


def test_rejection_sampling_with_penalties_same_at_tp_1_and_2(ckpt, plain):
    """Rejection acceptance verifies against the penalised target distributions: greedy
    requests give plain decoding's tokens, and every request the same tokens at TP = 1 and 2."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, acceptance="rejection")
    tokens = []
    for tp in (1, 2):
        with LLM(ckpt, tensor_parallel_size=tp, max_num_seqs=2, speculative_config=spec) as llm:
            tokens.append([c.token_ids for c in completions(llm.generate(PROMPTS, PARAMS))])
    assert tokens[0] == tokens[1]
    assert [tokens[0][i] for i in (0, 2, 3)] == [plain[i].token_ids for i in (0, 2, 3)]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_penalised_sampled_drafts_same_at_tp_1_and_2(ckpt, drafters, plain, method):
    """A drafter samples the drafts of penalised sampled requests from its penalised draft logits
    (counts plus the chain's earlier drafts, each rank on its own columns) and rejection
    sampling verifies them: the same tokens at TP = 1 and 2, and greedy requests keep plain
    decoding's tokens."""
    spec = SpeculativeConfig(method, num_speculative_tokens=3, acceptance="rejection", model=drafters[method])
    params = PARAMS[:3] + [SamplingParams(temperature=1.2, seed=5, max_tokens=MAX_NEW, top_k=30, **PEN)]
    tokens = []
    for tp in (1, 2):
        with LLM(ckpt, tensor_parallel_size=tp, max_num_seqs=2, speculative_config=spec) as llm:
            tokens.append([c.token_ids for c in completions(llm.generate(PROMPTS, params))])
    assert tokens[0] == tokens[1]
    assert [tokens[0][i] for i in (0, 2)] == [plain[i].token_ids for i in (0, 2)]


def test_penalised_drafts_of_the_target_itself_are_all_accepted(ckpt):
    """The target as its own draft model: a draft step penalised like the verification row that
    checks it (slot counts plus the chain's earlier drafts) has q = p, so rejection sampling
    keeps every draft (unpenalised drafts, q != p, are rejected at most steps here)."""
    spec = SpeculativeConfig("draft_model", num_speculative_tokens=3, acceptance="rejection", model=ckpt)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=13, **PEN) for s in range(len(PROMPTS))]
    with LLM(ckpt, tensor_parallel_size=2, max_num_seqs=4, speculative_config=spec) as llm:
        outs = completions(llm.generate(PROMPTS, params))
    # 13 tokens: the context step's, then 3 steps of 3 kept drafts and a bonus token.
    assert [(len(c.token_ids), c.stats.num_accepted_drafts) for c in outs] == [(13, 9)] * len(PROMPTS)


@pytest.mark.slow
def test_penalised_sampled_drafting_is_lossless(ckpt, drafters):
    """The first three tokens of 800 seeded penalised requests, with a draft model's sampled,
    penalised drafts and rejection sampling on shards, follow the law of plain penalised
    sampling (two-sample chi-square per position)."""
    from scipy import stats

    prompt, n = [5, 6, 7, 5, 6, 7, 8], 800
    params = [SamplingParams(temperature=1.3, seed=s, max_tokens=3, ignore_eos=True, **PEN) for s in range(n)]
    spec = SpeculativeConfig("draft_model", num_speculative_tokens=3, acceptance="rejection",
                             model=drafters["draft_model"])
    draws = {}
    for name, config in (("plain", None), ("spec", spec)):
        with LLM(ckpt, tensor_parallel_size=2, speculative_config=config, max_num_seqs=64,
                 max_num_batched_tokens=512) as llm:
            draws[name] = [c.token_ids for c in completions(llm.generate([prompt] * n, params))]
    for pos in range(3):
        plain = [t[pos] for t in draws["plain"]]
        drafted = [t[pos] for t in draws["spec"]]
        common = sorted(set(plain) | set(drafted))
        table = [[plain.count(t) for t in common], [drafted.count(t) for t in common]]
        frequent = [i for i in range(len(common)) if table[0][i] + table[1][i] >= 10]
        rare = [i for i in range(len(common)) if i not in frequent]
        rows = [[r[i] for i in frequent] + ([sum(r[i] for i in rare)] if rare else []) for r in table]
        pvalue = stats.chi2_contingency(rows)[1]
        assert pvalue > 1e-3, f"token {pos}: p = {pvalue:.2g}"
    assert draws["plain"] != draws["spec"]  # speculation changed which noise drew each token


def test_counts_restart_when_a_slot_changes_owner(spec_tp2):
    alone = completions(spec_tp2.generate([PROMPTS[2]], [PARAMS[0]]))[0]
    # Two other penalised requests fill both slots first; the last one reuses a slot.
    after = completions(spec_tp2.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [PARAMS[0]] * 3))
    assert after[2].token_ids == alone.token_ids


def test_logprobs_of_raw_logits(plain, spec_tp2, reference_model):
    out = plain[0]
    assert plain[1].logprobs is None and plain[2].logprobs is None and plain[1].cumulative_logprob is None
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)),
                                                   abs=1e-9)
    assert len(out.logprobs) == len(out.token_ids) == MAX_NEW
    prompt = PROMPTS[0]
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = torch.from_numpy(full_row(reference_model, prompt + out.token_ids[:j]))
        logp = torch.log_softmax(row.double(), -1)
        top = logp.topk(3).indices.tolist()
        assert set(entry) == set(top) | {tok} and next(iter(entry)) == tok  # vLLM's order: the token first
        for t, v in entry.items():
            assert isinstance(v, Logprob) and abs(v.logprob - float(logp[t])) < 1e-5
            assert isinstance(v.decoded_token, str)  # each id decoded alone (the driver fills it in)
        assert [entry[t].rank for t in top] == [1, 2, 3]
    # logprobs=0: only the chosen token, ranked by the raw logits at least its own (vLLM's count: the
    # penalised greedy token need not be the raw argmax); the same values at TP = 2 with speculation.
    assert [list(e) for e in plain[3].logprobs] == [[t] for t in plain[3].token_ids]
    ranks = []
    for j, (tok, entry) in enumerate(zip(plain[3].token_ids, plain[3].logprobs)):
        row = torch.from_numpy(full_row(reference_model, PROMPTS[3] + plain[3].token_ids[:j]))
        ranks.append(entry[tok].rank)
        assert ranks[-1] == int((row >= row[tok]).sum())
    assert max(ranks) > 1
    spec = completions(spec_tp2.generate(PROMPTS[3], PARAMS[3]))[0]
    assert spec.token_ids == plain[3].token_ids
    for a, b in zip(spec.logprobs, plain[3].logprobs):
        assert list(a) == list(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank
                                          for t in a)


def test_attention_dp_refuses_penalties_and_logprobs(ckpt):
    with LLM(ckpt, tensor_parallel_size=2, attention_dp=True, max_num_seqs=2) as llm:
        for params in (SamplingParams(presence_penalty=0.5, max_tokens=4), SamplingParams(logprobs=1, max_tokens=4),
                       SamplingParams(prompt_logprobs=1, max_tokens=4)):
            with pytest.raises(ValueError, match="attention DP"):
                llm.generate([PROMPTS[0]], params)
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
        assert len(out.token_ids) == 4  # still usable


@pytest.mark.parametrize("flag, value, field", [("--presence-penalty", "3", "presence_penalty"),
                                                ("--repetition-penalty", "0", "repetition_penalty"),
                                                ("--logprobs", "21", "logprobs")])
def test_bad_cli_values_exit_cleanly(capsys, flag, value, field):
    from tpspec.cli import main

    assert main(["generate", flag, value]) == 2  # rejected before any worker starts
    assert field in capsys.readouterr().err
