"""How many KV pages an engine gets, and from what (one decision, the same on every rank).

* ``kv_cache_bytes`` (any device): that many bytes of pages per rank.
* CUDA, ``gpu_memory_utilization`` (default 0.9): the engine may use that share of its GPU
  (split evenly between ranks that share one). Weights and the engine's per-slot buffers are
  already allocated (buffers allocated on first use, the penalties' occurrence counts, are
  held back by their size); one profiled step of ``max_num_tokens`` tokens through every
  paged model, with the heaviest token selection (filters, penalties, logprobs) on as many
  logits rows as a full speculative batch has, measures the activations, and the same amount
  again is held back for the CUDA-graph pool; the rest goes to pages.
* CPU without ``kv_cache_bytes``: pages for ``min(max_batch_size, CPU_FULL_LENGTH_REQUESTS)``
  requests of ``max_seq_len`` (requests take pages as they grow, so many more shorter requests
  run at once), at most ``CPU_DEFAULT_KV_BYTES`` (a long-context model would otherwise ask for
  more memory than the host has; give ``kv_cache_bytes`` for more).

The ranks then take the minimum page count (one all-reduce), so the scheduling decisions
(admission, preemption, prefix-cache hits), which depend on it, agree everywhere.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed as D
from ..model.batch import ForwardBatch, pages_needed
from .pages import plan_num_pages

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
FREE_MEMORY_HEADROOM = 256 * 1024 * 1024
CPU_DEFAULT_KV_BYTES = 4 << 30
CPU_FULL_LENGTH_REQUESTS = 8


@dataclass(frozen=True)
class KVPlan:
    """The paged cache of one engine on one rank: ``num_pages`` pages of ``page_size`` tokens
    for requests (plus ``num_scratch_pages`` for padding rows), ``page_bytes`` per page over
    all paged models, and where the size came from (``source``)."""

    num_pages: int
    page_size: int
    num_scratch_pages: int
    page_bytes: int
    source: str

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return (self.num_pages + self.num_scratch_pages) * self.page_bytes


def plan_kv_cache(config: Any, models: list[Any], group: Any, device: torch.device, *,
                  reserve_bytes: int = 0) -> KVPlan:
    """Size the paged cache of ``models`` (all of an engine's paged models; they share the
    pages) for ``config`` (:class:`~tpspec.runtime.config.EngineConfig`). ``reserve_bytes``: on
    CUDA, memory the engine may still allocate outside the pages (held back from them).
    Collective over ``group``. Raises ``ValueError`` when no page fits."""
    page_size = config.page_size
    page_bytes = sum(m.page_bytes(page_size) for m in models)
    k = config.num_draft_tokens
    scratch = scratch_pages(config)
    if config.kv_cache_bytes is not None:
        pages = plan_num_pages(page_bytes=page_bytes, kv_cache_bytes=config.kv_cache_bytes) - scratch
        source = f"kv_cache_bytes={config.kv_cache_bytes}"
    elif device.type == "cuda":
        util = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        free, detail = _gpu_bytes_for_pages(config, models, util, device, reserve_bytes)
        if free < page_bytes:
            raise ValueError(f"gpu_memory_utilization={util:g} leaves no room for a KV page of {page_bytes} bytes "
                             f"({detail}); raise gpu_memory_utilization, free the GPU or give kv_cache_bytes")
        pages = plan_num_pages(page_bytes=page_bytes, free_bytes=free) - scratch
        source = f"gpu_memory_utilization={util:g} ({free / 2**30:.2f} GiB left for pages: {detail})"
    else:
        full = min(config.max_batch_size, CPU_FULL_LENGTH_REQUESTS)
        pages = full * pages_needed(config.max_seq_len - 1 + k, page_size)
        source = f"the CPU default: {full} requests of max_seq_len={config.max_seq_len}"
        if (pages + scratch) * page_bytes > CPU_DEFAULT_KV_BYTES:
            pages = CPU_DEFAULT_KV_BYTES // page_bytes - scratch
            source = f"the CPU default of {CPU_DEFAULT_KV_BYTES >> 30} GiB"
    if pages < 1:
        raise ValueError(f"the KV cache budget ({source}) leaves no page for requests after the "
                         f"{scratch} scratch page(s) of padding rows")
    if D.group_size(group) > 1:
        on = device if D.group_backend(group) == "nccl" else torch.device("cpu")
        t = torch.tensor([pages], dtype=torch.int64, device=on)
        D.all_reduce_(t, "min", group)
        pages = int(t.item())
    return KVPlan(pages, page_size, scratch, page_bytes, source)


def scratch_pages(config: Any) -> int:
    """Pages kept for padding rows: one padded request of ``K + 1`` tokens."""
    return pages_needed(config.num_draft_tokens + 1, config.page_size)


def _ranks_per_gpu(config: Any) -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", config.tp_size))
    return max(1, -(-min(local, config.tp_size) // max(1, torch.cuda.device_count())))


@torch.inference_mode()
def _gpu_bytes_for_pages(config: Any, models: list[Any], util: float, device: torch.device,
                         reserve_bytes: int = 0) -> tuple[int, str]:
    """Bytes this rank may give to pages: its share of ``util`` of the GPU, less the memory
    torch holds after one profiled step (weights + activations), a graph reserve equal to
    the activations and ``reserve_bytes``, and at most what the device has free; with the
    figures behind it, for the start-up summary and errors."""
    torch.cuda.synchronize(device)
    # An engine this process made before (closed, or dropped but still in a reference cycle) must not
    # count as this one's memory.
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    for model in models:
        _profile_step(model, config)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    for model in models:
        model.caches = []  # the profiling pages go; the real ones come next
    torch.cuda.empty_cache()
    activations = max(0, peak - before)
    free, total = torch.cuda.mem_get_info(device)
    share = util * total / _ranks_per_gpu(config)
    reserve = activations if config.use_cuda_graphs else 0
    budget = share - peak - reserve - reserve_bytes
    gib = 2**30
    detail = (f"share {share / gib:.2f} GiB of {total / gib:.2f}, held by this process {peak / gib:.2f} GiB, "
              f"graph reserve {reserve / gib:.2f} GiB, buffers on first use {reserve_bytes / gib:.2f} GiB, "
              f"free on the device {free / gib:.2f} GiB")
    return int(max(0, min(budget, free - FREE_MEMORY_HEADROOM))), detail


def _profile_step(model: Any, config: Any) -> None:
    """One forward of ``max_num_tokens`` tokens (one sequence) with logits for as many rows
    as a full speculative batch has, and the heaviest selection on them: the largest step the
    engine will run."""
    n = config.max_num_tokens
    pages = pages_needed(n, config.page_size)
    model.allocate_kv_cache(pages, config.page_size)
    dev = model.device
    rows = min(n, config.max_batch_size * (config.num_draft_tokens + 1))
    batch = ForwardBatch(torch.zeros(n, dtype=torch.int64, device=dev), torch.arange(n, device=dev),
                         [list(range(pages))], [0], [n],
                         logits_rows=torch.arange(n - rows, n, dtype=torch.int64, device=dev))
    if getattr(model, "aux_hidden_width", 0):  # an EAGLE-3 head: a catch-up forward over target hidden states
        logits, _ = model(batch, torch.zeros(n, model.aux_hidden_width, dtype=model.dtype, device=dev))
    else:
        logits = model(batch)
    _profile_selection(logits)


def _profile_selection(logits: Any) -> None:
    """The selection a step may run on ``logits``, with every row penalised, filtered (top-k,
    top-p and min-p, so that every collective of the filtered draw runs) and asking for the most
    logprobs: its temporaries are the largest of any step's (collective, on every rank alike)."""
    from ..sampling.penalties import OccurrenceCounts, RowPenalties, penalized_logits
    from ..sampling.select import FilterPlan, draw_filtered
    from ..keys import SamplingRows
    from ..vocab_parallel import MAX_TOP_LOGPROBS, VocabShardedLogits

    if type(logits) is not VocabShardedLogits:  # attention DP's stacked rows: no penalties, no filters there
        logits.argmax()
        return
    rows, dev = logits.num_rows, logits.local.device
    counts = OccurrenceCounts(1, vocab_offset=logits.vocab_offset, width=logits.shard_width, device=dev)

    def full(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=dev)

    penalised = penalized_logits(logits, RowPenalties(counts, full(0, torch.int64), None, full(1.1, torch.float32),
                                                      full(0.5, torch.float32), full(0.5, torch.float32)))
    streams = torch.arange(rows, dtype=torch.int64, device=dev)
    sampling = SamplingRows(full(1.0, torch.float32), streams, streams, top_k=full(20, torch.int64),
                            top_p=full(0.8, torch.float32), min_p=full(0.05, torch.float32))
    tokens, _ = draw_filtered(penalised, sampling, FilterPlan())
    logits.logprobs(tokens, top_n=min(MAX_TOP_LOGPROBS, logits.vocab_size))
