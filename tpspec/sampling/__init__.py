"""Sampling: request parameters, per-request Philox streams, full-logit ops, selection on shards.

Public names:

* :class:`SamplingParams` (``params``): per-request ``temperature, top_k, top_p,
  min_p, seed``, penalties and ``logprobs``, validated and normalized.
* ``streams``: where each draw of a request lives (its stream and the output position
  it decides: :data:`SLOT_SPAN`, the lanes, :class:`StreamAllocator`) and :func:`uniforms`.
* ``ops``: :func:`sample_from_logits`, :func:`filtered_probs`, :func:`greedy_tokens`
  on full logits: the reference every draw follows (``docs/determinism.md``).
* ``select``: :func:`sample_tokens` (a temperature, streams and top-k / top-p / min-p given
  directly), :func:`select_tokens` (a step's per-row parameters) and :func:`sample_filtered`
  on ``VocabShardedLogits``, with :class:`SamplingStats`; the rows it draws are a
  ``keys.SamplingRows``. Without a host sync (CUDA graphs): :func:`select_tokens_deferred` with
  a :class:`FilterPlan`. ``VocabShardedLogits`` itself offers the reductions (argmax, the
  unfiltered Gumbel-max ``sample``, logprobs, gather) and imports nothing from this layer.
* ``penalties``: :class:`OccurrenceCounts` (a rank's per-slot counts of its columns),
  :func:`apply_penalties` (repetition / presence / frequency on a slice or a full row).
* ``controls``: :class:`RowControls` (logit bias, penalties and token bitmasks of a step's
  rows, applied by each rank to its own columns): structured outputs, ``logit_bias``,
  ``allowed_token_ids``, ``bad_words`` (:class:`StructuredOutputsParams` in ``params``).
* ``logprobs``: :class:`Logprob` (vLLM's) and :func:`emitted_logprobs` (raw log-softmax of the
  emitted tokens and the top N with their ranks, per step; computed on the shards by
  ``VocabShardedLogits.logprobs``): :func:`step_logprobs` on the device (no host sync) and
  :func:`logprob_dicts` on the host.
"""

from .ops import filtered_logits, filtered_probs, greedy_tokens, keep_mask, sample_from_logits
from .logprobs import Logprob, emitted_logprobs, logprob_dicts, step_logprobs
from .params import GREEDY_SENTINEL_TEMPERATURE, TOP_K_DISABLED, SamplingParams, StructuredOutputsParams
from .controls import RowControls
from .penalties import OccurrenceCounts, apply_penalties
from ..keys import SamplingRows
from .select import FilterPlan, SamplingStats, sample_filtered, sample_tokens, select_tokens, select_tokens_deferred
from .streams import SLOT_SPAN, UNSEEDED_OFFSET_BASE, StreamAllocator, position_offset, uniforms

__all__ = [
    "FilterPlan",
    "GREEDY_SENTINEL_TEMPERATURE",
    "Logprob",
    "OccurrenceCounts",
    "SLOT_SPAN",
    "TOP_K_DISABLED",
    "UNSEEDED_OFFSET_BASE",
    "SamplingParams",
    "SamplingRows",
    "SamplingStats",
    "RowControls",
    "StructuredOutputsParams",
    "StreamAllocator",
    "apply_penalties",
    "filtered_logits",
    "emitted_logprobs",
    "filtered_probs",
    "greedy_tokens",
    "keep_mask",
    "logprob_dicts",
    "sample_filtered",
    "sample_from_logits",
    "sample_tokens",
    "select_tokens",
    "position_offset",
    "select_tokens_deferred",
    "step_logprobs",
    "uniforms",
]
