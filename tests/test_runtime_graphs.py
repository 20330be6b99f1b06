"""The logic around CUDA-graph generation steps, on CPU: the padded step a graph replays (run
eagerly through ``GenerationGraphs(capture=False)``: the same keys, static buffers and step
function) gives the eager step's tokens for every step shape (penalties, logprobs, top-k /
top-p / min-p rows, rejection sampling, draft-model and EAGLE-3 drafts), the undecided-row
repeat included, at TP = 1 and 2; steps launched ahead of their predecessor's tokens (greedy,
sampled, filtered, penalised, with logprobs) give the tokens of steps that waited; the graphs of
the drafting chain hold every input they read (replayed from weak references); the keys come
from the requests' parameters; when graphs are off; and the capture fallback every rank takes alike."""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch

from graph_cases import (PROMPTS, QWEN, SPECS, assert_logprobs_close, every_step_shape, first_outputs, make_models,
                         refusing_host_syncs, spec_config)
from interpreted import compile_for_hopper, needs_triton, run_interpreted
from tpspec import LLM, SamplingParams, SpeculativeConfig
from tpspec.model.batch import AttentionMetadata
from tpspec.runtime import cuda_graphs
from tpspec.runtime.cuda_graphs import GenerationGraphs, StepKey, capture_or_fall_back, step_key
from tpspec.sampling.select import FilterPlan

PARAMS = every_step_shape((12, 14, 6, 9, 10, 8))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("graph_models"))


@pytest.mark.parametrize("name", SPECS)
def test_graphed_steps_give_the_eager_tokens_on_cpu(models, name, monkeypatch):
    """What a graph replays, run eagerly on CPU (``capture=False``): batches padded to the bucket
    size with padding requests first, attention over bucketed page tables, the deferred selection
    with the key's filter plan, logprobs and EAGLE-3 hidden states from the step's outputs, the
    drafting chain of a draft model or EAGLE-3 head (sampled drafts' logits written to the store
    inside it), and the eager repeat of steps and chains with an undecided row.
    Tokens must equal the eager steps', logprobs too (within 1e-5). The drafting chain's graphs
    (``GRAPHED_DRAFT_CHAIN``) are set on here whatever the default. Every
    step function runs under :func:`refusing_host_syncs`: one that reads a device value on the host
    would fail its capture on a GPU."""
    monkeypatch.setattr(cuda_graphs, "GRAPHED_DRAFT_CHAIN", True)

    class NoSyncReplay(cuda_graphs._EagerReplay):  # noqa: SLF001 - what a graph records may not read the device
        def __init__(self, step):
            def checked(is_warmup):
                with refusing_host_syncs():
                    return step(is_warmup)
            super().__init__(checked)

    monkeypatch.setattr(cuda_graphs, "_EagerReplay", NoSyncReplay)
    with LLM(models["target"], distributed_executor_backend="external_launcher", tensor_parallel_size=1,
             device="cpu", speculative_config=spec_config(name, models), max_num_seqs=8) as llm:
        engine = llm._executor.ctx.state["engine"]  # noqa: SLF001
        ref = first_outputs(llm.generate(PROMPTS, PARAMS))
        ref_greedy = first_outputs(llm.generate(PROMPTS[:3], GREEDY))
        engine.graphs = graphs = GenerationGraphs(engine, capture=False)
        got = first_outputs(llm.generate(PROMPTS, PARAMS))
        got_greedy = first_outputs(llm.generate(PROMPTS[:3], GREEDY))
        engine.graphs = None
    assert got[0] == ref[0] and got_greedy == ref_greedy
    assert_logprobs_close(got[1], ref[1], abs_tol=1e-5)
    keys = set(graphs.graphs)
    assert {k.sampling for k in keys} == {"greedy", "filtered"} and not graphs.failed
    assert {k.batch for k in keys} >= {8, 4}  # the batch shrank through the buckets
    filtered = [k for k in keys if k.sampling == "filtered"]
    assert all(k.penalties and k.top_logprobs == 8 for k in filtered)
    assert all(k.hidden_states == name.startswith("eagle3") for k in keys)
    assert any(k.draft_logits for k in filtered) == (name in ("draft_model-rejection", "eagle3-rejection"))
    chains = set(graphs.draft_graphs)
    assert bool(chains) == name.startswith(("draft_model", "eagle3"))
    assert all(c.sampled == name.endswith("rejection") for c in chains if c.step.sampling != "greedy")
    assert graphs.num_repeated > 0  # the flat top-p row's steps were repeated eagerly, to the same tokens


def _held_weakly(value):
    """A function giving ``value`` back, with its tensors (a view: through its base) and attention
    metadata held by weak references, as a CUDA graph holds its inputs: by address, keeping none
    alive. It raises ``AssertionError`` once one of them was freed."""
    if isinstance(value, torch.Tensor):
        base = value if value._base is None else value._base  # noqa: SLF001 - a view's storage lives in its base
        ref, shape, stride, offset = weakref.ref(base), value.shape, value.stride(), value.storage_offset()
        what = f"{tuple(shape)} {value.dtype}"

        def tensor():
            alive = ref()
            if alive is None:
                raise AssertionError(f"a static input {what} of a chained draft graph was freed after its "
                                     f"capture: a replay on a GPU reads reused memory")
            return alive.as_strided(shape, stride, offset)
        return tensor
    if isinstance(value, AttentionMetadata):
        meta_ref = weakref.ref(value)

        def meta():
            alive = meta_ref()
            if alive is None:
                raise AssertionError("the attention metadata of a chained draft graph was freed after its capture")
            return alive
        return meta
    if isinstance(value, dict):
        items = {k: _held_weakly(v) for k, v in value.items()}
        return lambda: {k: item() for k, item in items.items()}
    if isinstance(value, (list, tuple)):
        parts, kind = [_held_weakly(v) for v in value], type(value)
        return lambda: kind(part() for part in parts)
    return lambda: value


@pytest.mark.parametrize("name", ["draft_model", "eagle3-rejection"])
def test_chained_draft_graphs_hold_their_static_inputs(models, name, monkeypatch):
    """A CUDA graph reads its static inputs at their capture-time addresses and keeps none of them
    alive: an input that only the capture's step function referenced is freed once the capture
    returns, and later replays read whatever reuses its memory (on a GPU: logits rows past the
    drafter's rows, an out-of-range ``index_select``). Here each chained draft step replays from
    weak references to what its capture passed ``Engine.draft_chain_step``, not from the step
    function, so a freed input fails the replay; the tokens must equal those of the eager
    chain, for a mixed batch (greedy, filtered, penalised rows) that shrinks inside a bucket and
    through the buckets."""
    monkeypatch.setattr(cuda_graphs, "GRAPHED_DRAFT_CHAIN", True)
    capturing: list | None = None  # while a step is captured: the draft_chain_step calls it makes
    replays = {"chain": 0}

    class AddressReplay(cuda_graphs._EagerReplay):  # noqa: SLF001 - a replay that holds inputs as a graph does
        def __init__(self, step):
            nonlocal capturing
            capturing = []
            try:
                super().__init__(step)
            finally:
                calls, capturing = capturing, None
            self.call = None
            if calls:  # a chained draft step: from now on only its inputs' addresses are kept
                assert len(calls) == 1
                self.call, self.step = calls[0], None

        def replay(self):
            if self.call is None:
                return super().replay()
            args, kwargs = self.call()
            fresh = cuda_graphs._ChainStepOut(*chain_step(*args, **kwargs))  # noqa: SLF001
            for static, new in zip(self.out.tensors(), fresh.tensors()):
                if static is not None:
                    static.copy_(new)
            replays["chain"] += 1

    monkeypatch.setattr(cuda_graphs, "_EagerReplay", AddressReplay)
    with LLM(models["target"], distributed_executor_backend="external_launcher", tensor_parallel_size=1,
             device="cpu", speculative_config=spec_config(name, models), max_num_seqs=8) as llm:
        engine = llm._executor.ctx.state["engine"]  # noqa: SLF001
        chain_step = engine.draft_chain_step

        def recording_chain_step(*args, **kwargs):
            if capturing is not None:
                capturing.append(_held_weakly((list(args), kwargs)))
            return chain_step(*args, **kwargs)

        monkeypatch.setattr(engine, "draft_chain_step", recording_chain_step)
        ref = first_outputs(llm.generate(PROMPTS, PARAMS))[0]
        engine.graphs = graphs = GenerationGraphs(engine, capture=False)
        got = first_outputs(llm.generate(PROMPTS, PARAMS))[0]
        engine.graphs = None
    assert got == ref
    assert graphs.draft_graphs and replays["chain"] > 0
    assert {k.step.batch for k in graphs.draft_graphs} >= {8, 4}


def test_step_keys_come_from_the_parameters():
    """The key of a step is a pure function of its requests' parameters: Qwen's defaults with
    logprobs=5 are a filtered step with penalties whose draw needs no plain exchange, no total and
    no masked draw; a top-p row without top-k sends 4 x 64 candidates under strict acceptance and
    the eager path's count (the largest top-k rounded up to a power of two) under rejection
    sampling; logprobs round up to a power of two; disabled filters leave a temperature-only step,
    a greedy batch a greedy one."""
    qwen = SamplingParams(**QWEN, logprobs=5)
    key = step_key([qwen] * 3, batch=4, kv_pages=2, acceptance="strict", vocab_size=32000)
    assert key == StepKey(batch=4, kv_pages=2, sampling="filtered", penalties=True,
                          filters=FilterPlan(candidates=64, any_plain=False, any_filtered=True, any_top_p_total=False,
                                             any_min_p_only=False), top_logprobs=8)
    mixed = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=1.0, top_k=100, min_p=0.1)]
    strict = step_key(mixed, batch=4, kv_pages=1, acceptance="strict", vocab_size=32000)
    assert strict.filters == FilterPlan(candidates=256, any_plain=True, any_filtered=True, any_top_p_total=True,
                                        any_min_p_only=False) and strict.top_logprobs == 2 and not strict.penalties
    rejection = step_key(mixed, batch=4, kv_pages=1, acceptance="rejection", vocab_size=32000, draft_logits=True)
    assert rejection.filters.candidates == 128 and rejection.draft_logits  # top-k 100, rounded up
    assert step_key([SamplingParams(temperature=1.0, top_k=20, logprobs=n) for n in (3, 1)], batch=2, kv_pages=1,
                    acceptance="strict", vocab_size=50).top_logprobs == 4
    off = [SamplingParams(temperature=0.8, top_k=-1, top_p=1.0), SamplingParams(temperature=0.8, min_p=0.0)]
    assert step_key(off, batch=2, kv_pages=1, acceptance="strict", vocab_size=50).sampling == "temperature"
    whole_vocab = step_key([SamplingParams(temperature=0.8, top_k=50)], batch=1, kv_pages=1, acceptance="strict",
                           vocab_size=50)  # a top-k of the whole vocabulary filters nothing: the plain draw
    assert whole_vocab.filters == FilterPlan(candidates=64, any_plain=True, any_filtered=False, any_top_p_total=False,
                                             any_min_p_only=False)
    assert step_key([SamplingParams(temperature=0.0, top_k=5)], batch=1, kv_pages=1, acceptance="rejection",
                    vocab_size=50, draft_logits=True) == StepKey(batch=1, kv_pages=1, sampling="greedy")
    only_min_p = step_key([SamplingParams(temperature=1.0, min_p=0.3)], batch=1, kv_pages=1, acceptance="strict",
                          vocab_size=50)
    assert only_min_p.filters == FilterPlan(candidates=64, any_plain=False, any_filtered=True,
                                            any_top_p_total=False, any_min_p_only=True)


def _graphed_engine_worker(rank, world, target, spec_method, spec_model):
    """Eager, then graphed (``capture=False``) generation on one rank of a TP group: tokens,
    logprobs, the keys used and the repeated steps. The drafting chain's graphs (off by default)
    are on here, so their step function is checked across ranks too."""
    from tpspec.mapping import Mapping
    from tpspec.runtime.config import EngineConfig, Request
    from tpspec.runtime.engine import Engine

    spec = SpeculativeConfig(spec_method, 3, model=spec_model, acceptance="rejection")
    cfg = EngineConfig(model_path=target, tp_size=world, device="cpu", dtype="float32", speculative=spec,
                       draft_model_path=spec_model, max_batch_size=8, max_seq_len=64, max_num_tokens=64)
    cuda_graphs.GRAPHED_DRAFT_CHAIN = True  # this rank process's own module
    engine = Engine(cfg, Mapping(world, rank))
    runs = []
    for graphs in (None, GenerationGraphs(engine, capture=False)):
        engine.graphs = graphs
        reqs = [Request(len(runs) * 100 + i, tuple(p), params, params.max_tokens)
                for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))]
        results = engine.generate(reqs)
        runs.append(([r.token_ids for r in results], [r.logprobs for r in results]))
    engine.graphs = None
    engine.close()
    return runs, sorted(map(repr, graphs.graphs)) + sorted(map(repr, graphs.draft_graphs)), graphs.num_repeated


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_graphed_steps_agree_across_ranks(models, method):
    """At TP = 2 (gloo) every rank takes the same graph keys and repeats the same undecided steps
    (a rank that did not would meet its peer in another collective and fail), and the graphed
    steps give the eager steps' tokens, with rejection sampling on the shards, filters, penalties
    and logprobs."""
    from tpspec.testing import run_ranks

    model = models["draft_model"] if method == "draft_model" else None
    results = run_ranks(_graphed_engine_worker, 2, models["target"], method, model, timeout_s=240)
    assert results[0] == results[1]
    (eager, graphed), keys, repeated = results[0]
    assert graphed[0] == eager[0] and keys and repeated > 0
    assert any(k.startswith("DraftKey") for k in keys) == (method == "draft_model")
    assert_logprobs_close(graphed[1], eager[1], abs_tol=1e-5)


def _graph_reason_worker(rank, world):
    from types import SimpleNamespace

    from tpspec import distributed as D
    from tpspec.runtime.cuda_graphs import graphs_unavailable_reason

    torch.cuda.is_available = lambda: True  # this process only: the decision past the device check
    engine = SimpleNamespace(device=torch.device("cuda", 0), dp_size=1, group=D.tp_group())
    plain = graphs_unavailable_reason(engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert GenerationGraphs.maybe_create(engine) is None
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    engine.dp_size = world
    return plain, graphs_unavailable_reason(engine), warned


def test_graphs_are_off_when_tp_collectives_cannot_be_captured():
    """A TP group on gloo (ranks sharing a GPU) cannot be captured: every rank decides so
    up front, instead of failing captures at run time, and rank 0 alone warns, once, with
    the reason."""
    from tpspec.testing import run_ranks

    for rank, (plain, dp, warned) in enumerate(run_ranks(_graph_reason_worker, 2, timeout_s=60)):
        assert plain is not None and "gloo" in plain
        assert dp is not None and "attention DP" in dp
        assert warned == ([f"CUDA graphs are off for this engine: {plain}"] if rank == 0 else [])


def test_a_failed_capture_warns_and_runs_the_step_eagerly(models, monkeypatch):
    """A step shape whose capture fails is run eagerly from then on, with a warning naming the
    shape and the error, to the tokens of an engine without graphs."""

    class FailingCapture(cuda_graphs._EagerReplay):  # noqa: SLF001 - stands in for a capture
        def __init__(self, step):
            raise RuntimeError("out of memory in capture")

    with LLM(models["target"], distributed_executor_backend="external_launcher", tensor_parallel_size=1,
             device="cpu", max_num_seqs=8) as llm:
        engine = llm._executor.ctx.state["engine"]  # noqa: SLF001
        ref = first_outputs(llm.generate(PROMPTS[:3], GREEDY))
        engine.graphs = graphs = GenerationGraphs(engine, capture=False)
        monkeypatch.setattr(cuda_graphs, "_EagerReplay", FailingCapture)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = first_outputs(llm.generate(PROMPTS[:3], GREEDY))
        engine.graphs = None
    assert got == ref and graphs.failed and not graphs.graphs
    warned = [str(w.message) for w in caught if "CUDA graph capture" in str(w.message)]
    assert len(warned) == len(graphs.failed)  # one warning a shape, not one a step
    assert all("failed, running it eagerly: RuntimeError: out of memory in capture" in w for w in warned)


def _capture_protocol(fails_in: str | None, *, peers_vote: int, votes: list[int]):
    """The fallback with plain callables: this rank fails in ``fails_in`` (``"warmup"``,
    ``"capture"`` or nowhere), the other ranks vote ``peers_vote``; this rank's votes are
    appended to ``votes``."""

    def warm_up():
        if fails_in == "warmup":
            raise RuntimeError("out of memory in warm-up")

    def capture():
        if fails_in == "capture":
            raise RuntimeError("out of memory in capture")
        return "graph"

    def min_over_ranks(vote):
        votes.append(vote)
        return min(vote, peers_vote)

    return capture_or_fall_back(warm_up, capture, min_over_ranks)


def test_a_capture_failure_anywhere_sends_every_rank_eager_but_a_warmup_failure_raises():
    """A capture only records, so a rank whose capture failed still meets its peers in the
    vote (and then every rank runs the step eagerly). The warm-up runs collectives: a rank
    failing there must not go on to the vote; its error is raised instead."""
    votes: list[int] = []
    with pytest.raises(RuntimeError, match="warm-up"):
        _capture_protocol("warmup", peers_vote=1, votes=votes)
    assert votes == []  # no vote after a failed warm-up
    captured, error = _capture_protocol("capture", peers_vote=1, votes=votes)
    assert captured is None and "in capture" in str(error) and votes == [0]
    captured, error = _capture_protocol(None, peers_vote=0, votes=votes)  # a peer failed: eager here too
    assert captured is None and error is None and votes == [0, 1]
    captured, error = _capture_protocol(None, peers_vote=1, votes=votes)
    assert captured == "graph" and error is None and votes == [0, 1, 1]


def test_a_capture_failure_names_the_error_that_ended_the_capture_first():
    """Ending a capture whose body raised raises again; the report leads with the body's error."""
    from tpspec.runtime.cuda_graphs import capture_failure_text

    def capture():
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        finally:
            raise RuntimeError("operation failed due to a previous error during capture")

    captured, error = capture_or_fall_back(lambda: None, capture, lambda vote: vote)
    assert captured is None and error.startswith("RuntimeError: operation not permitted when stream is capturing")
    assert error.endswith("(then RuntimeError: operation failed due to a previous error during capture)")
    assert capture_failure_text(ValueError("alone")) == "ValueError: alone"


def test_graphs_follow_the_attention_backends_ability(monkeypatch):
    """Whether steps are graphed depends on the target's attention backend (its
    ``supports_graphs``), not on the mode: the deterministic backend's host loop is refused,
    a backend that declares it can be captured is not."""
    from types import SimpleNamespace

    from tpspec.model.attention import DeterministicPagedAttention, TorchPagedAttention
    from tpspec.runtime.cuda_graphs import graphs_unavailable_reason

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the decision past the device check
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.5, dtype=torch.float32, device=torch.device("cpu"))

    def reason(attention):
        model = SimpleNamespace(attention=attention)
        return graphs_unavailable_reason(SimpleNamespace(device=torch.device("cuda", 0), dp_size=1, group=None,
                                                         model=model))

    assert reason(TorchPagedAttention(**kw)) is None
    det = DeterministicPagedAttention(**kw)  # on CPU: the host loop
    assert "'deterministic' attention" in reason(det)
    monkeypatch.setattr(det, "supports_graphs", True, raising=False)  # a backend whose attend can be captured
    assert reason(det) is None


@pytest.mark.parametrize("page_size,num_draft", [(16, 0), (16, 3), (32, 3)])
def test_packed_graph_inputs_equal_the_metadata_build(page_size, num_draft):
    """What a replay reads from the packed buffer (tokens, positions, KV write rows, visible
    lengths, page table, drafts, and the mask recomputed from the cached lengths) equals what
    ``AttentionMetadata.build`` gives the same padded batch: padding rows in scratch pages,
    ragged lengths, a sequence ending exactly on a page boundary."""
    from tpspec.model.batch import AttentionMetadata, ForwardBatch, pages_needed
    from tpspec.runtime.graph_inputs import GraphInputs

    k1 = num_draft + 1
    gen = torch.Generator().manual_seed(page_size + num_draft)
    scratch = [900, 901]
    cache_lens = [0, 0, 5, page_size - k1, 3 * page_size - k1, 2 * page_size + 7]  # two padding rows first
    free = torch.randperm(800, generator=gen).tolist()
    tables = [scratch, scratch]
    for c in cache_lens[2:]:
        n = pages_needed(c + k1, page_size)
        tables.append([free.pop() for _ in range(n + 1)])  # one spare page, never read
    tokens = torch.randint(0, 5000, (len(cache_lens), k1), generator=gen)
    tokens[:2] = 0
    kv_pages = 4
    inputs = GraphInputs(batch=len(cache_lens), num_draft=num_draft, kv_pages=kv_pages, page_size=page_size,
                         device=torch.device("cpu"))
    inputs.fill(tokens[:, 0].tolist(), tokens[:, 1:].tolist(), cache_lens, tables)
    inputs.upload()
    positions = torch.tensor([c + j for c in cache_lens for j in range(k1)])
    batch = ForwardBatch(tokens.reshape(-1), positions, tables, cache_lens, [k1] * len(cache_lens))
    meta = AttentionMetadata.build(batch, "cpu", page_size, kv_pages=kv_pages)
    t = inputs.tensors
    assert torch.equal(t["tokens"], batch.token_ids) and torch.equal(t["positions"], batch.positions)
    for name in ("write_index", "tok_visible", "page_table"):
        assert torch.equal(t[name], getattr(meta, name)), name
    assert torch.equal(t["cache_lens"], torch.tensor(cache_lens))
    assert (t["drafts"] is None) == (num_draft == 0)
    if num_draft:
        assert torch.equal(t["drafts"], tokens[:, 1:])
    mask = meta.mask.clone()
    meta.mask.zero_()
    inputs.refresh_mask(meta)
    assert torch.equal(meta.mask, mask)


def test_packed_graph_inputs_refuse_a_step_that_does_not_fit():
    from tpspec.runtime.graph_inputs import GraphInputs

    inputs = GraphInputs(batch=2, num_draft=1, kv_pages=2, page_size=16, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="needs 3 pages, the key holds 2"):
        inputs.fill([1, 2], [[3], [4]], [0, 31], [[0], [1, 2, 3]])
    with pytest.raises(ValueError, match="does not cover"):
        inputs.fill([1, 2], [[3], [4]], [0, 20], [[0], [1]])
    with pytest.raises(ValueError, match="expected 2 requests"):
        inputs.fill([1], [[3]], [0], [[0]])


# Continuous-batching runs for steps launched ahead: each request's parameters and budget, the
# request that stops on a stop token (at its token ``stop_at``), requests joining before a given call
# and requests aborted before a given call (indices into the list).
AHEAD_CASES = {
    "plain": dict(params=[SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7),
                          SamplingParams(temperature=0.0), SamplingParams(temperature=1.1, seed=3),
                          SamplingParams(temperature=0.0)],
                  budgets=[20, 17, 12, 20, 9], stopper=2, stop_at=6, joins={3: [4]}, aborts={6: [1]}),
    # Filtered rows that are always decided (top-k with top-p, top-k, min-p only), penalties and
    # logprobs: these go ahead. The top-p row without top-k (request 5, budget 5: it ends with the
    # step of call 4) keeps its batch from going ahead while it runs. The penalised request 2 stops
    # on a stop token in a step launched ahead (its row of the step launched after is dropped);
    # request 7 then takes its slot. Both join right after a request ended by its budget, when no
    # step is in flight, so that the graphed runs with and without steps ahead batch alike. The
    # negative frequency penalties reward a token by its count: the tiny model's tokens then depend
    # on every count (a token counted twice or not at all changes them; positive penalties rarely do).
    "controls": dict(params=[SamplingParams(**QWEN, seed=11),
                             SamplingParams(temperature=0.9, top_k=30, presence_penalty=0.4, frequency_penalty=-0.6,
                                            seed=12, logprobs=2),
                             SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=-0.6),
                             SamplingParams(temperature=1.0, min_p=0.2, seed=13),
                             SamplingParams(temperature=0.0, logprobs=5),
                             SamplingParams(temperature=1.0, top_p=0.9, seed=14),
                             SamplingParams(temperature=0.0, frequency_penalty=-0.6, logprobs=3),
                             SamplingParams(temperature=0.8, top_k=10, repetition_penalty=1.2, frequency_penalty=-0.6,
                                            seed=15, logprobs=1)],
                     budgets=[20, 18, 20, 16, 14, 5, 12, 6], stopper=2, stop_at=9, joins={5: [6], 14: [7]},
                     aborts={}),
    # Verification of n-gram drafts (3 a step), every request greedy: the drafts of a step launched
    # ahead come from the device. A penalised request with logprobs, one with logprobs, a stop
    # token inside a step launched ahead, one request aborted. Forced acceptance of 1.5 drafts a
    # step (the benchmarks' switch; its counts follow the steps, and no request joins a running
    # batch, so every run steps alike) makes each request emit 2 or 3 tokens a step, the drafts
    # among them: a draft computed wrongly on the device changes the tokens.
    "ngram": dict(params=[SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
                          SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=-0.6, logprobs=1),
                          SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)],
                  budgets=[30, 27, 30, 24, 20], stopper=1, stop_at=9, joins={0: [4]}, aborts={4: [0]},
                  spec=3, forced=1.5),
}


def _ahead_worker(rank, world, target, case):
    """The same continuous-batching run of ``AHEAD_CASES[case]``, eager, then graphed
    (``capture=False``) without and with steps launched ahead. Returns the three runs' tokens and
    logprobs per request, the keys of the steps that launched their successor ahead, the keys
    graphed, how many steps went ahead and were replayed, the stop token and how many drafts the
    last run kept."""
    from tpspec.mapping import Mapping
    from tpspec.runtime.config import EngineConfig, Request, SpeculativeConfig
    from tpspec.runtime.engine import Engine
    from tpspec.speculative.forced import ForcedAcceptanceWarning

    spec = AHEAD_CASES[case]
    drafts = spec.get("spec")
    cfg = EngineConfig(model_path=target, tp_size=world, device="cpu", dtype="float32", max_batch_size=8,
                       max_seq_len=64, max_num_tokens=64,
                       speculative=SpeculativeConfig("ngram", drafts) if drafts else None,
                       forced_acceptance_rate=spec.get("forced"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ForcedAcceptanceWarning)
        engine = Engine(cfg, Mapping(world, rank))
    cuda_graphs.STEP_AHEAD_WITH_DRAFTS = True
    stats = []  # the finished requests' stats of the last run

    def scenario(first_id: int, stop: tuple[int, ...]) -> tuple[dict, dict]:
        stats.clear()
        if engine.worker.forced_acceptance(engine.device) is not None:
            engine.worker.forced_acceptance(engine.device).counter.zero_()  # every run draws the same counts
        reqs = [Request(first_id + i, tuple(PROMPTS[i % len(PROMPTS)]), sp, n,
                        stop_token_ids=stop if i == spec["stopper"] else ())
                for i, (sp, n) in enumerate(zip(spec["params"], spec["budgets"], strict=True))]
        joining = {i for ids in spec["joins"].values() for i in ids}
        tokens: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
        logprobs: dict[int, list] = {i: [] for i in range(len(reqs))}
        engine.add_requests([r for i, r in enumerate(reqs) if i not in joining])
        calls = 0
        while engine.has_unfinished or calls <= max(spec["joins"]):
            engine.add_requests([reqs[i] for i in spec["joins"].get(calls, [])])  # joins a running batch
            engine.abort([first_id + i for i in spec["aborts"].get(calls, [])])
            for u in engine.step():
                tokens[u.request_id - first_id] += u.new_token_ids
                logprobs[u.request_id - first_id] += u.new_logprobs or []
                if u.stats is not None:
                    stats.append(u.stats)
            calls += 1
        return tokens, logprobs

    first, _ = scenario(0, ())
    stop = (first[spec["stopper"]][spec["stop_at"] - 1],)  # the stopping request stops there in every run below
    runs = [scenario(100, stop)]
    ahead_keys = []
    for ahead in (False, True):
        cuda_graphs.STEP_AHEAD = ahead  # this rank process's own module
        engine.graphs = graphs = GenerationGraphs(engine, capture=False)
        launch_next = graphs.launch_next

        def recording(launched, launch_next=launch_next):
            started = launch_next(launched)
            if started is not None:
                ahead_keys.append(launched.step.key)
            return started

        graphs.launch_next = recording
        advance = graphs._advance_with_drafts  # noqa: SLF001

        def refusing_syncs(*args, advance=advance):
            """The device work of a verification step launched ahead may not wait for the step before."""
            with refusing_host_syncs():
                advance(*args)

        graphs._advance_with_drafts = refusing_syncs  # noqa: SLF001
        runs.append(scenario(200 + 100 * ahead, stop))
    engine.graphs = None
    engine.close()
    kept = sum(sum(s.accepted_drafts_per_step) for s in stats)
    return runs, ahead_keys, list(graphs.graphs), graphs.num_ahead, graphs.num_replayed, stop, kept


def test_steps_launched_ahead_give_the_eager_tokens(models):
    """A graphed pure decode step launches the next one before its tokens reach the host (the
    next step's input tokens are its outputs, copied on the device). At TP = 1 and 2 (gloo: the
    ranks must take the same decisions), with greedy and seeded temperature-sampled requests, a
    stop token, a request joining a running batch and one aborted, every request gets the eager
    steps' tokens; a request that ends in a step launched one ahead loses nothing and gains nothing."""
    from tpspec.testing import run_ranks

    for world in (1, 2):
        results = run_ranks(_ahead_worker, world, models["target"], "plain", timeout_s=240)
        assert all(r == results[0] for r in results)
        ((eager, _), (graphed, _), (ahead, _)), _, _, num_ahead, num_replayed, stop, _ = results[0]
        assert ahead == eager and graphed == eager
        assert eager[2][-1] == stop[0] and len(eager[2]) == 6 and len(eager[0]) == 20
        assert 0 < len(eager[1]) < 17  # aborted mid-run
        assert num_ahead > num_replayed // 2  # most graphed steps went ahead


def test_steps_with_filters_penalties_and_logprobs_launched_ahead_give_the_eager_outputs(models):
    """Steps with top-k / min-p rows, penalties and logprobs go ahead too, at TP = 1 and 2: the
    penalised requests' tokens are counted on the device before the next step reads the counts (and
    not again by the host), the logprobs are copied out before the next replay overwrites them.
    Every request gets the eager steps' tokens, and the logprobs of the graphed steps without steps
    ahead exactly (the eager steps' within 1e-5: padding a batch to its bucket may move the logits'
    last bits). A step with a top-p row without top-k never goes ahead (its row may be undecided). A
    penalised request that stops on a stop token loses its row of the step launched after; the
    request that takes its slot next starts from clean counts."""
    from tpspec.testing import run_ranks

    for world in (1, 2):
        results = run_ranks(_ahead_worker, world, models["target"], "controls", timeout_s=240)
        assert all(r == results[0] for r in results)
        ((eager, eager_lp), (graphed, graphed_lp), (ahead, ahead_lp)), ahead_keys, keys, num_ahead, _, stop, _ = \
            results[0]
        assert ahead == eager and graphed == eager
        assert ahead_lp == graphed_lp  # exactly
        assert_logprobs_close(list(ahead_lp.values()), list(eager_lp.values()), abs_tol=1e-5)
        assert eager[2][-1] == stop[0] and len(eager[2]) == 9 and len(eager[5]) == 5
        assert [len(eager_lp[i]) for i in (1, 4, 6, 7)] == [18, 14, 12, 6]
        assert num_ahead == len(ahead_keys) >= 6
        assert not any(k.filters.any_top_p_total for k in ahead_keys)
        assert any(k.filters is not None and k.filters.any_top_p_total for k in keys)  # graphed, not ahead
        assert all(k.penalties and k.top_logprobs is not None and k.filters is not None for k in ahead_keys)
        assert any(k.filters.any_min_p_only for k in ahead_keys)


def test_verification_steps_launched_ahead_give_the_eager_outputs(models):
    """Greedy verification of n-gram drafts goes ahead (``STEP_AHEAD_WITH_DRAFTS``): the step
    after is launched before the host reads how many tokens each request emitted, with its cached
    lengths, last tokens and drafts computed on the device and no host sync on the way. At TP = 2
    (the ranks take the same decisions), with penalties, logprobs, a stop token inside a step
    launched ahead and a request aborted, and forced acceptance (the drafts become tokens): every
    request gets the eager steps' tokens (and the logprobs of the graphed steps without steps
    ahead, exactly), and most graphed steps went ahead."""
    from tpspec.testing import run_ranks

    results = run_ranks(_ahead_worker, 2, models["target"], "ngram", timeout_s=240)
    assert results[0] == results[1]
    ((eager, eager_lp), (graphed, graphed_lp), (ahead, ahead_lp)), ahead_keys, _, num_ahead, num_replayed, stop, \
        kept = results[0]
    assert ahead == eager and graphed == eager
    assert ahead_lp == graphed_lp
    assert_logprobs_close(list(ahead_lp.values()), list(eager_lp.values()), abs_tol=1e-5)
    assert eager[1][-1] == stop[0] and len(eager[1]) < 27 and 0 < len(eager[0]) < 30  # stopped, aborted
    assert kept > 0 and num_ahead >= num_replayed // 2
    assert any(k.penalties and k.top_logprobs is not None for k in ahead_keys)


@needs_triton
def test_advance_kernel_equals_the_torch_ops():
    """The Triton kernel of a verification step launched ahead (``cuda_graphs.ADVANCE_KERNEL``), under
    Triton's interpreter: the torch ops' history, inputs and drafts, over n-gram ranges 1..4, 1 to 4
    drafts, padding requests, clamped counts and failed rows (``tests/advance_cases.py``), and the
    strict-acceptance kernel (``worker.ACCEPT_KERNEL``) the values of ``accept_from_targets``; both
    compile for Hopper."""
    from tpspec.runtime import advance_triton

    run_interpreted("advance_cases.py", [], ("int32",))
    kernel = advance_triton._advance_kernel  # noqa: SLF001
    signature = {name: "*i64" for name in kernel.arg_names[:9]}
    signature.update(history_ptr="*i32", slots_ptr="*i64", num_padding="i32", vocab="i32", page_size="i32",
                     kv_pages="i32", history_width="i32")
    asm = compile_for_hopper(kernel, signature, dict(K1=4, K1_P2=4, MAX_N=3, MIN_N=1, BLOCK=1024),
                             aligned_pointers=True, enable_fp_fusion=False)
    assert "bar.sync" in asm["ptx"]  # the history's new tokens are visible to the whole program
    from tpspec.speculative import accept_triton

    kernel = accept_triton._accept_kernel  # noqa: SLF001
    accept = compile_for_hopper(kernel, {name: "*i64" for name in kernel.arg_names[:6]},
                                dict(D=3, D1_PAD=4, PAD=accept_triton.PAD_TOKEN), num_warps=1, enable_fp_fusion=False)
    assert "cubin" in accept
