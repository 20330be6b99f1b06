"""Token selection on vocab-sharded logits, every sampling option included.

``sample_tokens`` draws one token per row of a ``VocabShardedLogits`` under a temperature,
streams and top-k / top-p / min-p given directly (checked here). ``select_tokens(sharded_logits,
spec_metadata)`` picks one token per logits row under a step's per-row parameters and
returns the same ``[R]`` int64 tensor on every rank of the exchange's group. Rows with
repetition / presence / frequency penalties are first penalised on each rank's slice,
locally (:mod:`tpspec.sampling.penalties`). Then, from batch facts equal on every rank:

1. all-greedy batch: the exchange argmax (8 bytes a row a rank);
2. no row with a filter: the exchange Gumbel-max with each row's own ``(seed, offset)``
   stream (greedy rows of the batch take the argmax: their temperature is the greedy
   sentinel). No host sync: CUDA graphs capture this path;
3. otherwise :func:`sample_filtered`: rows without a filter as in 2; rows with top-k /
   top-p / min-p from **certified candidates** (below), gathering a row's logits only
   when its candidates cannot decide it.

Candidates. Each rank sends the ``C`` best score keys of each filtered row (``C >= k``,
at least :data:`DEFAULT_CANDIDATES`) through ``KeyExchange.gather_rows``. The best of them
is the row max ``m``; every rank computes the masses of every candidate from its key
(the key holds the score), so:

* top-k is exact from the candidates (every rank sent at least ``k``);
* top-p (with top-k: over the top-k candidates) is exact from them. Without top-k its
  total ``Z`` is the exact int64 sum of every rank's masses (``KeyExchange.sum_rows``), and
  the prefix is certified when it reaches the target at a candidate whose key is at least
  every rank's ``C``-th key: every column above it was sent. An uncertified row retries with
  :data:`RETRY_FACTOR` times more candidates, then gathers its logits (the fallback);
* min-p alone keeps every column with ``q >= floor(min_p * 2**40)``: from the candidates
  when every rank's ``C``-th key has a smaller mass, else by a masked Gumbel-max exchange
  over every column (each rank masks its own columns; one key exchange).

Rows decided from candidates draw there: every rank computes the Gumbel scores of the
surviving candidate columns (the noise is keyed by global column) and takes the same max,
with no further exchange. Every decision reads only what every rank holds alike (the
parameters, the gathered candidates, the summed masses), so every rank runs the same
collectives. :class:`SamplingStats` counts the rows each way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..exchange.base import Channel
from ..keys import (
    EMPTY_KEY,
    SamplingRows,
    column_masses,
    gumbel_scores,
    gumbel_scores_at,
    min_p_threshold,
    pack_keys,
    top_p_fixed,
    top_p_target,
    unpack_indices,
    unpack_keys,
)
from ..validation import check_int, is_int, is_real
from ..vocab_parallel import VocabShardedLogits, use_key_kernels
from .ops import filter_flags, sample_from_logits, scaled_scores, sorted_filter_mask
from .params import TOP_K_DISABLED
from .penalties import RowPenalties, penalized_logits

DEFAULT_CANDIDATES = 64
"""Candidate keys each rank sends per filtered row (raised to the batch's largest top-k)."""
RETRY_FACTOR = 4
"""An uncertified top-p row retries once with this many times more candidates."""
FILTERS_IN_DRAW_KERNEL = True
"""Whether a filtered draw without min-p-only rows runs :func:`tpspec.sampling.kernels_triton.draw_rows`
where the key kernels run: each row's filters read from its own parameters and its final token given in the
draw kernel, rather than some thirty small torch launches around it. On: its GPU test passed on an H100
(``tests/test_key_kernels.py``, the torch path's bits at Llama 3 sizes), and with :data:`PENALIZED_KEYS_KERNEL`
and ``tpspec.sampling.penalties.COUNT_KERNEL`` it took a batch-64 step on Qwen2.5's defaults from 1.04-1.05x
greedy to 1.025x (``docs/benchmarks.md``)."""
PENALIZED_KEYS_KERNEL = True
"""Whether a deferred draw whose rows are all filtered (no plain row, no min-p-only row) applies its
penalties inside the keys kernel (:func:`tpspec.sampling.kernels_triton.penalized_keys`: the penalised
float32 slice is never stored) where the key kernels run. On: its GPU test passed on an H100 (see
:data:`FILTERS_IN_DRAW_KERNEL`)."""


def candidate_bucket(count: int) -> int:
    """``count`` candidates rounded up to a power of two (at least ``DEFAULT_CANDIDATES``): what
    rejection sampling sends and CUDA graphs are keyed by, so that batches with different
    top-k share a count."""
    return 1 << (max(count, DEFAULT_CANDIDATES) - 1).bit_length()


@dataclass
class SamplingStats:
    """How rows were drawn, accumulated over calls.

    ``rows_sharded``: rows decided without gathering their logits (greedy, temperature
    only, and filtered rows decided from candidates or the masked exchange);
    ``rows_retried``: filtered rows that needed the larger candidate set (counted in
    ``rows_sharded`` when it decided them); ``rows_gathered``: rows whose full logits were
    gathered (the certified fallback).
    """

    rows_sharded: int = 0
    rows_retried: int = 0
    rows_gathered: int = 0

    @property
    def fallback_share(self) -> float:
        """The share of rows that were gathered (0 when no row was drawn)."""
        total = self.rows_sharded + self.rows_gathered
        return self.rows_gathered / total if total else 0.0


def _sampling_rows(spec_metadata: Any) -> SamplingRows:
    if isinstance(spec_metadata, SamplingRows):
        return spec_metadata
    getter = getattr(spec_metadata, "row_sampling", None)
    if getter is None:
        raise ValueError(
            f"select_tokens needs a SpecMetadata (with row_sampling()) or a SamplingRows, got {type(spec_metadata).__name__}"
        )
    return getter()


def _filter_rows(name: str, value: Any, rows: int, device: torch.device, dtype: torch.dtype, low: float,
                 high: float | None, *, low_open: bool = False) -> torch.Tensor | None:
    """A filter parameter as a ``[rows]`` tensor (None stays None), its values checked on the
    host: ``ValueError`` naming ``name`` when one is out of range."""
    if value is None:
        return None
    integer = dtype == torch.int64
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.shape[0] != rows:
            raise ValueError(f"{name} must be a scalar or a [{rows}] tensor, got shape {tuple(value.shape)}")
        if integer and value.is_floating_point():
            raise ValueError(f"{name} must hold integers, got {value.dtype}")
        tensor = value.to(device=device, dtype=dtype)
    else:
        ok = is_int(value) if integer else is_real(value)
        if not ok:
            raise ValueError(f"{name} must be {'an int' if integer else 'a float'} or a [{rows}] tensor, got {value!r}")
        tensor = torch.full((rows,), value, dtype=dtype, device=device)
    checked = tensor.to(torch.float64)
    bad = torch.isnan(checked) | (checked <= low if low_open else checked < low)
    if high is not None:
        bad |= checked > high
    if bool(bad.any()):
        span = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
        raise ValueError(f"{name} must lie in {span}, got {tensor[bad].tolist()[:8]}")
    return tensor


def sample_tokens(
    logits: VocabShardedLogits,
    temperature: torch.Tensor | float,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    *,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    channel: int = Channel.TARGET,
    check_values: bool = True,
) -> torch.Tensor:
    """Draws from softmax(logits / T) per row of ``logits`` (a ``VocabShardedLogits``),
    optionally filtered: ``[R]`` int64, equal on every rank.

    ``temperature``: a float or ``[R]`` tensor (rows below the greedy threshold take the
    argmax). ``seeds``/``offsets``: ``[R]`` int64 streams; without them the exchange's step
    counter seeds the rows. ``top_k`` (int >= 1; ``>= vocab_size`` = off), ``top_p`` (in
    (0, 1]; 1 = off), ``min_p`` (in [0, 1]; 0 = off): a scalar for every row, a ``[R]`` tensor,
    or None (off); their meaning is ``docs/determinism.md``'s. The same streams give the same
    tokens at every TP size, on every exchange backend, and equal
    ``tpspec.sampling.ops.sample_from_logits`` on the gathered rows. Rows with a filter are
    drawn from certified candidates (:func:`sample_filtered`; a row gathers its logits only
    when they cannot decide it); without filters the draw is one key exchange
    (``VocabShardedLogits.sample``). Collective over the logits' exchange group.

    Raises ``ValueError`` naming the field for a NaN or infinite temperature or a filter value
    out of range, and for filters on a subclass such as attention DP's stacked rows. Tensor values
    are checked on the host (one sync; not while a CUDA graph is being captured);
    ``check_values=False`` skips the temperature check for callers whose temperatures are already
    validated.
    """
    rows, device = logits.num_rows, logits.local.device
    temperature = logits.temperature_rows(temperature, check_values=check_values)
    filters = {
        "top_k": _filter_rows("top_k", top_k, rows, device, torch.int64, 1, None),
        "top_p": _filter_rows("top_p", top_p, rows, device, torch.float32, 0.0, 1.0, low_open=True),
        "min_p": _filter_rows("min_p", min_p, rows, device, torch.float32, 0.0, 1.0),
    }
    sampling = SamplingRows(temperature, seeds, offsets, **filters)
    if not sampling.has_filters:
        return logits.sample(temperature, seeds, offsets, channel=channel, check_values=False)
    if type(logits) is not VocabShardedLogits:  # every rank alike: the type and the filters are the group's
        raise ValueError(f"top-k / top-p / min-p draws here need a plain VocabShardedLogits, got "
                         f"{type(logits).__name__} (stacked attention-DP rows take their filters through "
                         "tpspec.sampling.select_tokens)")
    logits.exchange.validate_logits_call(logits.local, logits.vocab_offset, logits.vocab_size, sampling, channel)
    return sample_filtered(logits, sampling, channel=channel)


def select_tokens(
    sharded_logits: Any, spec_metadata: Any, *, channel: int = Channel.TARGET, stats: SamplingStats | None = None
) -> torch.Tensor:
    """Tokens for every row of ``sharded_logits`` (a ``VocabShardedLogits``): ``[R]`` int64.

    ``spec_metadata``: a prepared ``tpspec.speculative.SpecMetadata`` (or a ``keys.SamplingRows``)
    whose rows match the logits rows. Penalties (``SamplingRows.penalties``) are applied to
    each rank's slice first (``tpspec.sampling.penalties``). ``stats``: counts the rows drawn
    on shards and gathered. Collective over the logits' exchange group; every rank returns the
    same tokens, the tokens of ``tpspec.sampling.ops.sample_from_logits`` on the full rows.
    Raises ``ValueError`` when the row counts differ.
    """
    rs = _sampling_rows(spec_metadata)
    if rs.num_rows != sharded_logits.num_rows:
        raise ValueError(
            f"the logits have {sharded_logits.num_rows} rows but the sampling metadata describes {rs.num_rows}"
        )
    sharded_logits = penalized_logits(sharded_logits, rs.penalties)
    if rs.is_all_greedy:
        tokens = sharded_logits.argmax(channel=channel)
    elif rs.temperature_only:
        # SamplingParams validated the temperatures: no host check here (CUDA graphs capture this path).
        tokens = sharded_logits.sample(rs.temperature, rs.seeds, rs.offsets, channel=channel, check_values=False)
    elif type(sharded_logits) is not VocabShardedLogits:
        # Stacked attention-DP rows select through their own argmax/sample/gather: full rows here.
        if stats is not None:
            stats.rows_gathered += rs.num_rows
        return sample_from_logits(sharded_logits.gather(), rs.temperature, rs.seeds, rs.offsets, rs.top_k, rs.top_p,
                                  rs.min_p)
    else:
        return sample_filtered(sharded_logits, rs, channel=channel, stats=stats)
    if stats is not None:
        stats.rows_sharded += rs.num_rows
    return tokens


def select_tokens_deferred(
    sharded_logits: Any, spec_metadata: Any, plan: "FilterPlan | None", *, channel: int = Channel.TARGET
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`select_tokens` without a host sync (what a CUDA graph captures): ``(tokens [R]
    int64, decided)``.

    ``plan``: the :class:`FilterPlan` of the rows' filters, known on the host ahead (from the
    requests' parameters, :meth:`FilterPlan.of_params`); None when no row has a filter.
    ``decided``: None when every row is decided (greedy and temperature-only batches), else a
    0-dim bool tensor, equal on every rank: False when a filtered row could not be decided from
    its candidates (its token is then meaningless; the caller runs :func:`select_tokens` for
    the whole step instead, which gives that row its retry and its gathered fallback). Decided
    rows hold exactly the tokens :func:`select_tokens` returns. Collective over the exchange group.
    """
    rs = _sampling_rows(spec_metadata)
    if rs.num_rows != sharded_logits.num_rows:
        raise ValueError(
            f"the logits have {sharded_logits.num_rows} rows but the sampling metadata describes {rs.num_rows}"
        )
    if rs.has_filters:
        if plan is None:
            raise ValueError("rows with filters need their FilterPlan to select without a host sync")
        if type(sharded_logits) is not VocabShardedLogits:
            raise ValueError(f"deferred selection needs the plain VocabShardedLogits of one batch, got "
                             f"{type(sharded_logits).__name__}")
        if rs.seeds is None:
            seeds, offsets = sharded_logits.exchange.unseeded_streams(rs.num_rows)
            rs = dataclasses.replace(rs, seeds=seeds, offsets=offsets)
        tokens, decided = draw_filtered(sharded_logits, rs, plan, channel=channel, penalties=rs.penalties)
        return tokens, decided.all()
    return select_tokens(sharded_logits, rs, channel=channel), None


@dataclass(frozen=True)
class FilterPlan:
    """Which collectives the filtered draw of one batch runs: host facts, equal on every rank.

    ``candidates``: keys each rank sends per row (at least every top-k that is on);
    ``any_plain``: some row has no filter (greedy or temperature only: one Gumbel-max key
    exchange); ``any_filtered``: some sampled row has a filter (the candidate exchange);
    ``any_top_p_total``: a top-p row without top-k (its exact total, one int64 sum);
    ``any_min_p_only``: a min-p row without top-k or top-p (its masked draw, one key exchange).
    A plan may claim more than the rows need (it then only runs a collective more); never less.
    Read from the rows (:meth:`of_rows`, one host sync) or known ahead from the requests'
    parameters (:meth:`of_params`: what a CUDA graph is captured for).
    """

    candidates: int = DEFAULT_CANDIDATES
    any_plain: bool = True
    any_filtered: bool = True
    any_top_p_total: bool = True
    any_min_p_only: bool = True

    @classmethod
    def of_flags(cls, k_on: torch.Tensor, p_on: torch.Tensor, m_on: torch.Tensor, k_value: torch.Tensor,
                 candidates: int = DEFAULT_CANDIDATES) -> "FilterPlan":
        """From host ``[R]`` row flags (filters on, already limited to sampled rows) and ``k_value``
        (top-k where on, else 0): ``candidates`` raised to the largest top-k."""
        filtered = k_on | p_on | m_on
        k_max = int(k_value.max()) if k_value.numel() else 0
        return cls(candidates=max(candidates, k_max), any_plain=bool((~filtered).any()),
                   any_filtered=bool(filtered.any()), any_top_p_total=bool((p_on & ~k_on).any()),
                   any_min_p_only=bool((m_on & ~k_on & ~p_on).any()))

    @classmethod
    def of_rows(cls, rows: SamplingRows, vocab_size: int, device: torch.device,
                candidates: int = DEFAULT_CANDIDATES) -> "FilterPlan":
        """The plan of ``rows`` (one host transfer of their flags)."""
        k_on, p_on, m_on, k_value = _row_filters(rows, vocab_size, device)
        host = torch.stack([k_on.to(torch.int64), p_on.to(torch.int64), m_on.to(torch.int64), k_value], dim=1).cpu()
        return cls.of_flags(host[:, 0] == 1, host[:, 1] == 1, host[:, 2] == 1, host[:, 3], candidates)

    @classmethod
    def of_params(cls, params: Sequence[tuple[float, int, float, float]], vocab_size: int,
                  candidates: int = DEFAULT_CANDIDATES) -> "FilterPlan":
        """The plan of requests with these normalized ``(temperature, top_k, top_p, min_p)``
        (``SamplingParams.normalized()``), without touching a device: the flags come from the
        same float32 values and comparisons the rows' tensors get."""
        t, k, p, m = zip(*params) if params else ((), (), (), ())
        rows = SamplingRows(torch.tensor(t, dtype=torch.float32), top_k=torch.tensor(k, dtype=torch.int64),
                            top_p=torch.tensor(p, dtype=torch.float32), min_p=torch.tensor(m, dtype=torch.float32))
        k_on, p_on, m_on, k_value = _row_filters(rows, vocab_size, torch.device("cpu"))
        return cls.of_flags(k_on, p_on, m_on, k_value, candidates)


def _row_filters(rows: SamplingRows, vocab_size: int, device: torch.device) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k_on, p_on, m_on, k_value)`` ``[R]`` of ``rows``: which filters are on (sampled rows
    only) and the top-k where it is on (else 0)."""
    num_rows = rows.num_rows
    sampled = rows.temperature.to(device=device, dtype=torch.float32) >= rows.greedy_threshold
    k_on, p_on, m_on = filter_flags(num_rows, vocab_size, device, rows.top_k, rows.top_p, rows.min_p)
    k_on, p_on, m_on = k_on & sampled, p_on & sampled, m_on & sampled
    k_value = torch.zeros(num_rows, dtype=torch.int64, device=device)
    if rows.top_k is not None:
        k_value = torch.where(k_on, rows.top_k.to(device, torch.int64), k_value)
    return k_on, p_on, m_on, k_value


def sample_filtered(
    logits: VocabShardedLogits,
    rows: SamplingRows,
    *,
    channel: int = Channel.TARGET,
    candidates: int = DEFAULT_CANDIDATES,
    stats: SamplingStats | None = None,
) -> torch.Tensor:
    """Tokens of ``logits`` (``[R]`` int64, equal on every rank) under ``rows``' temperatures,
    streams and top-k / top-p / min-p filters, drawn on the shards (see the module docstring).

    ``rows``: a :class:`~tpspec.keys.SamplingRows` of ``R`` rows; its filters (``[R]`` tensors
    or None) must be equal on every rank; its penalties are not applied here (``select_tokens``
    does). ``candidates``: keys each rank sends per filtered row at first. Without ``rows.seeds``
    the exchange's step counter seeds the rows (advanced once). Bit for bit the tokens of
    ``tpspec.sampling.ops.sample_from_logits`` on the gathered rows. Collective; reads the
    parameters and the verdicts on the host: :func:`draw_filtered` over every row, then the
    undecided rows once more with ``RETRY_FACTOR`` times the candidates, then gathered.
    """
    check_int("candidates", candidates, low=1)
    ex = logits.exchange
    num_rows, device = logits.num_rows, logits.local.device
    if rows.seeds is None:
        seeds, offsets = ex.unseeded_streams(num_rows)
        rows = dataclasses.replace(rows, seeds=seeds, offsets=offsets)
    stats = stats if stats is not None else SamplingStats()
    plan = FilterPlan.of_rows(rows, logits.vocab_size, device, candidates)
    tokens, decided = draw_filtered(logits, rows, plan, channel=channel)
    left = torch.nonzero(~decided.cpu()).flatten().tolist()  # the call's one sync after the exchange
    stats.rows_sharded += num_rows - len(left)
    if left and plan.candidates < logits.shard_width:
        stats.rows_retried += len(left)
        at = _index(device, left)
        retry = dataclasses.replace(plan, candidates=plan.candidates * RETRY_FACTOR, any_plain=False)
        retried, ok = draw_filtered(_picked(logits, at), _take_rows(rows, at), retry, channel=channel)
        tokens[at] = retried
        ok_host = ok.cpu()
        stats.rows_sharded += int(ok_host.sum())
        left = [r for r, good in zip(left, ok_host.tolist()) if not good]
    if left:
        at = _index(device, left)
        tokens[at] = _gather_and_sample(_picked(logits, at), _take_rows(rows, at))
        stats.rows_gathered += len(left)
    return tokens


# ------------------------------------------------------------------ the filtered rows

def _index(device: torch.device, rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _take_rows(rows: SamplingRows, index: torch.Tensor) -> SamplingRows:
    """The rows at ``index`` (a device tensor) of ``rows`` (filters and streams; no penalties)."""

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(index.device)[index]

    return SamplingRows(part(rows.temperature), part(rows.seeds), part(rows.offsets),
                        greedy_threshold=rows.greedy_threshold, top_k=part(rows.top_k), top_p=part(rows.top_p),
                        min_p=part(rows.min_p))


def _picked(logits: VocabShardedLogits, index: torch.Tensor) -> VocabShardedLogits:
    return VocabShardedLogits(logits.local.detach()[index].contiguous(), logits.vocab_offset, logits.vocab_size,
                              logits.exchange)


def _kernels(device: torch.device) -> Any:
    """:mod:`tpspec.sampling.kernels_triton` when selection on ``device`` runs the Triton key kernels
    (``tpspec.vocab_parallel.use_key_kernels``), else None."""
    if not use_key_kernels(device):
        return None
    from . import kernels_triton

    return kernels_triton


def _fused_penalties(penalties: Any, plan: FilterPlan, kernels: Any, device: torch.device) -> bool:
    """Whether the keys kernel applies ``penalties`` (:data:`PENALIZED_KEYS_KERNEL`): plain
    :class:`RowPenalties` without drafts, tables on the logits' device, and a plan whose every row
    reads the slice only through its keys (no plain row's exchange draw, no min-p-only row's masked
    draw). Host facts only: the same answer on every rank."""
    return (PENALIZED_KEYS_KERNEL and kernels is not None and type(penalties) is RowPenalties
            and (penalties.drafts is None or not penalties.drafts.numel())
            and penalties.counts.tables()[0].device == device and not plan.any_plain and not plan.any_min_p_only)


def _local_keys(logits: VocabShardedLogits, local: torch.Tensor, temperature: torch.Tensor,
                kernels: Any, penalties: RowPenalties | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's score keys ``s = logit / T`` (padding columns: ``EMPTY_KEY``), ``[R, >= W]``
    (columns past ``W`` hold ``EMPTY_KEY``), and with the kernels the best key of each block of
    ``keys_triton.KEY_BLOCK`` columns (else None). ``penalties``: applied to ``local`` first, in the
    same kernel (only where :func:`_fused_penalties` said so)."""
    if penalties is not None:
        penalties.counts.check_covers(logits.vocab_offset, local.shape[1])
        counts, seen = penalties.counts.tables()
        return kernels.penalized_keys(local, logits.vocab_offset, logits.vocab_size, temperature, counts, seen,
                                      penalties.slots, penalties.repetition, penalties.presence, penalties.frequency,
                                      num_slots=penalties.counts.num_slots)
    if kernels is not None and local.shape[0] and local.shape[1]:
        return kernels.keys_triton.score_keys(local, logits.vocab_offset, logits.vocab_size, temperature)
    scores = scaled_scores(local, temperature)
    width = local.shape[1]
    columns = torch.arange(logits.vocab_offset, logits.vocab_offset + width, dtype=torch.int64, device=local.device)
    keys = pack_keys(scores, columns.reshape(1, -1))
    real = (columns < logits.vocab_size).reshape(1, -1)
    return torch.where(real, keys, torch.full_like(keys, EMPTY_KEY)), None


def _candidates(logits: VocabShardedLogits, keys: torch.Tensor, block_max: torch.Tensor | None, count: int,
                channel: int, kernels: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ranked [R, tp * count], floor [R])``: every rank's ``count`` best keys, best first,
    and the largest of the ranks' ``count``-th keys: every column missing from ``ranked`` lies
    below it (``EMPTY_KEY`` when every rank sent all of its columns)."""
    width = logits.shard_width
    count = min(count, width)
    real_keys = keys[:, :width]
    if count >= width:
        local = torch.sort(real_keys, dim=1, descending=True).values
    elif block_max is not None and kernels.keys_triton.top_keys_apply(
            width, logits.last_rank_offset, logits.vocab_size, count):  # alike on every rank
        local = kernels.keys_triton.top_keys(keys, block_max, count)
    else:
        local = torch.topk(real_keys, count, dim=1).values
    gathered = logits.exchange.gather_rows(local.contiguous(), channel=channel)
    if count >= width:
        floor = torch.full((keys.shape[0],), EMPTY_KEY, dtype=torch.int64, device=keys.device)
    else:
        floor = gathered.view(keys.shape[0], -1, count)[:, :, count - 1].max(dim=1).values
    return torch.sort(gathered, dim=1, descending=True).values, floor


def draw_filtered(logits: VocabShardedLogits, rows: SamplingRows, plan: FilterPlan, *,
                  channel: int = Channel.TARGET, penalties: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the filtered draw over every row, without a host sync: ``(tokens [R] int64,
    decided [R] bool)``, equal on every rank.

    Rows without a filter take the exchange's draw (greedy or Gumbel-max); filtered rows are
    decided from ``plan.candidates`` candidate keys a rank (top-k always; top-p when certified;
    min-p from the candidates when every rank's last sent key lies below the threshold, else by
    the masked exchange when ``plan.any_min_p_only``). An undecided row (``decided`` False) holds
    token 0, which means nothing. Decided rows hold the tokens of ``sample_from_logits`` on the gathered rows.
    ``rows.seeds`` must be set; ``plan`` must cover the rows (see :class:`FilterPlan`).
    ``penalties``: the rows' penalties when ``logits`` do not have them applied yet (None: applied
    already, or none), applied here (inside the keys kernel where :func:`_fused_penalties` says so).
    """
    kernels = _kernels(logits.local.device)
    fused = penalties if _fused_penalties(penalties, plan, kernels, logits.local.device) else None
    if fused is None:
        logits = penalized_logits(logits, penalties)
    ex = logits.exchange
    num_rows, device = logits.num_rows, logits.local.device
    local = logits.local.detach()
    temperature = rows.temperature.to(device=device, dtype=torch.float32)
    # The draw kernel reads the filters from the rows' own parameters and gives the final tokens
    # (FILTERS_IN_DRAW_KERNEL): no flag is computed here then, unless a top-p total needs them.
    in_kernel = FILTERS_IN_DRAW_KERNEL and kernels is not None and plan.any_filtered and not plan.any_min_p_only
    flags = []  # _row_filters' four tensors, computed on first use

    def filters() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not flags:
            flags.extend(_row_filters(rows, logits.vocab_size, device))
        return tuple(flags)

    plain_tokens = None
    if plan.any_plain:
        plain = SamplingRows(temperature, rows.seeds, rows.offsets, greedy_threshold=rows.greedy_threshold)
        plain_tokens = ex.argmax_logits(local, logits.vocab_offset, vocab_size=logits.vocab_size, rows=plain,
                                        channel=channel)
    if not plan.any_filtered:
        k_on, p_on, m_on, _ = filters()
        tokens = plain_tokens if plain_tokens is not None else torch.zeros(num_rows, dtype=torch.int64, device=device)
        return tokens, ~(k_on | p_on | m_on)
    seeds, offsets = rows.seeds.to(device), rows.offsets.to(device)
    keys, block_max = _local_keys(logits, local, temperature, kernels, fused)
    width = local.shape[1]
    ranked, floor = _candidates(logits, keys, block_max, plan.candidates, channel, kernels)
    total = None
    scores = None
    if plan.any_top_p_total or plan.any_min_p_only:
        scores, _ = unpack_keys(keys[:, :width])
    if plan.any_top_p_total:
        # Z of the top-p rows without top-k: the exact sum of every rank's masses (0 elsewhere).
        k_on, p_on, _, _ = filters()
        best, _ = unpack_keys(ranked[:, 0])
        needs = (p_on & ~k_on).reshape(-1, 1)
        masses = column_masses(scores, best)
        masses = torch.where((keys[:, :width] != EMPTY_KEY) & needs, masses, torch.zeros_like(masses))
        total = ex.sum_rows(masses.sum(dim=1), channel=channel)
    if in_kernel and ranked.shape[1] <= kernels.MAX_CANDIDATES:
        return kernels.draw_rows(ranked, floor, total, temperature, rows.top_k, rows.top_p, rows.min_p, seeds, offsets,
                                 plain_tokens, vocab_size=logits.vocab_size, greedy_threshold=rows.greedy_threshold)
    k_on, p_on, m_on, _ = filters()
    filtered = k_on | p_on | m_on
    tokens = plain_tokens if plain_tokens is not None else torch.zeros(num_rows, dtype=torch.int64, device=device)

    def param(t: torch.Tensor | None, fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((num_rows,), fill, dtype=dtype, device=device) if t is None else t.to(device, dtype)

    top_k = param(rows.top_k, TOP_K_DISABLED, torch.int64)
    top_p = param(rows.top_p, 1.0, torch.float32)
    min_p = param(rows.min_p, 0.0, torch.float32)
    if kernels is not None and ranked.shape[1] <= kernels.MAX_CANDIDATES:
        drawn, decided = kernels.draw_candidates(ranked, floor, total, top_k, k_on, p_on, m_on, top_p, min_p, seeds,
                                                 offsets)
    else:
        drawn, decided = decide_and_draw(ranked, floor, total, top_k, k_on, p_on, m_on, top_p, min_p, seeds, offsets)
    if plan.any_min_p_only:
        masked = m_on & ~k_on & ~p_on & ~decided
        best, _ = unpack_keys(ranked[:, 0])
        drawn = torch.where(masked, _draw_masked(logits, local, scores, keys[:, :width], best, temperature, min_p,
                                                 seeds, offsets, channel), drawn)
        decided = decided | masked
    decided = decided | ~filtered
    # An undecided row's token is column 0, a valid id: a caller that runs on before it reads
    # ``decided`` (a CUDA graph of chained draft steps) feeds it to the next step's embedding.
    return torch.where(decided, torch.where(filtered, drawn, tokens), torch.zeros_like(tokens)), decided


def decide_and_draw(ranked: torch.Tensor, floor: torch.Tensor, total: torch.Tensor | None, top_k: torch.Tensor,
                    k_on: torch.Tensor, p_on: torch.Tensor, m_on: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, seeds: torch.Tensor,
                    offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered draw of every row from its gathered candidates: ``(drawn [R] int64, decided [R]
    bool)``, in torch (``tpspec.sampling.kernels_triton.draw_candidates`` is the same in one kernel).

    ``ranked`` ``[R, N]``: every rank's candidate keys, best first; ``floor`` ``[R]``: the largest of
    the ranks' last sent keys; ``total``: the exact mass sums of the top-p rows without top-k (None
    when no row needs them); the filters and their flags and the streams ``[R]``. ``drawn``: the
    Gumbel-max over the candidates that survive the cuts; ``decided``: whether the candidates decide
    the row (before the masked min-p draw)."""
    best, _ = unpack_keys(ranked[:, 0])
    off = torch.zeros_like(k_on)
    keep_kp = sorted_filter_mask(ranked, k_on, top_k, p_on, top_p, off, None, total=total)
    keep = keep_kp & sorted_filter_mask(ranked, off, None, off, None, m_on, min_p)
    # Which rows the candidates decide. Every input is equal on every rank, so is every verdict.
    degenerate = ~torch.isfinite(best)
    last_kept = ranked.gather(1, (keep_kp.sum(dim=1) - 1).reshape(-1, 1)).reshape(-1)
    p_certified = _top_p_reached(ranked, keep_kp, best, top_p, total) & (last_kept >= floor)
    floor_value, _ = unpack_keys(floor)
    floor_mass = column_masses(floor_value.reshape(-1, 1), best).reshape(-1)
    floor_mass = torch.where(floor == EMPTY_KEY, torch.full_like(floor_mass, -1), floor_mass)
    m_within = floor_mass < min_p_threshold(min_p)
    only_m = m_on & ~k_on & ~p_on
    decided = degenerate | k_on | (p_on & p_certified) | (only_m & m_within)
    return _draw_from_candidates(ranked, keep, seeds, offsets), decided


def _top_p_reached(ranked: torch.Tensor, keep: torch.Tensor, best: torch.Tensor, top_p: torch.Tensor,
                   total: torch.Tensor | None) -> torch.Tensor:
    """``[R]`` bool: the kept candidates' mass reaches the top-p target (the prefix ends among
    them). Read only on top-p rows without top-k, where ``total`` is set."""
    if total is None:
        return torch.zeros(ranked.shape[0], dtype=torch.bool, device=ranked.device)
    values, _ = unpack_keys(ranked)
    real = ranked != EMPTY_KEY
    masses = column_masses(torch.where(real, values, torch.zeros_like(values)), best)
    kept = torch.where(keep & real, masses, torch.zeros_like(masses)).sum(dim=1)
    return kept >= top_p_target(total, top_p_fixed(top_p))


def _draw_from_candidates(ranked: torch.Tensor, keep: torch.Tensor, seeds: torch.Tensor,
                          offsets: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over the surviving candidates, computed alike on every rank (the noise is
    keyed by global column): no exchange."""
    values, columns = unpack_keys(ranked)
    real = ranked != EMPTY_KEY
    columns = torch.where(real, columns, torch.zeros_like(columns))
    scores = gumbel_scores_at(values, columns, seeds, offsets)
    keys = pack_keys(scores, columns)
    return unpack_indices(torch.where(keep & real, keys, torch.full_like(keys, EMPTY_KEY)).max(dim=1).values)


def _draw_masked(logits: VocabShardedLogits, local: torch.Tensor, scores: torch.Tensor, keys: torch.Tensor,
                 best: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                 offsets: torch.Tensor, channel: int) -> torch.Tensor:
    """Min-p rows whose survivors reach past the candidates: each rank masks its own columns
    (``q >= floor(min_p * 2**40)``), draws its best Gumbel key, one key exchange picks."""
    width = local.shape[1]
    columns = torch.arange(logits.vocab_offset, logits.vocab_offset + width, dtype=torch.int64, device=local.device)
    masses = column_masses(scores, best)
    survive = (masses >= min_p_threshold(min_p).reshape(-1, 1)) & (keys != EMPTY_KEY)
    noisy = gumbel_scores(local, columns, temperature, seeds, offsets,
                          column_range=(logits.vocab_offset, logits.vocab_offset + width - 1))
    local_keys = torch.where(survive, pack_keys(noisy, columns.reshape(1, -1)), torch.full_like(keys, EMPTY_KEY))
    return unpack_indices(logits.exchange.max_keys(local_keys.max(dim=1).values.contiguous(), channel=channel))


def _gather_and_sample(logits: VocabShardedLogits, rows: SamplingRows) -> torch.Tensor:
    """The certified fallback: gather these rows' logits and draw them in full (the reference)."""
    device = logits.local.device
    k_on, p_on, m_on, _ = _row_filters(rows, logits.vocab_size, device)

    def param(t: torch.Tensor | None, on: torch.Tensor, off: float, dtype: torch.dtype) -> torch.Tensor:
        value = torch.full(on.shape, off, dtype=dtype, device=device)
        return value if t is None else torch.where(on, t.to(device, dtype), value)

    return sample_from_logits(logits.gather(), rows.temperature.to(device, torch.float32), rows.seeds.to(device),
                              rows.offsets.to(device), param(rows.top_k, k_on, TOP_K_DISABLED, torch.int64),
                              param(rows.top_p, p_on, 1.0, torch.float32), param(rows.min_p, m_on, 0.0, torch.float32))
