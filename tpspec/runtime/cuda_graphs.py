"""CUDA graphs for generation steps (GPU only; the CPU path is always eager).

A pure generation step of plain TP — every request verifies K drafts, no context chunk —
has the same shapes every time once the batch is padded to a bucket size (1, 2, 4, then
multiples of 8 up to ``max_num_seqs``): ``Bp * (K + 1)`` tokens, and attention over page
tables of a bucketed width (the next power of two of the pages the longest request reads:
real lengths, never ``max_seq_len``; FlashInfer is planned on the host with the exact
lengths before each replay). One graph per :class:`StepKey` captures the target forward,
the penalties, the token selection (the exchange, whose device-side counters advance inside
the graph), the acceptance (strict, or rejection sampling on the shards, reading the sampled
drafts' logits from the ``DraftLogitsStore``), the logprobs of the emitted tokens and, for
EAGLE-3, the target hidden states the head reads next. Graphs are captured lazily, the
first time a key comes up.

The key holds every host fact the step's code paths read: the batch and page buckets, the
sampling kind (all greedy, temperature only, filtered), whether a request has penalties,
the :class:`~tpspec.sampling.select.FilterPlan` of filtered batches (which collectives the
draw runs and how many candidate keys a rank sends), the largest ``logprobs=N`` asked, and
whether sampled drafts' logits are read. All of it comes from the requests' parameters
(:func:`step_key`), so it is known before the step runs and equal on every rank.

Filtered rows whose candidates cannot decide them (a top-p row without top-k whose prefix
reaches past every rank's candidates — rare with ``4 * 64`` candidates a rank; under rejection
sampling the eager path's 64) are the one data-dependent case: the graph outputs a ``decided``
flag beside the tokens (equal on every rank: it comes from exchanged values), and when it is
False the host runs that step again eagerly — the same forward and the full selection, with
the retry and the gathered fallback. Draws are keyed by (seed, offset, column), each offset
by the output position the draw decides (``SpecMetadata.prepare`` filled them before the replay;
the repeat reads the same), and a forced-acceptance draw is rewound, so the repeated step gives
exactly the tokens an eager step gives.

Before a replay the host refreshes the static inputs in place: token ids, positions, drafts
and the attention metadata's index tensors are slices of one buffer (:class:`GraphInputs`),
filled on the host and copied at once; ``SpecMetadata.prepare`` refills its stable buffers.
Padding requests come first in the padded batch (the generation requests stay the step's
last requests, where drafting writes its draft logits), write into the engine's scratch
pages (nothing reads them for real) and use slot -1 in the metadata (greedy, no stream).
Steps with a request that has logit controls (structured outputs, logit bias, allowed tokens,
bad words: token masks and biases the host computes each step) run eagerly.

A graphed decode step without drafts launches the next step of its batch before its own tokens
reach the host (:data:`STEP_AHEAD`, :meth:`GenerationGraphs.launch_next`) unless its key can leave
a row undecided (a top-p row without top-k: ``FilterPlan.any_top_p_total``; the host reads
``decided`` first) or it outputs EAGLE-3 hidden states. Greedy, temperature-only and filtered rows
that are always decided (rows with top-k, whatever top-p or min-p beside it; min-p-only rows,
through the masked exchange) go ahead, with penalties and logprobs: the step's outputs (its tokens,
their number a row, their logprobs) are copied to pinned host memory on the stream, the tokens of
requests with penalties are counted into the engine's occurrence counts on the device (the host
then does not count them again), the next step's input tokens are copied from the outputs on the
device, and the next step's other inputs (positions, pages, noise positions) are known on the host.
The host then reads and commits a step's tokens while the GPU runs the next one. The engine goes
ahead only while the batch runs on unchanged (nothing waits or prefills, no request reaches its
budget, the pages are free); a request that stops on a stop token has a row in the step launched
after, whose tokens are dropped (neither committed nor counted).

A graphed verification step of n-gram drafts, every request greedy, goes ahead the same way
(:data:`STEP_AHEAD_WITH_DRAFTS`). How many tokens each request emits is known on the device only, so
the next step's inputs are filled as the step's own (with the pages of the most tokens it can emit) and
moved on there (:meth:`GraphInputs.advance`): each cached length grows by the request's count, the last
token is the last one emitted, and the drafts come from :meth:`NgramDrafter.draft_on_device` over the
requests' tokens, which live in ``GenerationGraphs.history`` (a row a slot: the host's tokens uploaded
once, then each step's emitted tokens written there on the device).

The drafting of a graphed step (a draft model or an EAGLE-3 head) runs its catch-up forward
eagerly — it reads what each request's draft cache lacks, a ragged count (the whole prompt
the first time, then 1 or 2 tokens for a draft model, 1 to K + 1 hidden-state rows for an
EAGLE-3 head) — and then draft steps 1 .. K-1, one token a request each, through graphs of
a :class:`DraftKey` (the step's key, sampled or greedy drafts), one per draft step (the
attention of each is planned on the host before its replay): the drafter's forward, the pick
(penalties, sampled drafts on the shards with the same deferred filtered draw) and the write
of the sampled drafts' logits into the ``DraftLogitsStore``. An undecided filtered row there
makes the engine draft that step eagerly instead.

Not graphed (eager): steps with a context chunk, steps with logit controls, attention DP, TP
groups on gloo, attention backends that cannot be captured, and the drafters' catch-up forwards.

Every rank takes the same decisions: whether a step is graphed, and its key, depend only on
the batch (replicated) and the configuration; a capture failure on any rank disables that
key on all ranks (one all-reduce at capture time), so the ranks never split between graph
and eager. A failure in the eager warm-up before a capture is an error of the step, raised
as such.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .. import distributed as D
from ..log import get_logger
from ..sampling.logprobs import logprob_dicts, step_logprobs
from ..sampling.params import SamplingParams
from ..sampling.select import DEFAULT_CANDIDATES, RETRY_FACTOR, FilterPlan, candidate_bucket
from ..vocab_parallel import MAX_TOP_LOGPROBS
from ..speculative.metadata import RequestEntry
from .graph_inputs import GraphInputs

log = get_logger(__name__)

GRAPHED_DRAFT_CHAIN = True
"""Whether a drafter's chained draft steps 2..K replay CUDA graphs (:meth:`GenerationGraphs.draft_chain`).
The chain's graphs read their static inputs at their capture-time addresses; :class:`_ChainGraph` holds
every one of them (the logits rows included) for as long as the graphs live, and
tests/test_runtime_graphs.py replays the chain on CPU from weak references to its inputs, to the eager
chain's tokens. On: a GPU run of tests/test_runtime_seeded_spec.py's CUDA test (a draft model, a mixed
batch) and tests/test_runtime_gpu.py passed with it. Off, the chain runs eagerly after the graphed
target step's planning, with the same drafts."""
WARMUP_RUNS = 2
STEP_AHEAD = True
"""Whether a graphed pure decode step (no drafts) launches the next step of its batch before its own
tokens reach the host (:meth:`GenerationGraphs.launch_next`), so that the host's bookkeeping overlaps
the GPU. Steps whose every row is always decided go ahead, penalties and logprobs included; steps with
a top-p row without top-k, or with EAGLE-3 hidden states, do not (:meth:`GenerationGraphs.can_launch_next`)."""
ADVANCE_KERNEL = True
"""Whether a verification step launched ahead moves its inputs on by one Triton kernel
(:mod:`tpspec.runtime.advance_triton`) on CUDA instead of some sixty small torch kernels (the same
values: tests/test_runtime_graphs.py under Triton's interpreter, tests/test_runtime_gpu.py on an H100)."""
STEP_AHEAD_WITH_DRAFTS = True
"""Whether a graphed verification step of n-gram drafts, every request greedy, launches the next one
ahead too (:data:`STEP_AHEAD` on as well): the next step's cached lengths, last tokens and drafts then
come from the device (:meth:`GraphInputs.advance`, :meth:`NgramDrafter.draft_on_device`). Tested on CPU
(tests/test_runtime_graphs.py) and on an H100 (tests/test_runtime_gpu.py)."""


def page_bucket(pages: int) -> int:
    """Page-table width of a graph whose longest request reads ``pages`` pages: the next power of two."""
    return 1 << max(0, pages - 1).bit_length()


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to ``max_batch_size`` (always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


@dataclass(frozen=True)
class StepKey:
    """What one captured generation step is captured for (the host facts its code reads).

    ``batch``: the padded batch (a bucket); ``kv_pages``: the page-table width; ``sampling``:
    ``"greedy"``, ``"temperature"`` or ``"filtered"`` (some sampled request has top-k, top-p or
    min-p); ``penalties``: some request has penalties; ``filters``: the filtered draw's plan
    (None unless filtered); ``top_logprobs``: the top logprobs computed, at least the largest
    ``logprobs=N`` asked (None: no request asks); ``draft_logits``: rejection sampling reads the sampled drafts' logits;
    ``hidden_states``: the target's EAGLE-3 hidden states come out of the step.
    """

    batch: int
    kv_pages: int
    sampling: str
    penalties: bool = False
    filters: FilterPlan | None = None
    top_logprobs: int | None = None
    draft_logits: bool = False
    hidden_states: bool = False


def step_key(params: Sequence[SamplingParams], *, batch: int, kv_pages: int, acceptance: str, vocab_size: int,
             draft_logits: bool = False, hidden_states: bool = False) -> StepKey:
    """The :class:`StepKey` of a generation step whose requests have these ``params`` (padding
    requests excluded; they are greedy). ``acceptance``: ``"strict"`` or ``"rejection"``. The
    filter plan sends ``candidate_bucket`` of the largest top-k; under rejection sampling that is
    the eager path's count (it decides which rows are verified on the shards), under strict
    acceptance a batch with a top-p row without top-k sends ``RETRY_FACTOR`` times the default at
    once (every decided row gets the same token whatever the count, and fewer steps are
    repeated). ``top_logprobs``: the largest ``logprobs=N`` rounded up to a power of two (at most
    20). Counts are rounded so that few graphs serve many parameter mixes. A pure function of
    its arguments."""
    if all(p.is_greedy for p in params):
        sampling = "greedy"
    elif all(p.is_temperature_only for p in params):
        sampling = "temperature"
    else:
        sampling = "filtered"
    filters = None
    if sampling == "filtered":
        filters = FilterPlan.of_params([p.normalized() for p in params], vocab_size)
        count = candidate_bucket(filters.candidates)
        if acceptance == "strict" and filters.any_top_p_total:
            count = max(count, DEFAULT_CANDIDATES * RETRY_FACTOR)
        filters = dataclasses.replace(filters, candidates=count)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    top_logprobs = None
    if asked:  # a power of two (at most 20): each request reads its own N of the sorted top
        top_logprobs = 0 if max(asked) == 0 else min(MAX_TOP_LOGPROBS, 1 << (max(asked) - 1).bit_length())
    return StepKey(batch=batch, kv_pages=kv_pages, sampling=sampling, penalties=any(p.has_penalties for p in params),
                   filters=filters, top_logprobs=top_logprobs, draft_logits=draft_logits and sampling != "greedy",
                   hidden_states=hidden_states)


@dataclass(frozen=True)
class GraphStep:
    """One generation step as a graph runs it: its ``key``, the padded ``requests`` in the
    order ``SpecMetadata.prepare`` takes them (``num_padding`` padding requests first)."""

    key: StepKey
    requests: list[RequestEntry]
    num_padding: int


@dataclass
class StepResult:
    """What a graphed step gives the engine: ``emitted`` ``{seq index: tokens}`` and, for
    EAGLE-3, ``hidden`` ``[len(gen) * (K + 1), width]`` (the generation requests' rows of the
    target hidden states, a copy); ``counted``: the tokens of its requests with penalties were
    counted into the engine's occurrence counts on the device (the engine must not count them again)."""

    emitted: dict[int, list[int]]
    hidden: torch.Tensor | None = None
    counted: bool = False  # the penalised requests' tokens are already in the occurrence counts (device)


@dataclass
class _StepOut:
    """The device outputs of one step (a graph's static outputs)."""

    accepted: torch.Tensor  # [Bp, K + 1] int64
    num: torch.Tensor  # [Bp] int64
    decided: torch.Tensor | None  # 0-dim bool, or None when the step is always decided
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # see step_logprobs
    hidden: torch.Tensor | None  # [Bp * (K + 1), width] EAGLE-3 hidden states

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.accepted, self.num, self.decided, *(self.logprobs or (None,) * 3), self.hidden]


@dataclass(frozen=True)
class DraftKey:
    """What a captured drafting chain (draft steps 1 .. K-1) is captured for: the ``step`` key of
    the generation step it drafts for (batch and page buckets, the requests' sampling facts) and
    whether its drafts are sampled (``SpecMetadata`` prepared before drafting) or greedy."""

    step: StepKey
    sampled: bool


@dataclass
class _ChainStepOut:
    """The device outputs of one chained draft step: its picks ``[Bp]``, the EAGLE-3 head's row
    outputs ``[Bp, H]`` (None for a draft model) and ``decided``."""

    tokens: torch.Tensor
    hidden: torch.Tensor | None
    decided: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.tokens, self.hidden, self.decided]


@dataclass
class _ChainGraph:
    """Draft steps 1 .. K-1 of one :class:`DraftKey`: one graph each (a backend plans each step's
    attention on the host before its replay), each reading the previous one's static outputs.
    A graph reads its inputs at their capture-time addresses and keeps none of them alive: every
    tensor the chain's graphs read is held here (or by the engine: its metadata's buffers)."""

    graphs: list[Any]
    outs: list[_ChainStepOut]
    first: torch.Tensor  # [Bp] int64: the catch-up forward's picks
    positions: list[torch.Tensor]  # K - 1 of [Bp] int64
    metas: list[Any]  # K - 1 attention metadata
    hidden: torch.Tensor | None  # [Bp, H]: the EAGLE-3 head's last catch-up outputs
    rows: torch.Tensor  # [Bp] int64: the logits rows of every step (0 .. Bp - 1)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph, or an _EagerReplay
    inputs: GraphInputs  # the static inputs: tokens, positions, drafts, the metadata's index tensors
    attn_meta: Any
    out: _StepOut
    batch: Any = None  # the static ForwardBatch, kept alive with the graph
    host_out: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned copies of accepted and num (made on first use)
    host_logprobs: tuple[torch.Tensor, ...] | None = None  # pinned copies of the logprobs outputs (made on first use)
    copied: Any = None  # the CUDA event after the last copy into them (None on CPU)


@dataclass
class Launched:
    """A generation step started by :meth:`GenerationGraphs.launch` or
    :meth:`~GenerationGraphs.launch_next` whose tokens have not been read yet."""

    step: GraphStep
    gen: list[Any]
    drafts: list[list[int]]
    graph: _Graph | None  # None: it ran eagerly (its key failed to capture)
    out: _StepOut
    host: tuple[torch.Tensor, torch.Tensor] | None = None  # accepted and num, copied to the host
    host_logprobs: tuple[torch.Tensor, ...] | None = None  # the logprobs outputs, copied to the host
    copied: Any = None  # the CUDA event after that copy (None on CPU)
    counted: bool = False  # its penalised requests' tokens were counted on the device (launch_next)
    drafted: bool = False  # its emitted tokens were written into the device history (launch_next, drafts)

    def copy_to_host(self) -> None:
        """Copy the accepted tokens, their counts and the logprobs outputs (when the key has them)
        into its graph's pinned host buffers, on the stream (before a later replay of the graph
        overwrites them)."""
        graph = self.graph
        pin = self.out.accepted.is_cuda

        def host_like(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors)

        if graph.host_out is None:
            graph.host_out = host_like((self.out.accepted, self.out.num))
            graph.copied = torch.cuda.Event() if pin else None
        pairs = list(zip(graph.host_out, (self.out.accepted, self.out.num)))
        if self.out.logprobs is not None:
            if graph.host_logprobs is None:
                graph.host_logprobs = host_like(self.out.logprobs)
            pairs += zip(graph.host_logprobs, self.out.logprobs)
            self.host_logprobs = graph.host_logprobs
        for host, device in pairs:
            host.copy_(device, non_blocking=True)
        if graph.copied is not None:
            graph.copied.record()
        self.host, self.copied = graph.host_out, graph.copied


class _EagerReplay:
    """Stands in for a captured graph where CUDA graphs do not run (``GenerationGraphs(...,
    capture=False)``: the CPU tests of this module): :meth:`replay` runs the very step function a
    graph captures, on the same static inputs, and copies its outputs into the first run's
    tensors, as a replay refreshes a graph's outputs."""

    def __init__(self, step: Callable[[bool], Any]) -> None:
        self.step = step
        self.out = step(True)  # as a warm-up: no forced acceptance drawn

    def replay(self) -> None:
        fresh = self.step(False)
        for static, new in zip(self.out.tensors(), fresh.tensors()):
            if static is not None:
                static.copy_(new)


class GenerationGraphs:
    """Captured generation steps of one :class:`~tpspec.runtime.engine.Engine`.

    ``capture=False`` runs every step through the same padded batches, keys and step function
    without CUDA graphs (:class:`_EagerReplay`): how the CPU tests check the graphed path.
    """

    def __init__(self, engine: Any, *, capture: bool = True) -> None:
        self.engine = engine
        self.capture = capture
        self.buckets = bucket_sizes(engine.config.max_batch_size)
        self.graphs: dict[StepKey, _Graph] = {}
        self.draft_graphs: dict[DraftKey, _ChainGraph] = {}
        self.failed: set[StepKey | DraftKey] = set()
        self.num_repeated = 0  # steps run again eagerly because a filtered row was undecided
        self.num_replayed = 0  # target steps whose tokens came from a graph replay
        self.num_ahead = 0  # of those, steps launched before the previous one's tokens were read
        self.history: torch.Tensor | None = None  # the requests' tokens on the device (n-gram drafts ahead)
        self.history_len: dict[int, tuple[int, int]] = {}  # slot -> (sequence index, its tokens in history)
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    @classmethod
    def maybe_create(cls, engine: Any) -> "GenerationGraphs | None":
        """Graphs for ``engine`` when they apply (see :func:`graphs_unavailable_reason`), else
        None (eager steps; rank 0 warns once with the reason)."""
        reason = graphs_unavailable_reason(engine)
        if reason is not None:
            if engine.device.type == "cuda" and D.group_rank(engine.group) == 0:
                warnings.warn(f"CUDA graphs are off for this engine: {reason}", RuntimeWarning, stacklevel=2)
            return None
        return cls(engine)

    def close(self) -> None:
        self.graphs.clear()
        self.draft_graphs.clear()

    # ------------------------------------------------------------------ per step
    def plan(self, gen: list[Any], *, ahead: int = 0) -> GraphStep | None:
        """How the pure generation step of ``gen`` (the engine's sequences) runs through a graph,
        or None when it does not (more requests than the largest bucket, or its key failed to
        capture): the caller runs it eagerly. The same answer on every rank. ``ahead``: tokens
        each sequence has in flight (a step planned before the previous one's tokens arrive)."""
        b = len(gen)
        padded = next((s for s in self.buckets if s >= b), None)
        if padded is None or b == 0:
            return None
        if any(s.req.sampling.has_logit_controls for s in gen):
            return None  # logit controls: token masks and biases the host computes each step, eager
        eng = self.engine
        k = eng.num_draft
        params = [s.req.sampling for s in gen]
        key = step_key(params, batch=padded,
                       kv_pages=page_bucket(max(eng.pages.pages_for(len(s.tokens) + ahead + k) for s in gen)),
                       acceptance=eng.worker.acceptance, vocab_size=eng.model.lm_head.vocab_size,
                       draft_logits=eng.draft_store is not None and any(not p.is_greedy for p in params),
                       hidden_states=eng.eagle3 is not None)
        if key in self.failed:
            return None
        reqs = [RequestEntry(-1 - i, -1) for i in range(padded - b)]
        reqs += [s.entry(False, ahead=ahead) for s in gen]
        return GraphStep(key, reqs, padded - b)

    def launch(self, step: GraphStep, gen: list[Any], drafts: list[list[int]], *, prepared: bool = False,
               drafts_sampled: bool = False) -> Launched:
        """Start the planned step: replay its graph (capturing it first when its key is new), or run
        it eagerly when the capture failed. ``prepared``: the engine already prepared
        ``SpecMetadata`` with ``step.requests`` (before drafting); ``drafts_sampled``: the drafts
        were sampled and their logits wait in the store. :meth:`collect` gives its tokens."""
        eng = self.engine
        key = step.key
        if not prepared:
            eng.meta.prepare(requests=step.requests, draft_len=eng.num_draft)
        _check_key(key, eng.meta, drafts_sampled)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, self._host_batch(gen, drafts, step.num_padding))
        if graph is None:  # the capture failed on some rank: this key runs eagerly from now on
            return Launched(step, gen, drafts, None, self._eager(key, self._host_batch(gen, drafts, step.num_padding)))
        self._load(graph, gen, drafts, step.num_padding)
        graph.graph.replay()
        return Launched(step, gen, drafts, graph, graph.out)

    def can_launch_next(self, launched: Launched) -> bool:
        """Whether the step after ``launched`` may start before ``launched``'s tokens reach the
        host (:data:`STEP_AHEAD`): ``launched`` replayed a graph (no attention planned on the host,
        no attention DP) whose every row is decided on the device and that outputs no EAGLE-3
        hidden states. Without drafts: greedy, temperature-only or filtered rows, but no top-p row
        without top-k (``FilterPlan.any_top_p_total``: such a row may be undecided, and the host
        must read ``decided`` before the step's tokens are used); penalties and logprobs may go
        ahead (:meth:`launch_next` counts the tokens on the device and copies the logprobs out).
        With drafts (:data:`STEP_AHEAD_WITH_DRAFTS`): n-gram drafts (drafted on the device from the
        tokens in flight) of all-greedy batches, penalties and logprobs included: how many tokens a
        request emits is known on the device only, and a greedy row's selection does not depend on
        its output position. A function of the key and the configuration: the same answer on every
        rank. The engine decides whether its batch runs on unchanged."""
        eng = self.engine
        key = launched.step.key
        if not STEP_AHEAD or launched.graph is None or eng.dp_size > 1:
            return False
        if key.hidden_states or (key.filters is not None and key.filters.any_top_p_total):
            return False  # the head reads the hidden states, or an undecided row repeats the step
        if eng.num_draft and not (STEP_AHEAD_WITH_DRAFTS and eng.ngram is not None and key.sampling == "greedy"
                                  and not key.draft_logits):
            return False
        return not eng.model.attention.plans_on_host

    def launch_next(self, launched: Launched) -> Launched | None:
        """Start the next step of ``launched``'s batch (:meth:`can_launch_next` said it may; the
        engine checked that the batch runs on and gave its pages room for the most tokens
        ``launched`` can emit and the next step's) when its key is captured. Its input tokens are
        ``launched``'s outputs, copied on the device; ``launched``'s outputs (logprobs included)
        are copied to the host first (a replay of the same graph overwrites them), and the tokens
        of its requests with penalties are counted into the engine's occurrence counts on the
        device before the replay, which reads them (``launched`` is then marked ``counted``: the
        engine does not count them again when it commits them). With drafts, each request's
        cached length and last token follow from the number of tokens it emitted, and its drafts
        come from the n-gram drafter on the device, over the request's tokens there
        (:meth:`_advance_with_drafts`). Returns the new step, or None (nothing started, nothing
        counted). The same answer on every rank."""
        eng = self.engine
        gen = launched.gen
        k = eng.num_draft
        # The most tokens in flight: the page width covers them (positions matter only to sampled
        # rows, which go ahead with drafts never).
        step = self.plan(gen, ahead=k + 1)
        if step is None or step.key not in self.graphs or step.num_padding != launched.step.num_padding:
            return None
        graph = self.graphs[step.key]
        eng.meta.prepare(requests=step.requests, draft_len=k)
        _check_key(step.key, eng.meta, False)
        launched.copy_to_host()
        # Only requests with penalties: their slots' counts were reset when they started; other
        # slots' counts may be stale and are never read.
        penalised = [s.slot if s.req.sampling.has_penalties else -1 for s in gen]
        if any(slot >= 0 for slot in penalised):
            self._count_on_device(launched, [-1] * launched.step.num_padding + penalised)
        # The in-flight tokens, clamped: a failed exchange marks its rows -1 (raised at collect).
        vocab = eng.model.lm_head.vocab_size
        accepted = launched.out.accepted.clamp(0, vocab - 1)
        if k:
            # Filled as ``launched``'s own inputs (the host knows no more), with the pages of the
            # most tokens it can emit; then moved on by what it emitted, on the device.
            self._load(graph, gen, [[0] * k for _ in gen], step.num_padding, reserve=k + 1)
            self._advance_with_drafts(launched, graph.inputs, accepted)
        else:
            self._load(graph, gen, [[] for _ in gen], step.num_padding, ahead=1)
            graph.inputs.tensors["tokens"].copy_(accepted[:, 0])
        graph.graph.replay()
        self.num_ahead += 1
        return Launched(step, gen, [[0] * k for _ in gen], graph, graph.out)

    def _advance_with_drafts(self, launched: Launched, inputs: GraphInputs, accepted: torch.Tensor) -> None:
        """:meth:`GraphInputs.advance` of ``inputs`` (filled as ``launched``'s own inputs) by
        ``launched``'s emitted tokens, with the n-gram drafter's drafts over each request's tokens on
        the device.

        The requests' tokens live in ``history`` ``[max_num_seqs + 1, max_seq_len]`` (int32; a row
        per slot, the last one for padding). Here it takes the committed tokens it lacks (the host's,
        uploaded: a request's whole history the first time) and then ``launched``'s emitted tokens at
        their positions, on the device (``launched`` is marked ``drafted``: :meth:`collect` then
        counts them as there). On CUDA with :data:`ADVANCE_KERNEL` one Triton kernel does it all
        (:mod:`advance_triton`), else torch ops: the same values."""
        eng = self.engine
        dev = eng.device
        gen, pad = launched.gen, launched.step.num_padding
        longest = eng.config.max_seq_len
        if self.history is None:
            self.history = torch.zeros(eng.config.max_batch_size + 1, longest, dtype=torch.int32, device=dev)
        rows, cols, values = [], [], []
        for s in gen:
            index, count = self.history_len.get(s.slot, (None, 0))
            have = count if index == s.index else 0
            rows += [s.slot] * (len(s.tokens) - have)
            cols += range(have, len(s.tokens))
            values += s.tokens[have:]
            self.history_len[s.slot] = (s.index, len(s.tokens))
        pin = dev.type == "cuda"
        if rows:
            upload = torch.tensor([rows, cols, values], dtype=torch.int64, pin_memory=pin).to(dev, non_blocking=True)
            self.history[upload[0], upload[1]] = upload[2].to(torch.int32)
        slots = [eng.config.max_batch_size] * pad + [s.slot for s in gen]
        slot_rows = torch.tensor(slots, dtype=torch.int64, pin_memory=pin).to(dev, non_blocking=True)
        launched.drafted = True
        if ADVANCE_KERNEL and dev.type == "cuda":
            from . import advance_triton

            advance_triton.advance(inputs, accepted, launched.out.num, pad, self.history, slot_rows,
                                   eng.ngram, eng.model.lm_head.vocab_size)
            return
        inputs.advance(accepted, launched.out.num, pad, self.history, slot_rows, eng.ngram)

    def collect(self, launched: Launched) -> StepResult:
        """Wait for ``launched`` and give its tokens: per request still running, the tokens it
        emitted (a request that finished or left since the launch gets none); repeat it eagerly when
        a filtered row was undecided. Sets the step's logprobs on the sequences that ask."""
        eng = self.engine
        key, gen, out = launched.step.key, launched.gen, launched.out
        logprobs = None  # the host copies of the logprobs outputs, when made
        if launched.host is not None:  # copied out before a later step was launched
            if launched.copied is not None:
                launched.copied.synchronize()
            accepted, num = launched.host
            logprobs = launched.host_logprobs
        else:
            accepted, num = out.accepted.cpu(), out.num.cpu()  # synchronizes with the replay
        # A step copied out went ahead: can_launch_next admitted only keys whose rows are all decided.
        if out.decided is not None and launched.host is None and not bool(out.decided.cpu()):
            # A filtered row the candidates could not decide (the same verdict on every rank): the
            # step again, eagerly, with the retry and the gathered fallback.
            self.num_repeated += 1
            out = self._eager(key, self._host_batch(gen, launched.drafts, launched.step.num_padding), repeat=True)
            accepted, num = out.accepted.cpu(), out.num.cpu()
        elif launched.graph is not None:
            self.num_replayed += 1
            rows = len(gen) * (eng.num_draft + 1)  # the real rows, all drawn on the shards
            eng.worker.sampling_stats.rows_sharded += rows
        # A replay calls no Python: a peer timeout inside it is only recorded on the device
        # (its rows read -1). Raise it now, before those tokens reach a request.
        if eng.exchange is not None:  # None: the LM head is not vocabulary-sharded, nothing exchanged
            eng.exchange.check(sync=False)
        result = self._result(gen, launched.step.num_padding, out, accepted, num, logprobs)
        result.counted = launched.counted
        if launched.drafted:  # its emitted tokens are in the device history
            for seq in gen:
                index, count = self.history_len.get(seq.slot, (None, 0))
                if index == seq.index:
                    self.history_len[seq.slot] = (index, count + len(result.emitted.get(seq.index, ())))
        return result

    def draft_chain(self, step: GraphStep, first: torch.Tensor, ends: list[int], tables: list[list[int]],
                    hidden: torch.Tensor | None, *, sampled: bool) -> torch.Tensor | None:
        """Draft steps 1 .. K-1 of the graphed step ``step`` through graphs (the engine's
        ``draft_chain_step`` on the padded batch, padding rows first in scratch pages): the
        ``[len(first), K]`` drafts, ``first`` (the catch-up forward's picks ``[B]``) included; or
        None when the chain runs eagerly instead (its capture failed, or a sampled filtered row was
        undecided: the same verdict on every rank). ``ends``: each request's first chained
        position; ``hidden``: the EAGLE-3 head's catch-up outputs ``[B, H]`` (None for a draft
        model); ``sampled``: the drafts are sampled (the metadata was prepared before drafting)."""
        eng = self.engine
        key = DraftKey(step.key, sampled)
        if not GRAPHED_DRAFT_CHAIN or key in self.failed or not self._drafter().attention.supports_graphs:
            return None
        pad = step.num_padding
        ends_p = [1] * pad + list(ends)  # padding rows chain at positions 1 .. K - 1 of the scratch pages
        tables_p = [eng.scratch_table] * pad + list(tables)
        dev = eng.device
        first_p = torch.cat([torch.zeros(pad, dtype=torch.int64, device=dev), first.to(torch.int64)])
        hidden_p = None
        if hidden is not None:
            hidden_p = torch.cat([torch.zeros(pad, hidden.shape[1], dtype=hidden.dtype, device=dev), hidden])
        positions, metas = self._chain_inputs(step.key, ends_p, tables_p)
        chain = self.draft_graphs.get(key)
        if chain is None:
            # Captured step by step, each replayed before the next is captured (its outputs are the
            # next step's inputs): this step's drafting happens on the way.
            chain = self._capture_chain(key, first_p, positions, metas, hidden_p, ends_p, tables_p)
            if chain is None:
                return None
        else:
            chain.first.copy_(first_p)
            if hidden_p is not None:
                chain.hidden.copy_(hidden_p)
            for static, new in zip(chain.positions, positions):
                static.copy_(new, non_blocking=True)
            for graph, static, new in zip(chain.graphs, chain.metas, metas):
                static.copy_(new)
                self._drafter().attention.plan(static, graph=True)
                graph.replay()
        decided = [o.decided for o in chain.outs if o.decided is not None]
        if decided and not bool(torch.stack(decided).all().cpu()):
            self.num_repeated += 1
            return None  # the engine drafts this step eagerly: the same drafts as an eager step
        return torch.stack([first.to(torch.int64)] + [o.tokens[pad:] for o in chain.outs], dim=1)

    # ------------------------------------------------------------------ helpers
    def _drafter(self) -> Any:
        eng = self.engine
        return eng.eagle3 if eng.eagle3 is not None else eng.draft_model

    def _chain_inputs(self, key: StepKey, ends: list[int], tables: list[list[int]]) -> tuple[list, list]:
        """Each chained draft step's positions ``[Bp]`` (on the device) and attention metadata, its
        page table as wide as the step key's (the chain reads fewer pages than the verification)."""
        from ..model.batch import ForwardBatch

        drafter, dev = self._drafter(), self.engine.device
        positions, metas = [], []
        for j in range(1, self.engine.num_draft):
            at = [e + j - 1 for e in ends]
            pos = torch.tensor(at, dtype=torch.int64)
            batch = ForwardBatch(token_ids=torch.zeros(len(at), dtype=torch.int64), positions=pos,
                                 block_tables=tables, cache_lens=at, query_lens=[1] * len(at))
            positions.append(pos.to(dev))
            metas.append(drafter.build_metadata(batch, kv_pages=key.kv_pages))
        return positions, metas

    def _capture_chain(self, key: DraftKey, first: torch.Tensor, positions: list, metas: list,
                       hidden: torch.Tensor | None, ends: list[int], tables: list[list[int]]) -> _ChainGraph | None:
        eng = self.engine
        drafter = self._drafter()
        rows = torch.arange(first.shape[0], dtype=torch.int64, device=eng.device)
        slots = eng.meta.slot_ids if key.sampled else [-1] * first.shape[0]
        filters = key.step.filters
        if filters is not None and filters.any_top_p_total:  # as for strict acceptance: fewer repeats
            filters = dataclasses.replace(filters, candidates=max(filters.candidates,
                                                                  DEFAULT_CANDIDATES * RETRY_FACTOR))
        graphs, outs, drafts, last_hidden = [], [], [first], hidden
        for j in range(1, eng.num_draft):
            def step(is_warmup: bool, j: int = j, chain: tuple = tuple(drafts),
                     hid: torch.Tensor | None = last_hidden) -> _ChainStepOut:
                return _ChainStepOut(*eng.draft_chain_step(j, list(chain), ends, tables, slots, hid,
                                                           position=positions[j - 1], meta=metas[j - 1],
                                                           logits_rows=rows, deferred=True, filter_plan=filters))

            drafter.attention.plan(metas[j - 1], graph=True)
            recorded = self._record(key, step)
            if recorded is None:
                return None
            graph, out = recorded
            graph.replay()  # this step, for real: the next capture reads its outputs
            graphs.append(graph)
            outs.append(out)
            drafts.append(out.tokens)
            last_hidden = out.hidden
        chain = _ChainGraph(graphs, outs, first, positions, metas, hidden, rows)
        self.draft_graphs[key] = chain
        if D.group_rank(eng.group) == 0:
            log.info("captured CUDA graphs of draft steps 1..%d: batch bucket %d, sampled %s", eng.num_draft - 1,
                     key.step.batch, key.sampled)
        return chain

    def _count_on_device(self, launched: Launched, slots: list[int]) -> None:
        """Count ``launched``'s emitted tokens (the first ``num`` of each row) into the engine's
        occurrence counts as output of ``slots`` (one a row of the padded batch, -1: not counted),
        on the device, in stream order after the step and before the next replay of its graph, and
        without a host sync. Marks ``launched`` as ``counted``."""
        out = launched.out
        dev = out.accepted.device
        slot_ids = torch.tensor(slots, dtype=torch.int64, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)
        self.engine.occurrences.add(slot_ids, out.accepted, out.num)
        launched.counted = True

    def _result(self, gen: list[Any], num_padding: int, out: _StepOut, accepted: torch.Tensor,
                num_all: torch.Tensor, logprobs: Sequence[torch.Tensor] | None = None) -> StepResult:
        """The step's :class:`StepResult` from its host tokens ``accepted`` / ``num_all`` (padded
        batch); sets ``step_logprobs`` of the requests that ask, from ``logprobs`` (host copies of
        ``out.logprobs``) or else from ``out.logprobs`` (read now)."""
        real = slice(num_padding, num_padding + len(gen))
        acc = accepted[real]
        num = num_all[real]
        alive = self.engine._by_index
        emitted = {s.index: [int(t) for t in row[: int(n)]] for s, row, n in zip(gen, acc.tolist(), num.tolist())
                   if not s.finished and alive.get(s.index) is s}
        asking = [i for i, s in enumerate(gen) if s.logprobs is not None]
        if asking:
            pick = torch.tensor(asking, dtype=torch.int64) + num_padding
            host = logprobs if logprobs is not None else [t.cpu() for t in out.logprobs]
            token_lp, top_ids, top_lp, ranks = (t[pick] for t in host)
            found = logprob_dicts(token_lp, top_ids, top_lp, ranks, accepted[pick], num_all[pick],
                                  [gen[i].req.sampling.logprobs for i in asking])
            for i, lp in zip(asking, found):
                gen[i].step_logprobs = lp
        hidden = None
        if out.hidden is not None:
            width = self.engine.num_draft + 1
            hidden = out.hidden[num_padding * width:(num_padding + len(gen)) * width].clone()
        return StepResult(emitted, hidden)

    def _input_rows(self, gen: list[Any], drafts: list[list[int]], num_padding: int,
                    ahead: int = 0) -> tuple[list, list, list, list]:
        """Per request of the padded batch (padding first): its last committed token, its drafts,
        its cached length and its pages, as :meth:`GraphInputs.fill` takes them. ``ahead``: one
        token in flight a request (its value comes on the device: 0 stands in for it here)."""
        eng = self.engine
        pad = num_padding
        last = [0] * len(gen) if ahead else [s.tokens[-1] for s in gen]
        return ([0] * pad + last, [[0] * eng.num_draft] * pad + list(drafts),
                [0] * pad + [len(s.tokens) - 1 + ahead for s in gen], [eng.scratch_table] * pad + [s.pages for s in gen])

    def _host_batch(self, gen: list[Any], drafts: list[list[int]], num_padding: int) -> Any:
        """The padded step as a host ``ForwardBatch`` and drafts ``[Bp, K]`` (None without drafts):
        what a capture, an eager step and a backend that plans on the host start from."""
        from ..model.batch import ForwardBatch

        k = self.engine.num_draft
        tokens, positions, tables, cache_lens = [], [], [], []
        for _ in range(num_padding):
            tokens += [0] * (k + 1)
            positions += list(range(k + 1))
            tables.append(self.engine.scratch_table)
            cache_lens.append(0)
        for seq, d in zip(gen, drafts):
            last = len(seq.tokens) - 1
            tokens += [seq.tokens[-1]] + list(d)
            positions += list(range(last, last + k + 1))
            tables.append(seq.pages)
            cache_lens.append(last)
        n = len(tokens)
        dev = self.engine.device
        batch = ForwardBatch(
            token_ids=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            block_tables=tables, cache_lens=cache_lens, query_lens=[k + 1] * len(tables),
            logits_rows=torch.arange(n, dtype=torch.int64, device=dev),
        )
        draft_table = None
        if k:
            rows = [[0] * k for _ in range(num_padding)] + [list(d) for d in drafts]
            draft_table = torch.tensor(rows, dtype=torch.int64)
        return batch, draft_table

    def _attn_meta(self, batch: Any) -> Any:
        """The step's attention metadata, its page table ``page_bucket`` wide (the graph key's)."""
        from ..model.batch import pages_needed

        model = self.engine.model
        longest = max(pages_needed(n, model.page_size) for n in batch.kv_lens)
        return model.build_metadata(batch, kv_pages=page_bucket(longest))

    def _plan_attention(self, meta: Any) -> None:
        """Host-side planning of a graphed step's attention (FlashInfer), before capture and replay."""
        self.engine.model.attention.plan(meta, graph=True)

    def _forward_and_select(self, key: StepKey, batch: Any, attn_meta: Any, drafts: torch.Tensor | None, *,
                            deferred: bool, is_warmup: bool = False, repeat: bool = False) -> _StepOut:
        """The step function a graph captures: target forward, then ``SpecWorker.step`` (penalties,
        selection, strict acceptance or rejection sampling on the shards, forced acceptance when
        the benchmark asks for it), the emitted tokens' logprobs and the EAGLE-3 hidden states, as
        the key says. ``deferred``: no host sync (a graph); else the eager step, whose selection
        retries and gathers undecided rows itself."""
        eng = self.engine
        k = eng.num_draft
        logits = eng.model(batch, attn_meta)
        draft_logits = eng.draft_store.read(eng.meta.slot_ids, k, check=False) if key.draft_logits else None
        out = eng.worker.step(logits, drafts, eng.meta, draft_logits=draft_logits, is_warmup=is_warmup,
                              deferred=deferred, filter_plan=key.filters, repeat=repeat)
        logprobs = None
        if key.top_logprobs is not None:
            logprobs = step_logprobs(logits, eng.meta.request_row_index, out.accepted_tokens, key.top_logprobs)
        hidden = eng.model.aux_hidden_states if key.hidden_states else None
        return _StepOut(out.accepted_tokens, out.num_accepted, out.decided if deferred else None, logprobs, hidden)

    def _eager(self, key: StepKey, host: Any, *, repeat: bool = False) -> _StepOut:
        batch, drafts = host
        dev = self.engine.device
        dev_batch = _on_device(batch, dev)
        return self._forward_and_select(key, dev_batch, self._attn_meta(batch),
                                        None if drafts is None else drafts.to(dev), deferred=False, repeat=repeat)

    def _capture(self, key: StepKey, host: Any) -> _Graph | None:
        batch, _ = host
        eng = self.engine
        dev = eng.device
        k = eng.num_draft
        inputs = GraphInputs(batch=key.batch, num_draft=k, kv_pages=key.kv_pages, page_size=eng.model.page_size,
                             device=dev)
        tokens = batch.token_ids.view(key.batch, k + 1)
        inputs.fill(tokens[:, 0].tolist(), tokens[:, 1:].tolist(), batch.cache_lens, batch.block_tables)
        inputs.upload()
        static_batch = _on_device(batch, dev)
        static_meta = self._attn_meta(batch)
        inputs.adopt(static_batch, static_meta)
        self._plan_attention(static_meta)
        static_drafts = inputs.tensors["drafts"]

        def step(is_warmup: bool) -> _StepOut:
            inputs.refresh_mask(static_meta)
            return self._forward_and_select(key, static_batch, static_meta, static_drafts, deferred=True,
                                            is_warmup=is_warmup)

        recorded = self._record(key, step)
        if recorded is None:
            return None
        graph, out = recorded
        g = _Graph(graph, inputs, static_meta, out, static_batch)
        self.graphs[key] = g
        if D.group_rank(self.engine.group) == 0:
            log.info("captured CUDA graph %d: batch bucket %d, %d pages a request, key %s", len(self.graphs),
                     key.batch, key.kv_pages, key)
        return g

    def _record(self, key: Any, step: Callable[[bool], Any]) -> tuple[Any, Any] | None:
        """Warm ``step`` up, capture it (an :class:`_EagerReplay` without ``capture``) and vote:
        ``(graph, static outputs)``, or None on every rank when some rank's capture failed (the key
        joins ``failed``: it runs eagerly from now on)."""
        dev = self.engine.device

        def warm_up() -> None:
            if not self.capture:
                return
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # eager warm-up (allocations, lazy inits), no forced acceptance
                for _ in range(WARMUP_RUNS):
                    step(True)
            torch.cuda.current_stream().wait_stream(side)

        def capture() -> tuple:
            if not self.capture:
                replay = _EagerReplay(step)
                return replay, replay.out
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = step(False)
            return graph, out

        def min_over_ranks(vote: int) -> int:
            flag = torch.tensor([vote], dtype=torch.int64, device=dev)
            D.all_reduce_(flag, "min", self.engine.group)
            return int(flag.item())

        captured, error = capture_or_fall_back(warm_up, capture, min_over_ranks)
        if error is not None:
            warnings.warn(f"CUDA graph capture of {key} failed, running it eagerly: {error}", RuntimeWarning,
                          stacklevel=3)
            if self.capture:
                torch.cuda.synchronize()
                # A capture that failed midway can leave its memory pool marked as recording; later
                # captures into it would fail too. The next capture gets a fresh pool.
                self.pool = torch.cuda.graph_pool_handle()
        if captured is None:
            self.failed.add(key)
        return captured

    def _load(self, g: _Graph, gen: list[Any], drafts: list[list[int]], num_padding: int, ahead: int = 0,
              reserve: int = 0) -> None:
        """The step's inputs into the graph's static tensors: one packed copy, and for a backend
        that plans on the host (FlashInfer) its page lists and plan. ``reserve``: as
        :meth:`GraphInputs.fill`'s."""
        g.inputs.fill(*self._input_rows(gen, drafts, num_padding, ahead), reserve=reserve)
        g.inputs.upload()
        if self.engine.model.attention.plans_on_host:
            batch, _ = self._host_batch(gen, drafts, num_padding)
            g.attn_meta.copy_(self._attn_meta(batch))
            self._plan_attention(g.attn_meta)


def _check_key(key: StepKey, meta: Any, drafts_sampled: bool) -> None:
    """The prepared metadata takes the code paths the key was captured for (host facts only)."""
    expected = (key.sampling == "greedy", key.sampling != "filtered", key.penalties, key.draft_logits)
    found = (meta.is_all_greedy, meta.temperature_only, meta.local_any_penalties, drafts_sampled)
    if expected != found or meta.num_requests != key.batch:
        raise RuntimeError(f"graph step bookkeeping: key {key} expects (all greedy, temperature only, penalties, "
                           f"sampled drafts) = {expected} for {key.batch} requests, the step has {found} for "
                           f"{meta.num_requests}")


def capture_or_fall_back(warm_up: Callable[[], None], capture: Callable[[], Any],
                         min_over_ranks: Callable[[int], int]) -> tuple[Any | None, str | None]:
    """The capture fallback, on every rank: ``(captured, error)``.

    ``warm_up()`` runs the step eagerly, collectives included, so its failure is raised, not
    voted on: a rank that failed there and went on to the vote would meet its peers inside
    the step's own collectives (the launcher then stops every worker, as for an eager step).
    ``capture()`` only records, so a rank whose capture raised has run no collective its
    peers wait in: it votes 0 (1 on success) in ``min_over_ranks`` (one all-reduce), and the
    graph is used only when every rank voted 1. ``captured`` is ``capture()``'s result then,
    else ``None`` (every rank runs this step eagerly); ``error`` describes this rank's capture
    failure (:func:`capture_failure_text`) or is ``None``.
    """
    warm_up()
    try:
        captured, error = capture(), None
    except Exception as exc:  # noqa: BLE001 - any failure means: this step runs eagerly
        # Only the text is kept: the exception's traceback holds the step's frames, and with
        # them the KV pages, until a garbage collection.
        captured, error = None, capture_failure_text(exc)
    if min_over_ranks(0 if error is not None else 1) != 1:
        return None, error
    return captured, error


def capture_failure_text(exc: BaseException) -> str:
    """The first error of ``exc``'s chain, then ``exc`` itself. Ending a capture whose body
    raised raises again (CUDA: "operation failed due to a previous error during capture"),
    which hides the body's error as its context; the first error is the cause."""
    chain = [exc]
    while chain[-1].__context__ is not None and len(chain) < 16:
        chain.append(chain[-1].__context__)
    first = chain[-1]
    text = f"{type(first).__name__}: {first}"
    return text if first is exc else f"{text} (then {type(exc).__name__}: {exc})"


def graphs_unavailable_reason(engine: Any) -> str | None:
    """Why generation steps of ``engine`` cannot be graphed, or None when they can.

    The decision depends only on the configuration, so every rank takes the same one.
    """
    if engine.device.type != "cuda" or not torch.cuda.is_available():
        return "not on a CUDA device"
    if engine.dp_size > 1:
        return "attention DP (per-rank batch sizes differ)"
    backend = D.group_backend(engine.group)
    if D.group_size(engine.group) > 1 and backend != "nccl":
        # gloo moves CUDA tensors through the host: its collectives cannot be captured.
        return f"the TP group's collectives run on {backend}, which CUDA graphs cannot capture (NCCL can)"
    attention = engine.model.attention
    # Each attention backend declares whether its attend can be captured (the deterministic one's
    # host loop over sequences cannot).
    if not attention.supports_graphs:
        return f"the {attention.name!r} attention backend cannot run under CUDA graphs here"
    return None


def _on_device(batch: Any, device: torch.device) -> Any:
    from ..model.batch import ForwardBatch

    return ForwardBatch(token_ids=batch.token_ids.to(device), positions=batch.positions.to(device),
                        block_tables=batch.block_tables, cache_lens=batch.cache_lens, query_lens=batch.query_lens,
                        logits_rows=batch.logits_rows.to(device))
