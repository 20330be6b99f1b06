"""The runtime end to end on CPU: speculative == plain greedy decoding (TP 1 and 2, plain TP
and attention DP, n-gram and draft model, strict and rejection), seeded sampling across
TP sizes and batch compositions, stop rules, bad requests.

LLMs are built once per configuration and reused; worker processes fork from one
forkserver, so after the first start-up each LLM costs well under a second."""

from __future__ import annotations

import re

import pytest

from tpspec import LLM, SamplingParams, SpeculativeConfig
from tpspec.model.tiny import make_tiny_checkpoint, make_tiny_eagle3_head

MAX_NEW = 24


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def tokens(outs) -> list[list[int]]:
    """The token ids of each request's only sample."""
    return [o.outputs[0].token_ids for o in outs]
# Six prompts for a batch of four: slots are reused. The long one is chunked when the token
# budget is small. Repetition gives the n-gram drafter something to find.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7],
    [100, 200, 300, 5, 6, 7],
    [42] * 12,
    list(range(3, 43)),  # 40 tokens
    [7],
    [300, 301, 302, 303, 300, 301],
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread_per_rank():
    # Tiny models gain nothing from more threads, and oversubscribed OpenMP spins are slow.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime_models")
    target = make_tiny_checkpoint(root / "tiny", seed=0)
    draft = make_tiny_checkpoint(root / "tiny-draft", seed=0, draft=True)
    head = make_tiny_eagle3_head(root / "tiny-eagle3", target)
    return str(target), str(draft), str(head)


@pytest.fixture(scope="module")
def baseline(ckpt):
    """Greedy tokens at TP = 1 without speculation or chunking (the reference)."""
    with LLM(ckpt[0], tensor_parallel_size=1, max_num_seqs=8) as llm:
        outs = llm.generate(PROMPTS, greedy())
    assert all(len(o.outputs[0].token_ids) == MAX_NEW and o.outputs[0].finish_reason == "length" for o in outs)
    return tokens(outs)


@pytest.fixture(scope="module")
def llm_tp2(ckpt):
    """A plain TP = 2 LLM reused by several tests."""
    with LLM(ckpt[0], tensor_parallel_size=2, max_num_seqs=4) as llm:
        yield llm


def _spec(method: str, acceptance: str, ckpt: tuple[str, str, str]) -> SpeculativeConfig | None:
    if method == "none":
        return None
    k = 4 if method == "ngram" else 3
    draft = {"draft_model": ckpt[1], "eagle3": ckpt[2]}.get(method)
    return SpeculativeConfig(method=method, num_speculative_tokens=k, acceptance=acceptance, model=draft)


SPECS = [("none", "strict"), ("ngram", "strict"), ("ngram", "rejection"), ("draft_model", "strict"),
         ("draft_model", "rejection"), ("eagle3", "strict")]


@pytest.mark.parametrize("tp,adp", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-adp"])
def test_speculative_greedy_equals_plain_greedy(ckpt, baseline, tp, adp):
    """Every method and acceptance rule reproduces plain greedy decoding exactly, with a small
    token budget (chunked context of the 40-token prompt) and slot reuse (6 prompts, 4 slots)."""
    accepted_any = {}
    for method, acceptance in SPECS:
        spec = _spec(method, acceptance, ckpt)
        with LLM(ckpt[0], tensor_parallel_size=tp, attention_dp=adp, speculative_config=spec, max_num_seqs=4,
                 max_num_batched_tokens=24) as llm:
            outs = llm.generate(PROMPTS, greedy())
            stats = llm.last_stats
        got = tokens(outs)
        assert got == baseline, f"{method}/{acceptance} at tp={tp} adp={adp} differs from plain greedy"
        for o in outs:
            st = o.outputs[0].stats
            assert st.num_generated_tokens == MAX_NEW
            assert len(st.accepted_drafts_per_step) == st.num_steps - 1  # the context step drafts nothing
            assert st.num_accepted_drafts == sum(st.accepted_drafts_per_step)
            # Stats count emitted tokens: one from the context step, 1 + accepted from each
            # generation step, the last step's overshoot past max_new_tokens excluded.
            assert 1 + sum(1 + a for a in st.accepted_drafts_per_step) == st.num_generated_tokens
        accepted_any[method] = stats.num_accepted_drafts
    # The drafters do propose tokens the target keeps (otherwise the test proves little).
    assert accepted_any["ngram"] > 0 and accepted_any["draft_model"] > 0


@pytest.mark.parametrize("method,adp", [("draft_model", False), ("eagle3", False), ("eagle3", True)],
                         ids=["draft_model", "eagle3", "eagle3-adp"])
def test_speculative_greedy_equals_plain_greedy_at_tp4(ckpt, baseline, method, adp):
    """The model drafters at TP = 4 (the tiny model's 2 KV heads replicated), kept small: two prompts."""
    with LLM(ckpt[0], tensor_parallel_size=4, attention_dp=adp, speculative_config=_spec(method, "strict", ckpt),
             max_num_seqs=2) as llm:
        outs = llm.generate(PROMPTS[:2], greedy())
    assert tokens(outs) == baseline[:2]


@pytest.mark.parametrize("adp", [False, True], ids=["tp2", "tp2-adp"])
def test_context_chunked_over_many_steps(ckpt, baseline, adp):
    """A long prompt alone, fed 8 tokens a step (steps with no token due), then drafted."""
    with LLM(ckpt[0], tensor_parallel_size=2, attention_dp=adp, max_num_seqs=1, max_num_batched_tokens=8,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        outs = llm.generate([PROMPTS[3], PROMPTS[0]], greedy())
    assert tokens(outs) == [baseline[3], baseline[0]]


def test_seeded_sampling_same_across_tp_and_batch(ckpt, llm_tp2):
    """A seeded request draws the same tokens alone, in a batch of 8 (other seeds, unseeded
    neighbours, another slot), at TP = 1 and TP = 2."""
    target = [11, 12, 13, 14]
    sp = SamplingParams(temperature=0.9, seed=1234, max_tokens=16)
    others = ([SamplingParams(temperature=1.0, seed=s, max_tokens=16) for s in range(3)]
              + [SamplingParams(temperature=0.7, max_tokens=16)] * 4)
    batch_prompts = [[50 + i, 60 + i] for i in range(7)]

    alone_tp2 = tokens(llm_tp2.generate([target], sp))[0]
    # max_num_seqs 4 + 8 requests: the seeded one (last) waits and gets a reused slot.
    mixed = tokens(llm_tp2.generate(batch_prompts + [target], others + [sp]))
    assert mixed[-1] == alone_tp2
    with LLM(ckpt[0], tensor_parallel_size=1, max_num_seqs=8) as llm1:
        alone_tp1 = tokens(llm1.generate([target], sp))[0]
        mixed_tp1 = tokens(llm1.generate(batch_prompts + [target], others + [sp]))
    assert alone_tp1 == alone_tp2
    assert mixed_tp1[-1] == alone_tp2
    # Seeded neighbours reproduce across TP sizes too; sampling really samples.
    assert mixed[:3] == mixed_tp1[:3]
    assert alone_tp2 != tokens(llm_tp2.generate([target], greedy(16)))[0]
    # Unseeded requests of one batch do not share a stream.
    twins = tokens(llm_tp2.generate([target, target], SamplingParams(temperature=1.0, max_tokens=16)))
    assert twins[0] != twins[1]


def test_n_samples_distinct_and_reproducible(llm_tp2):
    """n > 1: sample 0 is the request with its own seed; the others use seeds derived from
    (seed, index), so all differ and a repeated call gives the same n samples."""
    target = [11, 12, 13, 14]
    sp = SamplingParams(n=3, temperature=1.0, seed=77, max_tokens=12)
    first = llm_tp2.generate([target], sp)[0]
    again = llm_tp2.generate([target], sp)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in first.outputs]
    assert samples == [c.token_ids for c in again.outputs]
    assert len({tuple(t) for t in samples}) == 3
    single = llm_tp2.generate([target], SamplingParams(temperature=1.0, seed=77, max_tokens=12))[0]
    assert single.outputs[0].token_ids == samples[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_rejection_speculation_same_across_tp(ckpt, method):
    """Lossless speculation on sampled rows (rejection acceptance, seeded top-k / top-p
    requests and an unseeded one) emits the same tokens at TP = 1 and TP = 2: the draws,
    acceptance uniforms and residual draws come from each request's own stream."""
    spec = _spec(method, "rejection", ckpt)
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_NEW),
              SamplingParams(temperature=1.0, top_k=20, seed=8, max_tokens=MAX_NEW),
              SamplingParams(temperature=0.6, top_p=0.9, seed=9, max_tokens=MAX_NEW),
              SamplingParams(temperature=0.9, seed=10, max_tokens=MAX_NEW)]
    runs = {}
    for tp in (1, 2):
        with LLM(ckpt[0], tensor_parallel_size=tp, speculative_config=spec, max_num_seqs=4) as llm:
            outs = llm.generate(PROMPTS[:4], params)
            runs[tp] = (tokens(outs), llm.last_stats.num_accepted_drafts)
    assert runs[1][0] == runs[2][0], f"{method}: sampled speculation differs between TP=1 and TP=2"
    assert runs[1][1] == runs[2][1]
    assert runs[2][1] > 0, "no draft was ever accepted: the test would not exercise acceptance"


def test_stop_rules_and_per_prompt_budgets(llm_tp2, baseline):
    """Stop tokens end a request (the stop token is kept, stop_reason names it); per-prompt
    max_tokens; min_tokens holds a stop token back; outputs stay in prompt order."""
    ref = baseline[0]
    stop = ref[5]
    first = ref.index(stop)
    outs = llm_tp2.generate([PROMPTS[0], PROMPTS[1]], [greedy(stop_token_ids=[stop]), greedy(3)])
    a, b = outs[0].outputs[0], outs[1].outputs[0]
    assert a.token_ids == ref[: first + 1] and a.finish_reason == "stop" and a.stop_reason == stop
    assert b.token_ids == baseline[1][:3] and b.finish_reason == "length" and b.stop_reason is None
    assert outs[0].prompt_token_ids == PROMPTS[0]
    later = llm_tp2.generate([PROMPTS[0]], greedy(stop_token_ids=[stop], min_tokens=first + 1))[0].outputs[0]
    assert len(later.token_ids) > first + 1 and later.token_ids[: first + 1] == ref[: first + 1]


def test_an_llm_seed_makes_unseeded_requests_reproducible(ckpt):
    """``LLM(seed=)``: an unseeded request draws with a seed derived from the LLM's and from its
    number among the LLM's requests. The same calls on another LLM with that seed give the same
    tokens; two requests of one call differ; another seed gives others."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for name, seed in (("first", 0), ("again", 0), ("other", 1)):
        with LLM(ckpt[0], tensor_parallel_size=1, seed=seed) as llm:
            runs[name] = tokens(llm.generate([[5, 6, 7], [5, 6, 7]], params)) + tokens(llm.generate([[5, 6, 7]], params))
    assert runs["first"] == runs["again"]
    assert len({tuple(t) for t in runs["first"]}) == 3, runs["first"]
    assert runs["other"] != runs["first"]


def test_max_seq_len_ends_requests(ckpt):
    with LLM(ckpt[0], tensor_parallel_size=1, max_model_len=16,
             speculative_config=SpeculativeConfig("ngram", num_speculative_tokens=4)) as llm:
        outs = llm.generate([[5, 6, 7, 8, 9, 10], list(range(3, 18))], greedy(None))  # up to the model length
        assert [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs] == [16, 16]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        outs = llm.generate([[5, 6, 7]], greedy(13))  # exactly the room left
        assert len(outs[0].outputs[0].token_ids) == 13
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([list(range(3, 19))])
        # A max_tokens that cannot fit beside the prompt: vLLM's 400, word for word.
        with pytest.raises(ValueError, match=re.escape(
                "prompt 1: 'max_tokens' or 'max_completion_tokens' is too large: 14. This model's maximum context "
                "length is 16 tokens and your request has 3 input tokens (14 > 16 - 3).")):
            llm.generate([[5], [5, 6, 7]], greedy(14))
        # The checkpoint's default max_tokens (16 here) is cut to the room left instead.
        assert len(llm.generate([[5, 6, 7, 8, 9, 10]])[0].outputs[0].token_ids) <= 10


def test_bad_requests_rejected_without_disturbing_others(llm_tp2, baseline):
    cases = [
        ([[]], None, "prompt 0 is empty"),
        ([PROMPTS[0], [1] * 5000], None, "prompt 1 has 5000 tokens"),
        ([[1, 2, 100000]], None, r"outside \[0, 512\)"),
        ([[1, -2]], None, "outside"),
        ([PROMPTS[0], PROMPTS[1]], [greedy()], "2 prompts"),
        ([PROMPTS[0]], "greedy", "SamplingParams"),
        ([PROMPTS[0]], {"temperature": 0.5}, "SamplingParams"),
        ([[1.5, 2.0]], None, "prompt 0 must be"),
        (None, None, "prompts must be"),
        (7, None, "prompts must be"),
        ([True, False], None, "prompt 0 must be"),
        ([{"prompt_ids": [1, 2]}], None, "prompt 0: a dict prompt"),
        ([PROMPTS[0]], greedy(stop_token_ids=[100000]), "stop_token_ids: 100000 is outside"),
        ([PROMPTS[0]], greedy(n=5), "n=5 is more than max_num_seqs=4"),
        (["ok", "a lone \ud800 surrogate"], None, r"prompt 1 is not valid Unicode text: a lone surrogate '\\ud800'"),
        # 10 MB of text: refused from its length alone (5 characters at most a token), never tokenized.
        (["x" * 10**7], None, r"prompt 0 has at least 2000000 tokens \(10000000 characters, at most 5 a token\)"),
    ]
    executor = llm_tp2._executor  # noqa: SLF001 - test hook: count what reaches the ranks
    calls = []
    original_call = executor.call

    def counted_call(*args, **kwargs):
        calls.append(args[0])
        return original_call(*args, **kwargs)

    executor.call = counted_call
    try:
        for prompts, sp, msg in cases:
            with pytest.raises(ValueError, match=msg):
                llm_tp2.generate(prompts, sp)
        assert calls == [], "a rejected request reached the ranks"
    finally:
        del executor.call
    # The LLM is still healthy and deterministic after the rejected calls.
    assert tokens(llm_tp2.generate(PROMPTS[:2], greedy())) == baseline[:2]
    assert tokens(llm_tp2.generate([{"prompt_token_ids": PROMPTS[0]}], greedy())) == baseline[:1]


def test_bad_configs_raise_clear_errors(ckpt, tmp_path):
    ngram4 = {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(ckpt[0], distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(ckpt[0], max_num_seqs=8, max_num_batched_tokens=8, speculative_config=ngram4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(ckpt[0], tensor_parallel_size=3)  # 8 heads / 2 KV heads do not split over 3 ranks: no worker starts
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig("draft_model", 4)
    with pytest.raises(ValueError, match="acceptance"):
        SpeculativeConfig("ngram", 4, acceptance="lenient")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['k'\]"):
        LLM(ckpt[0], speculative_config={"method": "ngram", "k": 4})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(ckpt[0], gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="seed"):
        LLM(ckpt[0], seed=-1)
    with pytest.raises(ValueError, match="generation_config"):
        LLM(ckpt[0], generation_config="nowhere")
    with pytest.raises(ValueError, match="method='eagle3' needs model"):
        SpeculativeConfig("eagle3", 4)
    from tpspec.model import CheckpointError

    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):  # no EAGLE-3 head: in the driver
        LLM(ckpt[0], speculative_config={"method": "eagle3", "num_speculative_tokens": 3, "model": ckpt[1]})
    from tpspec.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="max_num_tokens=8 cannot hold"):  # the engine's own config checks it too
        EngineConfig(ckpt[0], 1, "cpu", "float32", speculative=SpeculativeConfig("ngram", 4), max_num_tokens=8)
    with pytest.raises(ValueError, match="attention_dp must be a bool"):
        LLM(ckpt[0], attention_dp="yes")
    with pytest.raises(ValueError, match="exchange='ll' needs device='cuda'"):
        LLM(ckpt[0], device="cpu", exchange="ll")
    # A config.json without weights: a ValueError in the driver, before any worker starts.
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(f"{ckpt[0]}/config.json", bare / "config.json")
    with pytest.raises(ValueError, match="no safetensors weights"):
        LLM(str(bare))
    (bare / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.bin checkpoints are not supported"):
        LLM(str(bare))


def test_text_prompts_use_the_tokenizer(llm_tp2):
    tok = llm_tp2.get_tokenizer()
    out = llm_tp2.generate("Hello, world!", greedy(8))[0]
    assert out.prompt == "Hello, world!" and len(out.outputs[0].token_ids) == 8
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert out.prompt_token_ids == tok.encode("Hello, world!")
    # A chat output carries the prompt the chat template rendered, as vLLM's does.
    reply = llm_tp2.chat([{"role": "user", "content": "Hi"}], greedy(4))[0]
    assert reply.prompt == "User: Hi\nAssistant:"
    assert reply.prompt_token_ids == tok.encode(reply.prompt, add_special_tokens=False)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_sampled_drafts_on_shards_same_across_tp(ckpt, method):
    """Temperature-only sampled requests: the drafter samples its drafts with each request's own
    temperature and draft streams, and rejection sampling verifies them on the shards; the tokens
    are the same at TP = 1, 2 and 4 (a greedy request in the batch keeps plain greedy tokens)."""
    spec = _spec(method, "rejection", ckpt)
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=12),
              SamplingParams(temperature=1.1, seed=8, max_tokens=12), greedy(12)]
    runs = {}
    for tp in (1, 2, 4):
        with LLM(ckpt[0], tensor_parallel_size=tp, speculative_config=spec, max_num_seqs=3) as llm:
            runs[tp] = tokens(llm.generate(PROMPTS[:3], params))
    assert runs[1] == runs[2] == runs[4], f"{method}: sampled drafts + rejection differ across TP sizes"


@pytest.fixture(scope="module")
def plain_draws() -> dict:
    """Plain sampling's draws of the lossless tests, by their filters (two tests share theirs)."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("method,filters", [("draft_model", {}), ("eagle3", {}),
                                            ("draft_model", {"top_k": 40, "top_p": 0.9})],
                         ids=["draft_model", "eagle3", "draft_model-top_k-top_p"])
def test_speculative_sampling_is_lossless(ckpt, plain_draws, method, filters):
    """The first three generated tokens of 1200 seeded requests, with sampled drafts and rejection
    sampling on shards, follow the law of plain sampling (two-sample chi-square per position)."""
    from scipy import stats

    prompt, n, temperature = [5, 6, 7, 8, 9], 1200, 1.3
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=3, ignore_eos=True, **filters)
              for s in range(n)]

    def draw(spec):
        with LLM(ckpt[0], tensor_parallel_size=2, speculative_config=spec, max_num_seqs=64,
                 max_num_batched_tokens=512) as llm:
            return tokens(llm.generate([prompt] * n, params))

    key = tuple(sorted(filters.items()))
    if key not in plain_draws:
        plain_draws[key] = draw(None)
    draws = {"plain": plain_draws[key], "spec": draw(_spec(method, "rejection", ckpt))}
    for pos in range(3):
        plain = [t[pos] for t in draws["plain"]]
        spec = [t[pos] for t in draws["spec"]]
        common = sorted(set(plain) | set(spec))
        table = [[plain.count(t) for t in common], [spec.count(t) for t in common]]
        frequent = [i for i in range(len(common)) if table[0][i] + table[1][i] >= 10]
        rare = [i for i in range(len(common)) if i not in frequent]
        rows = [[r[i] for i in frequent] + ([sum(r[i] for i in rare)] if rare else []) for r in table]
        pvalue = stats.chi2_contingency(rows)[1]
        assert pvalue > 1e-3, f"{method}, token {pos}: p = {pvalue:.2g}"
