"""The engine loop that runs on every rank: admission (a slot and KV pages
per request), chunked context, speculative generation steps, verification, stop
conditions, slot and page reuse.

Lock-step rule: every decision that leads to a collective (how many forwards a step
runs, whether token selection runs, when the loop ends) is taken from *replicated*
state — the requests and the tokens chosen so far, which come out of the exchange and
are therefore identical on every rank. Nothing rank-local (timers, queue contents)
ever steers the loop.

Plain TP: every rank holds every request and runs the same batch.
Attention DP: request ``i`` belongs to TP rank ``i % tp_size``; each rank runs its own
batch (a one-token dummy row in scratch pages when it has nothing to do while others
do, because the TP MLP and the token selection are collectives), and after every step
the ranks all-gather the tokens they emitted, so every rank again knows every
request's tokens — rank 0 can report all of them and the loop ends everywhere at once.

Token masks (structured outputs, ``allowed_token_ids``, ``bad_words``;
:mod:`tpspec.runtime.structured`): every rank keeps a :class:`TokenConstraints` per masked
sequence, advanced over the committed tokens. A step computes each masked request's bitmask
rows on the host (row ``j`` after drafts ``0..j-1``; a model drafter's step ``j`` uses the same
row), each rank applies them to its own columns, and the request ends (``"stop"``) when its
grammar can go no further.

Per-request invariant in the generation phase: the target KV cache holds every token
but the last (``target_cached == len(tokens) - 1``); a step feeds the last token plus K
drafts, and "rewinding" rejected drafts is just not counting them.

KV pages (:mod:`tpspec.runtime.pages`): every paged model (target, draft model, EAGLE-3
head) uses the same block table, so a page holds the KV of its positions in every paged
model. A waiting request starts (FIFO) when the pages of the tokens it must prefill are free
and the step has token budget left for its first chunk;
pages are taken as it grows. When a generation request's next step finds no free page, the
newest running request is preempted: its pages go back (those in the prefix cache stay
cached), it waits at the head of the queue and is later recomputed from its tokens (prompt and
what it generated) — its stream and output positions unchanged, so its noise is too ("Noise
by position" in ``docs/determinism.md``). The oldest running request always fits alone (the
pool holds ``max_seq_len`` tokens), so every request finishes.

Prefix caching: once a full page's KV is final in every paged model (without a drafter: once the
step that writes it is planned, since every layer writes the whole batch's KV before any row
attends, so a request starting in that step may already reuse it), the page gets the key of
its token run (:func:`~tpspec.runtime.pages.page_keys`: the chain of the page's token ids and
its predecessors', from a root that names the engine's models and modes; with an EAGLE-3 head
also the token after the page, since the head's KV at position p reads token p + 1). A starting
request reuses the longest run of cached pages of its tokens and prefills the rest; at least
its last token is computed (its logits emit the first token). A request asking
``prompt_logprobs`` reads nothing from the cache (its prompt rows' logits are needed).
Every decision comes from the requests and their tokens: the same on every rank. The page
count is the same on every rank (:mod:`tpspec.runtime.kv_sizing`).
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .. import distributed as D
from ..exchange.base import Channel
from ..mapping import Mapping
from ..log import get_logger
from ..sampling.controls import bitmask_words
from ..sampling.logprobs import Logprob
from ..sampling.penalties import OccurrenceCounts
from ..speculative.forced import FORCE_ENV, ForcedAcceptanceWarning
from ..speculative.metadata import RequestEntry
from ..validation import torch_dtype
from .config import EngineConfig, Request, RequestStats
from .kv_sizing import plan_kv_cache
from .pages import PageAllocator, page_keys, root_key
from .structured import TokenConstraints

log = get_logger(__name__)


ProgressFn = Callable[[int, int], None]
"""``on_progress(steps_done, tokens_generated_so_far)``."""

_DUMMY_REQUEST_ID = -1


@dataclass
class SequenceResult:
    """What a rank returns for one request (the driver turns it into a ``RequestOutput``)."""

    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token, when the request asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's: None, then one per prompt token


@dataclass
class SequenceUpdate:
    """What one sequence gained in one step: ``new_token_ids`` (possibly none) and their
    ``new_logprobs`` (when asked), and when it ended, its ``finish_reason`` (``"stop"`` or
    ``"length"``) and ``stats``. ``prompt_logprobs`` (when asked) comes once, with the first tokens."""

    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    stats: RequestStats | None = None
    new_logprobs: list[dict[int, Logprob]] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave when it started
    num_preemptions: int = 0  # so far


@dataclass
class _Seq:
    req: Request
    index: int  # admission number in this engine (unique; keys the attention-DP token exchange)
    owner: int  # attention-DP rank that runs it (0 under plain TP)
    tokens: list[int]
    num_prompt: int
    # Tokens its context phase fills the cache with: the prompt, or after a preemption every token it
    # had; the context step that completes them emits its next token.
    prefill_len: int = 0
    slot: int = -1  # its slot while it runs (penalty counts, stored draft logits); -1 while waiting
    pages: list[int] = field(default_factory=list)  # its block table (grows; shared by all paged models)
    target_cached: int = 0
    draft_cached: int = 0
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages so far
    cacheable: bool = True  # its KV is real (not a benchmark's prompt counted as cached)
    started: bool = False  # it has run (num_cached_tokens is settled)
    # EAGLE-3: the target's captured hidden states of positions [draft_cached, len(tokens) - 1),
    # not yet read by the head (row blocks in position order).
    pending_hidden: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[dict[int, Logprob]] | None = None
    step_logprobs: list[dict[int, Logprob]] | None = None  # this step's, one per emitted token
    # vLLM's prompt logprobs: None, then one per prompt token, filled chunk by chunk; reported once.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    constraints: TokenConstraints | None = None  # its token masks (grammar state), when the request has any

    @property
    def in_context(self) -> bool:
        return self.target_cached < self.prefill_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    def entry(self, is_context: bool, ahead: int = 0) -> RequestEntry:
        """This step's :class:`RequestEntry`: its noise is that of its next output position, in
        its own stream (an unseeded one: its admission number, the same on every rank).
        ``ahead``: tokens it has in flight (emitted by a step whose tokens are not read yet)."""
        return RequestEntry(self.req.request_id, self.slot, self.req.sampling, is_context,
                            position=self.num_generated + ahead, stream=self.index)


@dataclass
class _Plan:
    """One rank's batch for one step. Order in the forward batch: final context chunks,
    partial context chunks, generation requests (context rows first, as the acceptance
    code expects)."""

    final_ctx: list[tuple[_Seq, int]] = field(default_factory=list)  # (seq, chunk length)
    partial_ctx: list[tuple[_Seq, int]] = field(default_factory=list)
    gen: list[_Seq] = field(default_factory=list)

    @property
    def emitting(self) -> list[_Seq]:
        return [s for s, _ in self.final_ctx] + self.gen


class Engine:
    """One rank's engine. Build it on every rank of the TP group after the process group
    exists (collective: loads the sharded weights). Then, on every rank identically: either
    :meth:`add_requests` / :meth:`abort` between :meth:`step` calls (continuous batching:
    new requests join the running batch at the next step, or the one after when the last step
    launched its successor ahead), or :meth:`generate` for a batch
    run to completion.
    """

    def __init__(self, config: EngineConfig, mapping: Mapping, device: torch.device | str | None = None) -> None:
        from ..exchange import make_key_exchange
        from ..model.drafters import DraftModel, NgramDrafter
        from ..model.eagle3 import Eagle3Drafter
        from ..model.loader import load_model
        from ..speculative import DraftLogitsStore, ForcedAcceptance, SpecMetadata, SpecWorker

        self.config = config
        self.mapping = mapping
        self.device = torch.device(device if device is not None else config.device)
        self.dtype = torch_dtype(config.dtype)
        self.group = D.tp_group()
        self.dp_size = mapping.tp_size if mapping.enable_attention_dp else 1
        self.dp_rank = mapping.tp_rank if mapping.enable_attention_dp else 0
        self.num_draft = config.num_draft_tokens
        spec = config.speculative

        started = time.perf_counter()
        self.exchange = None
        if mapping.lm_head_is_sharded:
            self.exchange = make_key_exchange(self.group, prefer=config.exchange, device=self.device)
        self.model = load_model(config.model_path, mapping, device=self.device, dtype=self.dtype,
                                exchange=self.exchange, attention_backend=config.attention_backend,
                                deterministic=config.deterministic)

        self.ngram = None
        self.draft_model = None
        self.eagle3 = None
        if spec is not None and spec.method == "ngram":
            self.ngram = NgramDrafter(num_draft_tokens=spec.num_speculative_tokens,
                                      max_ngram=spec.prompt_lookup_max, min_ngram=spec.prompt_lookup_min)
        elif spec is not None and spec.method == "eagle3":
            # Turns on the target's capture of the hidden states the head reads.
            self.eagle3 = Eagle3Drafter(config.draft_model_path, self.model, attention_backend=config.attention_backend,
                                        deterministic=config.deterministic)
        elif spec is not None:
            self.draft_model = DraftModel(config.draft_model_path, mapping, device=self.device, dtype=self.dtype,
                                          exchange=self.exchange, target_config=self.model.config,
                                          attention_backend=config.attention_backend,
                                          deterministic=config.deterministic)
        self.load_s = time.perf_counter() - started

        # The per-slot buffers first, so that the KV sizing sees them. Penalties: this rank's
        # columns' occurrences per slot (allocated when first used: held back from the pages).
        head = self.model.lm_head
        self.occurrences = OccurrenceCounts(config.max_batch_size, vocab_offset=head.vocab_offset,
                                            width=head.shard_width, device=self.device)
        # One request more than the batch: the dummy row (slot -1 = padding for the streams).
        self.meta = SpecMetadata(config.max_batch_size + 1, self.num_draft, device=self.device,
                                 mapping=mapping, max_num_slots=config.max_batch_size, occurrences=self.occurrences)
        # Forced acceptance (a benchmark knob) comes from the config, so every rank has the same.
        forced = None
        if config.forced_acceptance_rate is not None and self.num_draft:
            forced = ForcedAcceptance(config.forced_acceptance_rate, device=self.device)
        self.worker = SpecWorker(acceptance=spec.acceptance if spec is not None else "strict", forced=forced)
        self._forced_warning_due = forced is not None
        # Rejection sampling with a model drafter: sampled requests draft with their own
        # temperature on the shards, and the draft logits wait per slot for verification.
        self.draft_store = None
        if self.worker.acceptance == "rejection" and (self.draft_model is not None or self.eagle3 is not None):
            self.draft_store = DraftLogitsStore(config.max_batch_size, self.num_draft, head.shard_width,
                                                device=self.device)
        self._allocate_pages()
        self._prepared = False  # meta prepared for the current step (before drafting)
        self._drafts_sampled = False  # this step's drafts were sampled (their logits are in draft_store)
        self._graph_step = None  # the graphed generation step now running (cuda_graphs.GraphStep), if any
        self._ahead = None  # a graphed step launched before the last one's tokens were read (cuda_graphs.Launched)
        self._ll_tokenizer = None  # llguidance's tokenizer, built on the first request with a grammar
        self._masks: dict[tuple[int, int], np.ndarray] = {}  # this step's mask rows: (seq index, row) -> [words]
        # Sequences by request id, in admission order; index -> sequence; this rank's queue.
        self._seqs: dict[int, _Seq] = {}
        self._by_index: dict[int, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # oldest (re)start first: preemption takes the last
        self._admitted = 0
        self.num_preemptions = 0  # requests this rank preempted so far
        self.graphs = None
        if self.device.type == "cuda" and config.use_cuda_graphs:
            from .cuda_graphs import GenerationGraphs

            self.graphs = GenerationGraphs.maybe_create(self)
        if D.group_rank(self.group) == 0:
            log.info("%s", self.summary())

    # ------------------------------------------------------------------ KV pages
    @property
    def paged_models(self) -> list:
        """Every model whose KV cache lives in this engine's pages (one block table each request)."""
        return [m for m in (self.model, self.draft_model, self.eagle3) if m is not None]

    def _allocate_pages(self) -> None:
        """Size the pages (collective), allocate them in every paged model, and check that a
        request of ``max_seq_len`` tokens fits the pool (``ValueError`` otherwise)."""
        cfg = self.config
        self.kv = plan_kv_cache(cfg, self.paged_models, self.group, self.device,
                                reserve_bytes=self.occurrences.table_bytes)
        self.pages = PageAllocator(self.kv.num_pages, cfg.page_size, enable_caching=cfg.enable_prefix_caching)
        # The root of every prefix-cache key: what changes the KV a token run gets in this engine.
        self._root_key = root_key(repr((cfg.model_path, cfg.draft_model_path, cfg.speculative and cfg.speculative.method,
                                        str(self.dtype), cfg.deterministic, cfg.tp_size, self.dp_size,
                                        cfg.attention_backend, cfg.page_size)))
        self._key_lookahead = 1 if self.eagle3 is not None else 0  # the head's KV at p reads token p + 1
        longest = cfg.max_seq_len - 1 + self.num_draft
        if self.pages.pages_for(longest) > self.kv.num_pages:  # the same verdict on every rank
            raise ValueError(
                f"max_model_len={cfg.max_seq_len} needs {self.pages.pages_for(longest)} KV pages of {cfg.page_size} "
                f"tokens, the cache holds {self.kv.num_pages} ({self.kv.source}): lower max_model_len or give the "
                f"cache more memory (kv_cache_bytes / gpu_memory_utilization)")
        for model in self.paged_models:
            model.allocate_kv_cache(self.kv.num_pages + self.kv.num_scratch_pages, cfg.page_size)
        # Scratch pages after the requests' pages: dummy rows (attention DP) and graph padding write there.
        self.scratch_table = list(range(self.kv.num_pages, self.kv.num_pages + self.kv.num_scratch_pages))

    def summary(self) -> str:
        """The start-up summary rank 0 logs: model, TP, exchange, attention, pages, graphs, load time."""
        cfg = self.config
        exchange = type(self.exchange).__name__ if self.exchange is not None else "none (LM head not sharded)"
        why = f"exchange={cfg.exchange!r}"
        if self.exchange is not None and cfg.exchange == "auto":
            from ..exchange.factory import local_ll_blocker

            blocker = None if "LL" in exchange else local_ll_blocker(self.device)
            why = ("auto: every rank on one node with CUDA and cupy" if "LL" in exchange
                   else f"auto: no LL exchange, {blocker or 'the ranks span several nodes or one lacks it'}")
        graphs = "off"
        if self.graphs is not None:
            graphs = f"on (captured on first use, batch buckets {self.graphs.buckets[0]}..{self.graphs.buckets[-1]})"
        kv = self.kv
        return (f"engine ready: model {cfg.model_path} ({self.model.config.architecture}, "
                f"{self.model.config.num_layers} layers, {self.dtype}), TP={self.mapping.tp_size}"
                f"{' attention-DP' if self.dp_size > 1 else ''} on {self.device}; exchange {exchange} ({why}); "
                f"attention {self.model.attention.name}; KV cache holds {kv.num_tokens} tokens per rank "
                f"({kv.num_pages} pages x {kv.page_size} tokens, {kv.total_bytes / 2**20:.1f} MiB; {kv.source}), "
                f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}; "
                f"max_num_seqs={cfg.max_batch_size}, max_num_batched_tokens={cfg.max_num_tokens}; "
                f"CUDA graphs {graphs}; weights loaded in {self.load_s:.2f} s")

    # ------------------------------------------------------------------ public
    def add_requests(self, requests: list[Request], *, prompt_cached: bool = False) -> None:
        """Queue new sequences; they join the running batch at the next :meth:`step` (as KV
        slots and pages free up). Every rank must add the same requests in the same order between
        the same steps: the attention-DP owner of a sequence is its admission number modulo the
        DP size. Raises ``ValueError`` for an empty or too long prompt or a reused id.

        ``prompt_cached=True`` (a benchmark's hook): the requests start now, each as if its prompt
        were prefilled and its context step had emitted a copy of its last prompt token; their KV
        pages hold whatever they held, and nothing of theirs enters the prefix cache. Raises
        ``RuntimeError`` when they cannot all start at once (other requests wait, or the slots or
        the pages for their prompt plus one step are missing)."""
        if self.dp_size > 1 and any(r.sampling.has_penalties or r.sampling.logprobs is not None
                                    or r.sampling.prompt_logprobs is not None for r in requests):
            raise ValueError("penalties and logprobs are not supported with attention DP")
        if self.dp_size > 1 and any(r.sampling.has_logit_controls for r in requests):
            raise ValueError("logit controls (structured outputs, logit_bias, allowed_token_ids, bad_words) are not "
                             "supported with attention DP")
        if self._forced_warning_due:  # on every rank's first request
            self._forced_warning_due = False
            warnings.warn(f"rank {self.mapping.rank}: {FORCE_ENV}={self.config.forced_acceptance_rate:g} forces how many "
                          "drafts each step accepts (a benchmark knob): the generated tokens are not the model's",
                          ForcedAcceptanceWarning, stacklevel=2)
        if prompt_cached:
            self._check_can_start_now(requests)
        for req in requests:
            if req.request_id in self._seqs:
                raise ValueError(f"request {req.request_id} is already in the engine")
            seq = self._new_seq(req, self._admitted, self._admitted % self.dp_size)
            self._admitted += 1
            self._seqs[req.request_id] = seq
            self._by_index[seq.index] = seq
            if seq.owner != self.dp_rank:
                continue
            if prompt_cached:
                self._start_as_prefilled(seq)
            else:
                self._waiting.append(seq)

    def _check_can_start_now(self, requests: list[Request]) -> None:
        mine = [r for i, r in enumerate(requests) if (self._admitted + i) % self.dp_size == self.dp_rank]
        need = sum(self.pages.pages_for(len(r.prompt) + 1 + self.num_draft) for r in mine)
        slots = self.config.max_batch_size - len(self._running)
        if self._waiting or len(mine) > slots or need > self.pages.num_free:
            raise RuntimeError(
                f"{len(mine)} requests cannot start at once: {len(self._waiting)} others wait, {slots} slots and "
                f"{self.pages.num_free} of {self.kv.num_pages} KV pages of {self.kv.page_size} tokens are free, they "
                f"need {need}: use fewer or shorter ones")

    def _start_as_prefilled(self, seq: _Seq) -> None:
        seq.cacheable = False
        used = {s.slot for s in self._running}
        slot = next(i for i in range(self.config.max_batch_size) if i not in used)
        if not self.pages.start(seq.index, [], seq.num_prompt + 1 + self.num_draft):
            raise RuntimeError(f"request {seq.req.request_id}: KV pages ran out")  # _check_can_start_now said they fit
        self._place(seq, slot, cached=seq.num_prompt)
        seq.tokens.append(seq.tokens[-1])

    def abort(self, request_ids: list[int]) -> None:
        """Drop these sequences now (their slots are free for the next step); unknown ids are
        ignored. Called between steps with the same ids on every rank."""
        for rid in request_ids:
            seq = self._seqs.get(rid)
            if seq is not None:
                seq.finished, seq.finish_reason = True, "abort"
                if seq in self._waiting:
                    self._waiting.remove(seq)
                self._forget(seq)

    @property
    def has_unfinished(self) -> bool:
        """Whether any sequence (of any rank) still runs or waits: the same on every rank."""
        return any(not s.finished for s in self._seqs.values())

    @torch.inference_mode()
    def step(self) -> list[SequenceUpdate]:
        """One engine step over every unfinished sequence. Collective: every rank calls it after
        the same :meth:`add_requests` / :meth:`abort` calls. Returns what each sequence gained
        (identical on every rank, attention DP included); a finished sequence appears once with
        its ``finish_reason`` and stats and is then forgotten. A graphed decode step (or greedy
        verification of n-gram drafts, ``cuda_graphs.STEP_AHEAD_WITH_DRAFTS``) may have launched the
        next step of its batch before returning (``cuda_graphs.STEP_AHEAD``): the
        next call then only collects it, and requests added before that call start one call later."""
        before = {rid: (len(s.tokens), len(s.logprobs or ())) for rid, s in self._seqs.items()}
        for s in self._seqs.values():  # a zero-budget request needs no step
            self._check_done(s)
        if self._ahead is not None:  # launched by the last call, its batch fixed then
            launched, self._ahead = self._ahead, None
            self._finish_graphed(launched)
        elif any(not s.finished for s in self._seqs.values()):
            self._step(self._schedule())
        updates = []
        for rid, s in list(self._seqs.items()):
            new = s.tokens[before[rid][0]:]
            if new or s.finished:
                logprobs = None if s.logprobs is None else s.logprobs[before[rid][1]:]
                updates.append(SequenceUpdate(rid, new, s.finish_reason if s.finished else None,
                                              s.stats if s.finished else None, logprobs, self._take_prompt_logprobs(s),
                                              s.stats.num_cached_tokens, s.stats.num_preemptions))
            if s.finished:
                self._forget(s)
        return updates

    def _admit(self, plan: _Plan, budget: int) -> None:
        """Start waiting sequences in free slots, in order, while the pages of what they must
        prefill are free (the first that does not fit waits, and so do all behind it) and some of
        the step's token ``budget`` is left: each takes its first context chunk from it
        (:meth:`_plan_chunk`). (One started without a chunk would find nothing cached that an
        earlier request of this step has yet to prefill.)"""
        used = {s.slot for s in self._running}
        free_slots = [i for i in range(self.config.max_batch_size) if i not in used]
        while self._waiting and free_slots and budget > 0:
            seq = self._waiting[0]
            if seq.finished:
                self._waiting.popleft()
                continue
            if not self._start(seq, free_slots[0]):
                break
            self._waiting.popleft()
            free_slots.pop(0)
            budget = self._plan_chunk(plan, seq, budget)

    def _plan_chunk(self, plan: _Plan, seq: _Seq, budget: int) -> int:
        """Add ``seq``'s next context chunk (if it is in its context phase) to ``plan`` within
        ``budget``; returns what is left. Without a drafter the pages the chunk completes get their
        prefix-cache keys now: a request starting later in this step reuses them, since every
        layer writes the whole batch's KV before any row attends."""
        if not seq.in_context or budget <= 0:
            return budget
        chunk = min(seq.prefill_len - seq.target_cached, budget)
        if seq.target_cached + chunk == seq.prefill_len:
            plan.final_ctx.append((seq, chunk))
        else:
            plan.partial_ctx.append((seq, chunk))
        if (self.pages.enable_caching and seq.cacheable and self.draft_model is None
                and self.eagle3 is None):
            full = (seq.target_cached + chunk) // self.config.page_size
            self.pages.cache(seq.index, self._page_keys(seq)[:full])
        return budget - chunk

    def _start(self, seq: _Seq, slot: int) -> bool:
        """Give ``seq`` its pages — the longest cached run of its tokens' full pages, at least its
        last token left to compute, then fresh pages for the rest of its tokens — and ``slot``;
        False (nothing changes) when the fresh pages are not free."""
        n = len(seq.tokens)
        hit: list[int] = []
        if self.pages.enable_caching and seq.cacheable and seq.req.sampling.prompt_logprobs is None:
            usable = (n - 1) // self.config.page_size
            hit = self.pages.match(self._page_keys(seq)[:usable])
        if not self.pages.start(seq.index, hit, n):
            return False
        self._place(seq, slot, cached=len(hit) * self.config.page_size)
        return True

    def _place(self, seq: _Seq, slot: int, *, cached: int) -> None:
        """``seq`` runs in ``slot`` with its first ``cached`` tokens' KV already in its pages (in
        every paged model); its context phase computes the rest of its tokens."""
        seq.slot = slot
        seq.pages = self.pages.table(seq.index)
        seq.prefill_len = len(seq.tokens)
        seq.target_cached = seq.draft_cached = cached
        seq.pending_hidden = []  # EAGLE-3: the head reads the target's hidden states from `cached` on
        if not seq.started:
            seq.started = True
            seq.stats.num_cached_tokens = cached
        if seq.req.sampling.has_penalties:  # the slot's counts restart from this prompt and its output so far
            self.occurrences.reset(seq.slot, seq.req.prompt)
            if seq.num_generated:
                self.occurrences.add(torch.tensor([seq.slot], dtype=torch.int64),
                                     torch.tensor([seq.tokens[seq.num_prompt:]], dtype=torch.int64))
        self._running.append(seq)

    def _preempt(self, seq: _Seq) -> None:
        """``seq`` leaves the batch to be recomputed later from its tokens: its pages go back (cached
        ones stay cached), it waits at the head of the queue. Its stream and output positions do not
        change, so it draws the same noise when it resumes."""
        self._release(seq)
        seq.slot = -1
        seq.pages = []
        seq.target_cached = seq.draft_cached = 0
        seq.pending_hidden = []
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt:
            seq.prompt_logprobs = [None]  # scored again from the start when its prompt is prefilled again
        seq.stats.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)

    def _release(self, seq: _Seq) -> None:
        """A running sequence leaves: its references to its pages go back to the pool (pages in
        the prefix cache stay there). (Its random stream is its own, keyed by its seed or
        admission number: nothing to hand back.)"""
        self.pages.free(seq.index)
        self._running.remove(seq)

    def _page_keys(self, seq: _Seq) -> list[bytes]:
        """The prefix-cache keys of every full page of ``seq``'s tokens (extended as it grows)."""
        size = self.config.page_size
        if (len(seq.page_keys) + 1) * size + self._key_lookahead <= len(seq.tokens):
            seq.page_keys += page_keys(seq.tokens, size, self._root_key, lookahead=self._key_lookahead,
                                       start=len(seq.page_keys), parent=seq.page_keys[-1] if seq.page_keys else None)
        return seq.page_keys

    def _cache_pages(self) -> None:
        """Give the pages whose KV is now final in every paged model their keys (prefix caching):
        the full pages below the cached length of the target and of the drafter."""
        if not self.pages.enable_caching:
            return
        size = self.config.page_size
        for seq in self._running:
            if not seq.cacheable:
                continue
            valid = seq.target_cached
            if self.draft_model is not None or self.eagle3 is not None:
                valid = min(valid, seq.draft_cached)
            full = valid // size
            if full:
                self.pages.cache(seq.index, self._page_keys(seq)[:full])

    def _forget(self, seq: _Seq) -> None:
        del self._seqs[seq.req.request_id]
        del self._by_index[seq.index]
        if seq in self._running:
            self._release(seq)

    @torch.inference_mode()
    def generate(self, requests: list[Request], on_progress: ProgressFn | None = None) -> list[SequenceResult]:
        """Run ``requests`` to completion (on an engine with no other work). Collective: every
        rank of the TP group calls it with the same list. Returns one :class:`SequenceResult`
        per request, in order, identical on every rank (attention DP included)."""
        if self._seqs:
            raise RuntimeError("generate needs an idle engine (sequences are still running)")
        self.add_requests(requests)
        tokens: dict[int, list[int]] = {r.request_id: [] for r in requests}
        logprobs: dict[int, list] = {r.request_id: [] for r in requests}
        prompt_logprobs: dict[int, list | None] = {r.request_id: None for r in requests}
        done: dict[int, SequenceUpdate] = {}
        steps = 0

        def take(updates: list[SequenceUpdate]) -> None:
            for u in updates:
                tokens[u.request_id] += u.new_token_ids
                logprobs[u.request_id] += u.new_logprobs or []
                if u.prompt_logprobs is not None:
                    prompt_logprobs[u.request_id] = u.prompt_logprobs
                if u.finish_reason is not None:
                    done[u.request_id] = u

        while self.has_unfinished:
            take(self.step())
            steps += 1
            if on_progress is not None:
                on_progress(steps, sum(len(t) for t in tokens.values()))
        take(self.step())  # sequences that needed no step (a zero budget) finish here
        results = [SequenceResult(tokens[r.request_id], done[r.request_id].finish_reason, done[r.request_id].stats,
                                  None if r.sampling.logprobs is None else logprobs[r.request_id],
                                  prompt_logprobs[r.request_id])
                   for r in requests]
        self._check_ranks_agree(results)
        return results

    def _check_ranks_agree(self, results: list[SequenceResult]) -> None:
        """One small collective per call: every rank must hold the same tokens."""
        if D.group_size(self.group) == 1:
            return
        digest = hashlib.sha256(repr([r.token_ids for r in results]).encode()).hexdigest()
        digests = D.all_gather_object(digest, self.group)
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks disagree on the generated tokens (digests by rank: {digests})")

    def close(self) -> None:
        if self._ahead is not None:  # wait for it: its pages and graph go next
            launched, self._ahead = self._ahead, None
            self.graphs.collect(launched)
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.exchange is not None:
            self.exchange.close()
        for model in self.paged_models:  # the pages go now, not when a reference cycle is collected
            model.caches = []

    # ------------------------------------------------------------------ scheduling
    def _new_seq(self, req: Request, index: int, owner: int) -> _Seq:
        self.config.check_prompt_len(len(req.prompt), f"request {req.request_id}'s prompt")
        seq = _Seq(req=req, index=index, owner=owner, tokens=list(req.prompt), num_prompt=len(req.prompt),
                   prefill_len=len(req.prompt),
                   logprobs=None if req.sampling.logprobs is None else [],
                   prompt_logprobs=None if req.sampling.prompt_logprobs is None else [None])
        seq.stats.num_prompt_tokens = len(req.prompt)
        if req.has_token_mask:
            seq.constraints = TokenConstraints(
                self.model.config.vocab_size, grammar=req.grammar,
                tokenizer=self._grammar_tokenizer() if req.grammar is not None else None,
                allowed=req.sampling.allowed_token_ids, bad_words=req.bad_words_token_ids,
                eos_token_ids=self._eos_token_ids)
        return seq

    @property
    def _eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.config.eos_token_ids) or tuple(self.model.config.eos_token_ids)

    def _grammar_tokenizer(self):
        """llguidance's tokenizer, from the checkpoint's tokenizer files (the driver's, built the
        same way), made once per engine. Only token ids ever reach it."""
        if self._ll_tokenizer is None:
            from .structured import ll_tokenizer
            from .tokenizer import load_tokenizer

            hf = load_tokenizer(self.config.model_path)
            if hf is None:
                raise ValueError(f"a request has a grammar but {self.config.model_path!r} has no tokenizer")
            self._ll_tokenizer = ll_tokenizer(hf, self.model.config.vocab_size, self._eos_token_ids)
        return self._ll_tokenizer

    def _schedule(self) -> _Plan:
        """This step's plan. Finished sequences leave; every generation request takes the pages for
        its K + 1 tokens, oldest first, and when none is free the newest running request is
        preempted (possibly the one asking: it then waits); generation requests run (K + 1 tokens
        each) and context chunks fill the rest of the token budget, oldest first; then, when no
        request was preempted, waiting requests start while budget is left (:meth:`_admit`)."""
        for s in [s for s in self._running if s.finished]:
            self._release(s)
        plan = _Plan()
        preempted = False
        for seq in list(self._running):
            if seq.slot < 0 or seq.in_context:  # preempted by an older request's growth, or prefilling
                continue
            while not self.pages.grow(seq.index, len(seq.tokens) + self.num_draft):
                victim = self._running[-1]  # never one already planned: those are older than seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                plan.gen.append(seq)
        budget = self.config.max_num_tokens - (self.num_draft + 1) * len(plan.gen)
        for seq in list(self._running):  # their pages cover what they prefill since they started
            budget = self._plan_chunk(plan, seq, budget)
        if not preempted:
            self._admit(plan, budget)
        return plan

    # ------------------------------------------------------------------ one step
    def _step(self, plan: _Plan) -> None:
        from ..model.batch import ForwardBatch

        dp = self.dp_size > 1
        k = self.num_draft
        use_dummy = dp and not plan.emitting  # this rank has no row, others may: keep collectives paired
        self._prepared = self._drafts_sampled = False
        self._masks = {}
        graph_step = self._graph_step = None
        if self.graphs is not None and plan.gen and not plan.final_ctx and not plan.partial_ctx:
            graph_step = self.graphs.plan(plan.gen)  # None: this step runs eagerly (on every rank alike)
            self._graph_step = graph_step
        controlled_drafts = (self.ngram is None and k > 0
                             and any(s.req.sampling.has_logit_controls for s in plan.gen))
        if (self.draft_store is not None and (dp or any(not s.req.sampling.is_greedy for s in plan.gen))
                or controlled_drafts):
            # Sampled drafts read this step's streams, and a model drafts under the requests' logit
            # controls: prepare before drafting. (The same decision on every rank: plain TP ranks
            # hold the same plan; under attention DP every rank prepares, a collective.) A graphed
            # step's requests are its padded batch; steps with logit controls are never graphed.
            reqs = graph_step.requests if graph_step is not None else self._requests(plan, use_dummy)
            self.meta.prepare(requests=reqs, draft_len=k)
            self._prepared = True
        drafts = self._propose(plan, always_run_model=dp)
        if graph_step is not None:
            self._finish_graphed(self.graphs.launch(graph_step, plan.gen, drafts, prepared=self._prepared,
                                                    drafts_sampled=self._drafts_sampled))
            return

        tokens: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        cache_lens: list[int] = []
        query_lens: list[int] = []
        rows: list[int] = []

        prompt_rows: list[int] = []  # rows whose logits score the next prompt token (prompt logprobs)
        prompt_next: list[tuple[_Seq, int]] = []  # (sequence, the prompt token each of those rows scores)

        def add(pages: list[int], start: int, chunk: list[int], logit_rows: int, seq: _Seq | None = None) -> None:
            first = len(tokens)
            tokens.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
            tables.append(pages)
            cache_lens.append(start)
            query_lens.append(len(chunk))
            rows.extend(range(first + len(chunk) - logit_rows, first + len(chunk)))
            if seq is not None and seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt:
                # Row of position p scores prompt token p + 1 (the prompt's last row scores an output token).
                for p in range(start, min(start + len(chunk), seq.num_prompt - 1)):
                    prompt_rows.append(first + p - start)
                    prompt_next.append((seq, seq.tokens[p + 1]))

        in_batch: list[tuple[_Seq | None, bool]] = []  # per query_lens entry: (sequence or None = dummy, is gen)
        for seq, n in plan.final_ctx:
            add(seq.pages, seq.target_cached, seq.tokens[seq.target_cached:seq.target_cached + n], 1, seq)
            in_batch.append((seq, False))
        if use_dummy:
            add(self.scratch_table, 0, [0], 1)
            in_batch.append((None, False))
        for seq, n in plan.partial_ctx:
            add(seq.pages, seq.target_cached, seq.tokens[seq.target_cached:seq.target_cached + n], 0, seq)
            in_batch.append((seq, False))
        for seq, d in zip(plan.gen, drafts):
            last = len(seq.tokens) - 1
            add(seq.pages, last, [seq.tokens[-1]] + d, k + 1)
            in_batch.append((seq, True))

        emitted: dict[int, list[int]] = {}
        if tokens:  # under attention DP there is always at least the dummy row
            batch = ForwardBatch(
                token_ids=torch.tensor(tokens, dtype=torch.int64, device=self.device),
                positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
                block_tables=tables,
                cache_lens=cache_lens,
                query_lens=query_lens,
                logits_rows=torch.tensor(rows + prompt_rows, dtype=torch.int64, device=self.device),
            )
            for seq, n in plan.final_ctx + plan.partial_ctx:
                seq.target_cached += n
            if rows:
                emitted = self._verify(plan, batch, drafts, use_dummy, prompt_next)
            else:  # only partial context chunks: fill the cache, no token is due
                self._score_prompts(self.model(batch), prompt_next)
            if self.eagle3 is not None:
                self._keep_hidden_states(in_batch, query_lens, emitted, self.model.aux_hidden_states)
        if dp:
            emitted = self._all_gather_emitted(emitted)
        self._commit_step(emitted)

    def _finish_graphed(self, launched) -> None:
        """Launch the next step of the same batch when it can go ahead (on the device, while the
        host reads and commits this one's tokens: ``GenerationGraphs.launch_next``), then collect
        ``launched`` and commit its tokens (counted for penalties on the device when the next step
        went ahead, else here on the host: once either way). A request that finishes with these
        tokens has a row in the step launched ahead; its tokens there are dropped, neither committed
        nor counted (that step does not go ahead in turn, as its batch does not run on)."""
        self._ahead = None
        if self.graphs.can_launch_next(launched) and self._runs_on(launched.gen):
            self._ahead = self.graphs.launch_next(launched)
        result = self.graphs.collect(launched)
        if self.eagle3 is not None:
            k = self.num_draft
            self._keep_hidden_states([(s, True) for s in launched.gen], [k + 1] * len(launched.gen), result.emitted,
                                     result.hidden)
        self._commit_step(result.emitted, counted=result.counted)

    def _runs_on(self, gen: list[_Seq]) -> bool:
        """Whether the next step's batch is ``gen`` again whatever its tokens in flight (nothing
        waits or prefills, no request reaches its token budget or ``max_seq_len`` with them: up to
        K + 1 a request), with its pages for those tokens and the next step's K + 1 taken now;
        False when they are not free (the scheduler then preempts, a step later). The same answer
        on every rank."""
        if self._waiting or len(self._running) != len(gen):
            return False
        k = self.num_draft
        longest = self.config.max_seq_len
        if any(s.finished or s.in_context or s.num_generated + k + 1 >= s.req.max_new_tokens
               or len(s.tokens) + 2 * k + 1 >= longest for s in gen):
            return False
        return all(self.pages.grow(s.index, len(s.tokens) + 2 * k + 1) for s in gen)

    def _keep_hidden_states(self, in_batch: list[tuple[_Seq | None, bool]], query_lens: list[int],
                            emitted: dict[int, list[int]], captured: torch.Tensor) -> None:
        """EAGLE-3: queue the target hidden states of this step's tokens that are now part of their
        sequence (a context chunk: all of them; a generation request that emits n tokens: its last
        committed token and the n - 1 accepted drafts) for the head's next catch-up forward.
        ``captured``: the step's hidden states, rows in ``in_batch`` order (``query_lens`` each)."""
        start = 0
        for (seq, is_gen), n in zip(in_batch, query_lens):
            if seq is not None:
                keep = len(emitted[seq.index]) if is_gen else n
                seq.pending_hidden.append(captured[start:start + keep])
            start += n

    def _propose(self, plan: _Plan, *, always_run_model: bool) -> list[list[int]]:
        """K draft tokens for every generation request of ``plan`` (empty lists without
        speculation). The draft model runs exactly K forwards when any rank may need it."""
        k = self.num_draft
        if k == 0:
            return [[] for _ in plan.gen]
        if self.ngram is not None:
            return [self.ngram.draft(seq.tokens) for seq in plan.gen]
        if not plan.gen and not always_run_model:
            return []
        if self.eagle3 is not None:
            return self._draft_with_eagle3(plan.gen)
        return self._draft_with_model(plan.gen)

    def _draft_with_model(self, gen: list[_Seq]) -> list[list[int]]:
        """Drafts from the draft model (picked by :meth:`_pick_drafts`): one catch-up forward (tokens
        the draft cache has not seen, last row -> first draft), then K-1 one-token forwards
        (:meth:`_draft_chain`)."""
        from ..model.batch import ForwardBatch

        k = self.num_draft
        dev = self.device
        if gen:
            first = [s.tokens[s.draft_cached:] for s in gen]
            starts = [s.draft_cached for s in gen]
            tables = [s.pages for s in gen]
            slots = [s.slot for s in gen]
        else:  # attention DP, nothing here: a dummy row keeps the collectives paired
            first, starts, tables, slots = [[0]], [0], [self.scratch_table], [-1]
        toks = [t for chunk in first for t in chunk]
        pos = [p for chunk, st in zip(first, starts) for p in range(st, st + len(chunk))]
        lens = [len(c) for c in first]
        last_rows = torch.tensor(list(_cumsum(lens)), dtype=torch.int64, device=dev) - 1
        batch = ForwardBatch(token_ids=torch.tensor(toks, dtype=torch.int64, device=dev),
                             positions=torch.tensor(pos, dtype=torch.int64, device=dev),
                             block_tables=tables, cache_lens=starts, query_lens=lens, logits_rows=last_rows)
        cur, _ = self._pick_drafts(self.draft_model(batch), [], slots)
        drafts = self._draft_chain(cur, [st + n for st, n in zip(starts, lens)], tables, slots, None)
        table = drafts.cpu().tolist() if gen else []
        for s in gen:  # the cache now holds the committed tokens plus drafts 1..K-1
            s.draft_cached = len(s.tokens) + k - 1
        return [[int(t) for t in row] for row in table]

    def _draft_with_eagle3(self, gen: list[_Seq]) -> list[list[int]]:
        """Drafts from the EAGLE-3 head (picked by :meth:`_pick_drafts`). Draft position ``i`` reads
        the target's hidden states at ``i`` and token ``i + 1``: one catch-up forward over the
        positions whose hidden states arrived since the last drafting (the last row gives the first
        draft), then K - 1 one-token forwards, each reading the previous row's output instead of
        target hidden states (:meth:`_draft_chain`)."""
        from ..model.batch import ForwardBatch

        dev = self.device
        head = self.eagle3
        width = head.aux_hidden_width
        if gen:
            starts = [s.draft_cached for s in gen]
            ends = [len(s.tokens) - 1 for s in gen]  # positions [start, end) have target hidden states
            toks = [t for s, st, e in zip(gen, starts, ends) for t in s.tokens[st + 1:e + 1]]
            hidden = torch.cat([h for s in gen for h in s.pending_hidden])
            slots = [s.slot for s in gen]
            tables = [s.pages for s in gen]
        else:  # attention DP, nothing here: a dummy row keeps the collectives paired
            starts, ends, toks, slots, tables = [0], [1], [0], [-1], [self.scratch_table]
            hidden = torch.zeros(1, width, dtype=head.dtype, device=dev)
        lens = [e - st for st, e in zip(starts, ends)]
        if hidden.shape[0] != sum(lens):
            raise RuntimeError(f"EAGLE-3 bookkeeping: {hidden.shape[0]} hidden rows for {sum(lens)} draft positions")
        pos = [p for st, e in zip(starts, ends) for p in range(st, e)]
        last_rows = torch.tensor(list(_cumsum(lens)), dtype=torch.int64, device=dev) - 1
        batch = ForwardBatch(token_ids=torch.tensor(toks, dtype=torch.int64, device=dev),
                             positions=torch.tensor(pos, dtype=torch.int64, device=dev),
                             block_tables=tables, cache_lens=starts, query_lens=lens, logits_rows=last_rows)
        logits, out = head(batch, hidden)
        cur, _ = self._pick_drafts(logits, [], slots)
        drafts = self._draft_chain(cur, ends, tables, slots, out)
        table = drafts.cpu().tolist() if gen else []
        for s, e in zip(gen, ends):  # chained positions [e, e + K - 1) are overwritten next time
            s.draft_cached = e
            s.pending_hidden = []
        return [[int(t) for t in row] for row in table]

    def _draft_chain(self, first: torch.Tensor, ends: list[int], tables: list[list[int]], slots: list[int],
                     hidden: torch.Tensor | None) -> torch.Tensor:
        """``[rows, K]`` drafts: ``first`` (the catch-up forward's pick) and draft steps 1 .. K-1, run
        through CUDA graphs when this step is graphed (:meth:`GenerationGraphs.draft_chain`), else
        by :meth:`draft_chain_steps`."""
        if self.num_draft > 1 and self._graph_step is not None:
            chained = self.graphs.draft_chain(self._graph_step, first, ends, tables, hidden, sampled=self._prepared)
            if chained is not None:
                return chained
        return torch.stack(self.draft_chain_steps(first, ends, tables, slots, hidden), dim=1)

    def draft_chain_steps(self, first: torch.Tensor, ends: list[int], tables: list[list[int]],
                          slots: list[int], hidden: torch.Tensor | None) -> list[torch.Tensor]:
        """Draft steps 1 .. K-1 after the catch-up pick ``first`` (``[rows]``), eagerly: the K drafts
        ``[rows]`` each (see :meth:`draft_chain_step`)."""
        drafts = [first]
        for j in range(1, self.num_draft):
            cur, hidden, _ = self.draft_chain_step(j, drafts, ends, tables, slots, hidden)
            drafts.append(cur)
        return drafts

    def draft_chain_step(self, j: int, drafts: list[torch.Tensor], ends: list[int], tables: list[list[int]],
                         slots: list[int] | torch.Tensor, hidden: torch.Tensor | None, *,
                         position: torch.Tensor | None = None, meta=None, logits_rows: torch.Tensor | None = None,
                         deferred: bool = False, filter_plan=None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                             torch.Tensor | None]:
        """Draft step ``j`` (1 .. K-1): a one-token forward of the drafter at positions
        ``ends[i] + j - 1`` (``tables``: the rows' block tables) feeding ``drafts[-1]`` (an EAGLE-3
        head also ``hidden``, the previous row outputs), then the pick (:meth:`_pick_drafts`, which
        counts ``drafts`` as the chain so far). Returns ``(tokens [rows], the head's outputs or None,
        decided)``; ``decided`` as :meth:`_pick_drafts` gives it. ``position``/``meta``/
        ``logits_rows``: the step's static positions ``[rows]``, attention metadata and logits rows
        (what a CUDA graph captures); built here without them. The step function of the eager
        chain and of its graphs."""
        from ..model.batch import ForwardBatch

        at = [e + j - 1 for e in ends]
        if position is None:
            position = torch.tensor(at, dtype=torch.int64, device=self.device)
        batch = ForwardBatch(token_ids=drafts[-1], positions=position, block_tables=tables, cache_lens=at,
                             query_lens=[1] * len(tables), logits_rows=logits_rows)
        if self.eagle3 is not None:
            logits, hidden = self.eagle3(batch, hidden, meta)
        else:
            logits = self.draft_model(batch, meta)
        cur, decided = self._pick_drafts(logits, drafts, slots, deferred=deferred, filter_plan=filter_plan)
        return cur, hidden, decided

    def _verify(self, plan: _Plan, batch, drafts: list[list[int]], use_dummy: bool,
                prompt_next: list[tuple[_Seq, int]]) -> dict[int, list[int]]:
        """Target forward, token selection and acceptance (and the prompt logprobs of the rows
        ``prompt_next`` scores, after the selection rows). Returns ``{seq index: tokens}``."""
        k = self.num_draft
        reqs = self._requests(plan, use_dummy)
        if not self._prepared:
            self.meta.prepare(requests=reqs, draft_len=k)
        self.meta.set_token_bitmask(self._step_bitmask(plan, drafts, use_dummy))
        logits = self._score_prompts(self.model(batch), prompt_next)
        draft_table = None
        if k:
            draft_table = torch.zeros(len(reqs), k, dtype=torch.int64, device=self.device)
            if plan.gen:
                first_gen = len(reqs) - len(plan.gen)
                draft_table[first_gen:] = torch.tensor(drafts, dtype=torch.int64, device=self.device)
        draft_logits = self.draft_store.read(self.meta.slot_ids, k) if self._drafts_sampled else None
        out = self.worker.step(logits, draft_table, self.meta, draft_logits=draft_logits)
        emitting = [s for s, _ in plan.final_ctx] + ([None] if use_dummy else []) + plan.gen
        if any(s is not None and s.logprobs is not None for s in emitting):
            self._step_logprobs(logits, out, emitting)
        accepted = out.accepted_tokens.cpu().tolist()
        counts = out.num_accepted.cpu().tolist()
        result: dict[int, list[int]] = {}
        for seq, row, n in zip(emitting, accepted, counts):
            if seq is None:
                continue
            result[seq.index] = [int(t) for t in row[: int(n)]]
        return result

    @staticmethod
    def _requests(plan: _Plan, use_dummy: bool) -> list[RequestEntry]:
        """The step's requests in logits-row order: final context chunks, the dummy, generation."""
        reqs = [s.entry(True) for s, _ in plan.final_ctx]
        if use_dummy:
            reqs.append(RequestEntry(_DUMMY_REQUEST_ID, -1, None, True))  # padding: greedy, no stream
        return reqs + [s.entry(False) for s in plan.gen]

    def _pick_drafts(self, logits, previous: list[torch.Tensor], slots: list[int] | torch.Tensor, *,
                     deferred: bool = False, filter_plan=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next draft step's tokens from the drafter's ``logits`` (rows: this rank's generation
        requests at their stream ``slots``, or its one dummy row at slot -1; ``previous``: the
        chain's drafts so far, ``[rows]`` each): sampled on the shards with each request's
        penalties (counting ``previous`` as output), temperature and filters when the step
        prepared its streams first and some request samples (the logits then wait in
        ``draft_store``), else greedy. ``deferred``: no host sync (a CUDA graph; ``slots`` a device
        tensor, ``filter_plan`` the filters' facts); the second value says then whether every
        filtered row was decided (None: no filter), else it is None."""
        from ..speculative import select_draft_tokens

        if not self._prepared:
            return logits.argmax(channel=Channel.DRAFT), None
        # The drafted rows are the step's last requests: its generation requests, or the dummy.
        first = self.meta.num_requests - len(slots)
        step = len(previous)
        prior = torch.stack(previous, dim=1) if previous else None
        bitmask = None if deferred else self._draft_bitmask(first, prior)  # graphed steps have no masks
        sel = select_draft_tokens(logits, self.meta, step, sample=self.draft_store is not None, first_request=first,
                                  previous_drafts=prior, deferred=deferred, filter_plan=filter_plan, bitmask=bitmask)
        if sel.logits is not None:
            self.draft_store.write(slots, step, sel.logits, check=not deferred)
            self._drafts_sampled = True
        return sel.tokens, sel.decided

    def _mask_row(self, seq: _Seq | None, drafts: list[int]) -> np.ndarray:
        """``[words]`` int32: the tokens ``seq`` may take after its output and ``drafts`` (every
        token for a sequence without masks, or padding); one computation per (sequence, row) a step."""
        if seq is None or seq.constraints is None:
            return np.full(bitmask_words(self.model.config.vocab_size), -1, dtype=np.int32)
        key = (seq.index, len(drafts))
        if key not in self._masks:
            self._masks[key] = seq.constraints.mask(drafts)
        return self._masks[key]

    def _step_bitmask(self, plan: _Plan, drafts: list[list[int]], use_dummy: bool) -> torch.Tensor | None:
        """The token bitmask of the step's logits rows (``[R, words]`` int32, rows in the order of
        :meth:`_requests`), or None when no request of the step has masks."""
        if not any(s.constraints is not None for s in plan.emitting):
            return None
        rows = [self._mask_row(s, []) for s, _ in plan.final_ctx]
        if use_dummy:
            rows.append(self._mask_row(None, []))
        for seq, d in zip(plan.gen, drafts):
            rows += [self._mask_row(seq, list(d[:j])) for j in range(self.num_draft + 1)]
        return torch.from_numpy(np.stack(rows)).to(self.device)

    def _draft_bitmask(self, first: int, prior: torch.Tensor | None) -> torch.Tensor | None:
        """The token bitmask of one draft step's rows (the step's requests from ``first`` on;
        ``prior``: their drafts so far, ``[rows, j]``): the rows of the verification that checks
        these drafts. None when none of them has masks."""
        entries = self.meta.entries[first:]
        seqs = [self._seqs.get(e.request_id) if e.slot_id != -1 else None for e in entries]
        if not any(s is not None and s.constraints is not None for s in seqs):
            return None
        prior_rows = prior.cpu().tolist() if prior is not None else [[] for _ in seqs]
        rows = [self._mask_row(s, [int(t) for t in d]) for s, d in zip(seqs, prior_rows)]
        return torch.from_numpy(np.stack(rows)).to(self.device)

    def _step_logprobs(self, logits, out, emitting: list[_Seq | None]) -> None:
        """Sets ``step_logprobs`` of the requests asking for logprobs (from the raw logits)."""
        from ..sampling.logprobs import emitted_logprobs

        asking = [b for b, s in enumerate(emitting) if s is not None and s.logprobs is not None]
        pick = torch.tensor(asking, dtype=torch.int64)
        found = emitted_logprobs(logits, self.meta.request_row_index.cpu()[pick], out.accepted_tokens.cpu()[pick],
                                 out.num_accepted.cpu()[pick], [emitting[b].req.sampling.logprobs for b in asking])
        for b, step in zip(asking, found):
            emitting[b].step_logprobs = step

    def _score_prompts(self, logits, prompt_next: list[tuple[_Seq, int]]):
        """Prompt logprobs from the last ``len(prompt_next)`` rows of ``logits`` (each scores the
        prompt token it names, on the shards); returns the rows before them (the selection's)."""
        if not prompt_next:
            return logits
        from ..sampling.logprobs import position_logprobs
        from ..vocab_parallel import VocabShardedLogits

        head = logits.local.shape[0] - len(prompt_next)

        def part(rows):
            return VocabShardedLogits(logits.local[rows], logits.vocab_offset, logits.vocab_size, logits.exchange)

        top_n = max(s.req.sampling.prompt_logprobs for s, _ in prompt_next)
        targets = torch.tensor([t for _, t in prompt_next], dtype=torch.int64, device=logits.local.device)
        token_lp, top_ids, top_lp, ranks = part(slice(head, None)).logprobs(targets, top_n=top_n)
        token_lp, top_ids, top_lp, ranks = token_lp.tolist(), top_ids.tolist(), top_lp.tolist(), ranks.tolist()
        for i, (seq, t) in enumerate(prompt_next):
            n = seq.req.sampling.prompt_logprobs
            seq.prompt_logprobs.append(position_logprobs(t, token_lp[i], ranks[i], top_ids[i][:n], top_lp[i][:n]))
        return part(slice(0, head))

    def _take_prompt_logprobs(self, seq: _Seq) -> list[dict[int, Logprob] | None] | None:
        """The sequence's prompt logprobs once its prompt is scored (with its first tokens), then None."""
        if seq.prompt_logprobs is None or seq.prompt_logprobs_sent or len(seq.prompt_logprobs) < seq.num_prompt:
            return None
        seq.prompt_logprobs_sent = True
        return seq.prompt_logprobs

    def _all_gather_emitted(self, emitted: dict[int, list[int]]) -> dict[int, list[int]]:
        """Attention DP: every rank learns every rank's emitted tokens, and the facts of the
        emitting sequences only their owner knows (the length of their context phase, their
        cached prompt tokens and preemptions). One all-gather of a fixed-size
        ``[max_batch_size, K + 6]`` int64 table: seq index, count, those three facts, tokens."""
        k = self.num_draft
        width = k + 6
        table = torch.full((self.config.max_batch_size, width), -1, dtype=torch.int64)
        for row, (idx, toks) in enumerate(emitted.items()):
            seq = self._by_index[idx]
            table[row, :5] = torch.tensor([idx, len(toks), seq.prefill_len, seq.stats.num_cached_tokens,
                                           seq.stats.num_preemptions], dtype=torch.int64)
            table[row, 5:5 + len(toks)] = torch.tensor(toks, dtype=torch.int64)
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        local = table.to(dev).reshape(-1)
        full = torch.empty(self.dp_size * local.numel(), dtype=torch.int64, device=dev)
        D.all_gather_into(full, local, self.group)
        out: dict[int, list[int]] = {}
        for row in full.view(-1, width).cpu().tolist():
            if row[0] >= 0:
                out[row[0]] = row[5:5 + row[1]]
                seq = self._by_index[row[0]]
                if seq.owner != self.dp_rank:
                    seq.prefill_len, seq.stats.num_cached_tokens, seq.stats.num_preemptions = row[2:5]
        return out

    def _commit_step(self, emitted: dict[int, list[int]], *, counted: bool = False) -> None:
        """Commit every request's tokens of this step; count them for penalised requests, unless
        ``counted`` (a step launched ahead of its successor: ``GenerationGraphs.launch_next``
        counted them on the device already); give the pages whose KV is now final their
        prefix-cache keys."""
        seqs = self._by_index
        for idx, toks in emitted.items():
            self._commit(seqs[idx], toks)
        penalised = [(seqs[i].slot, toks) for i, toks in emitted.items()
                     if not counted and seqs[i].req.sampling.has_penalties and seqs[i].owner == self.dp_rank]
        if penalised:
            width = max(len(toks) for _, toks in penalised)
            table = torch.tensor([toks + [-1] * (width - len(toks)) for _, toks in penalised], dtype=torch.int64)
            self.occurrences.add(torch.tensor([slot for slot, _ in penalised], dtype=torch.int64), table)
        self._cache_pages()

    def _commit(self, seq: _Seq, toks: list[int]) -> None:
        """Append a step's tokens, apply the stop rules, keep the cache bookkeeping."""
        was_context = len(seq.tokens) == seq.prefill_len  # the step that completed its context emitted these
        st = seq.stats
        st.num_steps += 1
        emitted = 0
        for t in toks:
            seq.tokens.append(int(t))
            emitted += 1
            if seq.constraints is not None:
                seq.constraints.commit(int(t))
            if self._check_done(seq):
                break
        if not was_context:
            # Count what the step emitted, not what it verified: tokens cut off by the
            # request's end (length, max_seq_len, a stop token) were never generated.
            st.num_draft_tokens += self.num_draft
            st.num_accepted_drafts += emitted - 1
            st.accepted_drafts_per_step.append(emitted - 1)
        st.num_generated_tokens = seq.num_generated
        if seq.step_logprobs is not None:
            seq.logprobs.extend(seq.step_logprobs[:emitted])
            seq.step_logprobs = None
        seq.target_cached = len(seq.tokens) - 1
        seq.draft_cached = min(seq.draft_cached, len(seq.tokens) - 1)

    def _check_done(self, seq: _Seq) -> bool:
        if seq.finished:
            return True
        if seq.num_generated > seq.req.sampling.min_tokens and seq.tokens[-1] in seq.req.stop_token_ids:
            seq.finished, seq.finish_reason = True, "stop"
        elif seq.constraints is not None and seq.constraints.finished:  # the grammar is complete
            seq.finished, seq.finish_reason = True, "stop"
        elif seq.num_generated >= seq.req.max_new_tokens or len(seq.tokens) >= self.config.max_seq_len:
            seq.finished, seq.finish_reason = True, "length"
        return seq.finished


def _cumsum(values: list[int]):
    total = 0
    for v in values:
        total += v
        yield total
