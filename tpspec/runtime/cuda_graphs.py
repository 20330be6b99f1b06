"""CUDA graphs for generation steps (GPU only; the CPU path is always eager).

A pure generation step of plain TP — every request verifies K drafts, no context
chunk — has the same shapes every time once the batch is padded to a bucket size:
``Bp * (K + 1)`` tokens, and attention over page tables of a bucketed width (the next
power of two of the pages the longest request reads: real lengths, never
``max_seq_len``; FlashInfer is planned on the host with the exact lengths before each
replay). One graph per (batch bucket, page bucket, sampling path) captures the target
forward, the token selection (the exchange, whose device-side counters advance inside
the graph) and the acceptance.
Before a replay the host refreshes the static inputs in place (token ids, positions,
drafts, attention metadata; ``SpecMetadata.prepare`` refills its stable buffers).
Graphed: all-greedy batches, and temperature-only batches under strict acceptance.
Rejection sampling, top-k/top-p/min-p rows and requests with penalties, logprobs or logit
controls (structured outputs, logit bias, allowed tokens, bad words) run eagerly.

Padding requests write into the engine's scratch pages (nothing reads them for real) and
use slot -1 in the metadata (greedy, no stream).

Every rank takes the same decisions: whether a step is graphed depends only on the
batch (replicated) and a capture failure on any rank disables that graph on all ranks
(one all-reduce at capture time), so the ranks never split between graph and eager. A
failure in the eager warm-up before a capture is an error of the step, raised as such.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import distributed as D
from ..log import get_logger
from ..speculative.metadata import RequestEntry

log = get_logger(__name__)
WARMUP_RUNS = 2


def page_bucket(pages: int) -> int:
    """Page-table width of a graph whose longest request reads ``pages`` pages: the next power of two."""
    return 1 << max(0, pages - 1).bit_length()


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to ``max_batch_size`` (always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


@dataclass
class _Graph:
    graph: Any
    tokens: torch.Tensor  # [Bp * (K + 1)] int64
    positions: torch.Tensor
    drafts: torch.Tensor | None  # [Bp, K] int64
    attn_meta: Any
    accepted: torch.Tensor  # [Bp, K + 1] int64 (graph output)
    num_accepted: torch.Tensor  # [Bp] int64 (graph output)
    batch: Any = None  # the static ForwardBatch, kept alive with the graph


class GenerationGraphs:
    """Captured generation steps of one :class:`~tpspec.runtime.engine.Engine`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.buckets = bucket_sizes(engine.config.max_batch_size)
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: set[tuple] = set()
        self.pool = torch.cuda.graph_pool_handle()

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

    # ------------------------------------------------------------------ per step
    def run(self, gen: list[Any], drafts: list[list[int]]) -> dict[int, list[int]] | None:
        """Run a pure generation step through a graph; ``{seq index: emitted tokens}``, or
        None when this step is not graphed (the caller runs it eagerly; no state changed)."""
        b = len(gen)
        padded = next((s for s in self.buckets if s >= b), None)
        if padded is None or b == 0:
            return None
        params = [s.req.sampling for s in gen]
        # The sampling path of the step, known before prepare (plain TP: no group sync needed).
        all_greedy = all(p.is_greedy for p in params)
        temperature_only = all(p.is_temperature_only for p in params)
        if not (all_greedy or (temperature_only and eng_strict(self.engine))):
            return None  # rejection sampling / filtered rows: eager (they sync with the host)
        if any(p.has_penalties or p.logprobs is not None for p in params):
            return None  # penalties read the step's drafts, logprobs the raw logits: eager
        if any(p.has_logit_controls for p in params):
            return None  # logit controls: host-computed token masks and biases, eager
        eng = self.engine
        k = eng.num_draft
        # The attention metadata's sizes belong to the key (kept last: the sampling part stays as it was).
        kv_pages = page_bucket(max(eng.pages.pages_for(len(s.tokens) + k) for s in gen))
        key = (padded, all_greedy, temperature_only, any(p.is_seeded and not p.is_greedy for p in params), kv_pages)
        if key in self.failed:
            return None
        reqs = [s.entry(False) for s in gen]
        reqs += [RequestEntry(-1 - i, -1) for i in range(padded - b)]
        eng.meta.prepare(requests=reqs, draft_len=k)
        host = self._host_batch(gen, drafts, padded - b)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, host)
            if graph is None:  # capture failed on some rank: this step (and key) eagerly
                out = self._eager(host)
                return self._emitted(gen, out[0], out[1])
        self._load(graph, host)
        graph.graph.replay()
        emitted = self._emitted(gen, graph.accepted, graph.num_accepted)  # synchronizes with the replay
        # A replay calls no Python: a peer timeout inside it is only recorded on the device
        # (its rows read -1). Raise it now, before those tokens reach a request.
        if eng.exchange is not None:  # None: the LM head is not vocabulary-sharded, nothing exchanged
            eng.exchange.check(sync=False)
        return emitted

    # ------------------------------------------------------------------ helpers
    def _host_batch(self, gen: list[Any], drafts: list[list[int]], num_padding: int) -> Any:
        from ..model.batch import ForwardBatch

        k = self.engine.num_draft
        tokens, positions, tables, cache_lens = [], [], [], []
        for seq, d in zip(gen, drafts):
            last = len(seq.tokens) - 1
            tokens += [seq.tokens[-1]] + list(d)
            positions += list(range(last, last + k + 1))
            tables.append(seq.pages)
            cache_lens.append(last)
        for _ in range(num_padding):
            tokens += [0] * (k + 1)
            positions += list(range(k + 1))
            tables.append(self.engine.scratch_table)
            cache_lens.append(0)
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
            rows = [list(d) for d in drafts] + [[0] * k for _ in range(num_padding)]
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

    def _forward_and_select(self, batch: Any, attn_meta: Any, drafts: torch.Tensor | None,
                            is_warmup: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward, then ``SpecWorker.step`` (its strict path: no host sync, so it can
        be captured): each row's token, the drafts that match, forced acceptance when the
        benchmark asks for it."""
        eng = self.engine
        out = eng.worker.step(eng.model(batch, attn_meta), drafts, eng.meta, is_warmup=is_warmup)
        return out.accepted_tokens, out.num_accepted

    def _eager(self, host: Any) -> tuple[torch.Tensor, torch.Tensor]:
        batch, drafts = host
        dev = self.engine.device
        dev_batch = _on_device(batch, dev)
        return self._forward_and_select(dev_batch, self._attn_meta(batch),
                                        None if drafts is None else drafts.to(dev), False)

    def _capture(self, key: tuple, host: Any) -> _Graph | None:
        batch, drafts = host
        dev = self.engine.device
        static_batch = _on_device(batch, dev)
        static_meta = self._attn_meta(batch)
        self._plan_attention(static_meta)
        static_drafts = None if drafts is None else drafts.to(dev)

        def warm_up() -> None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # eager warm-up (allocations, lazy inits), no forced acceptance
                for _ in range(WARMUP_RUNS):
                    self._forward_and_select(static_batch, static_meta, static_drafts, True)
            torch.cuda.current_stream().wait_stream(side)

        def capture() -> tuple:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                accepted, num = self._forward_and_select(static_batch, static_meta, static_drafts, False)
            return graph, accepted, num

        def min_over_ranks(vote: int) -> int:
            flag = torch.tensor([vote], dtype=torch.int64, device=dev)
            D.all_reduce_(flag, "min", self.engine.group)
            return int(flag.item())

        captured, error = capture_or_fall_back(warm_up, capture, min_over_ranks)
        if error is not None:
            warnings.warn(f"CUDA graph capture of generation step {key} failed, running it eagerly: {error}",
                          RuntimeWarning, stacklevel=2)
            torch.cuda.synchronize()
            # A capture that failed midway can leave its memory pool marked as recording; later
            # captures into it would fail too. The next capture gets a fresh pool.
            self.pool = torch.cuda.graph_pool_handle()
        if captured is None:
            self.failed.add(key)
            return None
        graph, accepted, num = captured
        g = _Graph(graph, static_batch.token_ids, static_batch.positions, static_drafts, static_meta, accepted, num,
                   static_batch)
        self.graphs[key] = g
        if D.group_rank(self.engine.group) == 0:
            log.info("captured CUDA graph %d: batch bucket %d, %d pages a request, key %s", len(self.graphs), key[0],
                     key[-1], key)
        return g

    def _load(self, g: _Graph, host: Any) -> None:
        batch, drafts = host
        g.tokens.copy_(batch.token_ids, non_blocking=True)
        g.positions.copy_(batch.positions, non_blocking=True)
        if g.drafts is not None and drafts is not None:
            g.drafts.copy_(drafts, non_blocking=True)
        g.attn_meta.copy_(self._attn_meta(batch))
        self._plan_attention(g.attn_meta)

    @staticmethod
    def _emitted(gen: list[Any], accepted: torch.Tensor, num: torch.Tensor) -> dict[int, list[int]]:
        acc = accepted[: len(gen)].cpu().tolist()
        counts = num[: len(gen)].cpu().tolist()
        return {s.index: [int(t) for t in row[: int(n)]] for s, row, n in zip(gen, acc, counts)}


def capture_or_fall_back(warm_up: Callable[[], None], capture: Callable[[], Any],
                         min_over_ranks: Callable[[int], int]) -> tuple[Any | None, Exception | None]:
    """The capture fallback, on every rank: ``(captured, error)``.

    ``warm_up()`` runs the step eagerly, collectives included, so its failure is raised, not
    voted on: a rank that failed there and went on to the vote would meet its peers inside
    the step's own collectives (the launcher then stops every worker, as for an eager step).
    ``capture()`` only records, so a rank whose capture raised has run no collective its
    peers wait in: it votes 0 (1 on success) in ``min_over_ranks`` (one all-reduce), and the
    graph is used only when every rank voted 1. ``captured`` is ``capture()``'s result then,
    else ``None`` (every rank runs this step eagerly); ``error`` is this rank's capture
    failure or ``None``.
    """
    warm_up()
    try:
        captured, error = capture(), None
    except Exception as exc:  # noqa: BLE001 - any failure means: this step runs eagerly
        captured, error = None, exc
    if min_over_ranks(0 if error is not None else 1) != 1:
        return None, error
    return captured, error


def graphs_unavailable_reason(engine: Any) -> str | None:
    """Why generation steps of ``engine`` cannot be graphed, or None when they can.

    The decision depends only on the configuration, so every rank takes the same one.
    """
    if engine.device.type != "cuda" or not torch.cuda.is_available():
        return "not on a CUDA device"
    if engine.dp_size > 1:
        return "attention DP (per-rank batch sizes differ)"
    if engine.eagle3 is not None:
        return "EAGLE-3 drafting reads the target's hidden states of every step, which graphed steps do not keep"
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


def eng_strict(engine: Any) -> bool:
    return engine.worker.acceptance == "strict"


def _on_device(batch: Any, device: torch.device) -> Any:
    from ..model.batch import ForwardBatch

    return ForwardBatch(token_ids=batch.token_ids.to(device), positions=batch.positions.to(device),
                        block_tables=batch.block_tables, cache_lens=batch.cache_lens, query_lens=batch.query_lens,
                        logits_rows=batch.logits_rows.to(device))
