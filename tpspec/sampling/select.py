"""Token selection on vocab-sharded logits under a step's sampling parameters.

``select_tokens(sharded_logits, spec_metadata)`` picks one token per logits row and
returns the same ``[R]`` int64 tensor on every rank of the exchange's group. The path
is chosen from batch-level flags that are equal on every rank (the metadata ANDs them
across the TP group under attention DP), so every rank runs the same collectives:

1. all-greedy batch: the exchange argmax (8 bytes a row a rank);
2. temperature-only batch (every sampled row has only a temperature): the exchange
   Gumbel-max with each row's own ``(seed, offset)`` stream — greedy rows of the batch
   still take the argmax (their temperature is the greedy sentinel);
3. otherwise: gather the full logits (one all-gather) and sample them with
   :func:`tpspec.sampling.ops.sample_from_logits`, whose Gumbel noise is the same as
   the sharded path's, so temperature-only rows get the same token either way.

Rows with repetition / presence / frequency penalties are first penalised on each rank's
slice, locally (:mod:`tpspec.sampling.penalties`), then take the same paths.
"""

from __future__ import annotations

from typing import Any

import torch

from ..exchange.base import Channel
from ..keys import SamplingRows
from .ops import sample_from_logits
from .penalties import RowPenalties, penalized_logits


def _sampling_rows(spec_metadata: Any) -> SamplingRows:
    if isinstance(spec_metadata, SamplingRows):
        return spec_metadata
    getter = getattr(spec_metadata, "row_sampling", None)
    if getter is None:
        raise ValueError(
            f"select_tokens needs a SpecMetadata (with row_sampling()) or a SamplingRows, got {type(spec_metadata).__name__}"
        )
    return getter()


def select_tokens(sharded_logits: Any, spec_metadata: Any, *, channel: int = Channel.TARGET) -> torch.Tensor:
    """Tokens for every row of ``sharded_logits`` (a ``VocabShardedLogits``): ``[R]`` int64.

    ``spec_metadata``: a prepared ``tpspec.speculative.SpecMetadata`` (or a ``keys.SamplingRows``)
    whose rows match the logits rows. Penalties (``SamplingRows.penalties``) are applied to
    each rank's slice first (``tpspec.sampling.penalties``). Collective over the logits' exchange group;
    every rank returns the same tokens. Raises ``ValueError`` when the row counts differ.
    """
    rs = _sampling_rows(spec_metadata)
    if rs.num_rows != sharded_logits.num_rows:
        raise ValueError(
            f"the logits have {sharded_logits.num_rows} rows but the sampling metadata describes {rs.num_rows}"
        )
    sharded_logits = penalized_logits(sharded_logits, rs.penalties)
    if rs.is_all_greedy:
        return sharded_logits.argmax(channel=channel)
    if rs.temperature_only:
        # SamplingParams validated the temperatures: no host check here (CUDA graphs capture this path).
        return sharded_logits.sample(rs.temperature, rs.seeds, rs.offsets, channel=channel, check_values=False)
    full = sharded_logits.gather()
    return sample_from_logits(
        full,
        rs.temperature,
        rs.seeds,
        rs.offsets,
        rs.top_k,
        rs.top_p,
        rs.min_p,
        needs_reproducible_streams=rs.any_seeded,
    )
