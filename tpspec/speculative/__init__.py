"""Speculative decoding core: step metadata (each row's stream offsets), drafts, acceptance.

The interface the runtime codes against::

    from tpspec.sampling import SamplingParams
    from tpspec.speculative import RequestEntry, SpecMetadata, SpecWorker, strict_accept, rejection_sample

    meta = SpecMetadata(max_num_requests, max_draft_len, device=device, mapping=mapping, group=None)
    # once per step, on every rank of the TP group, before the forward:
    meta.prepare(requests=[RequestEntry(request_id, slot_id, sampling_params, is_context), ...], draft_len=D)
    #   rows: requests in this order; context request -> 1 logits row, generation -> D+1 rows
    #   (its last accepted token, then its D drafts); slot_id -1 = padding request (greedy).
    #   RequestEntry(..., position=p, stream=s): p = the output position of the first token
    #   this step emits; s = an unseeded request's stream number (None: numbered per request id).
    #   Fills stable device buffers (params refilled only when the batch changes), gives
    #   every row the Philox offset of the output position it emits (seeded: the user's seed;
    #   unseeded: its own stream, offsets from 2**62; tpspec.sampling.streams), and the
    #   flags meta.is_all_greedy / meta.temperature_only (ANDed over the TP group under
    #   attention DP: one tiny all-reduce in prepare, so prepare is collective there).

    worker = SpecWorker(acceptance="strict")   # or "rejection"
    out = worker.step(target_logits,           # VocabShardedLogits, meta.num_rows rows
                      draft_tokens,            # LongTensor [B, D] in the target vocab (context rows ignored; None if D == 0)
                      meta,
                      draft_probs=None,        # [B, D, V] for gathered rejection sampling; None = drafts are
                                               # deterministic (one-hot q): still lossless
                      draft_logits=None,       # [B, D, shard]: this rank's draft logits columns (sampled drafts)
                      is_warmup=False,         # True during eager CUDA-graph warm-up
                      deferred=False,          # True: no host sync (a CUDA graph); out.decided says
                      filter_plan=None)        #   whether filtered rows were all decided (FilterPlan)
    out.accepted_tokens    # [B, D+1] int64, padded with -1
    out.num_accepted       # [B] int64 in [1, D+1] (context requests: 1)
    out.next_input_tokens  # [B] int64: each request's last emitted token, the next step's first input
    out.target_tokens      # [R] int64 per-row target tokens when computed (strict/forced), else None
    out.decided            # deferred steps with filters: 0-dim bool (False: run the step again, not deferred)

Every rank gets the same tensors. Lower-level pieces:

* ``strict_accept(target_tokens [rows], draft_tokens, num_contexts, batch_size)`` (contexts
  first) and ``accept_from_targets(target [B, D+1], drafts [B, D], draft_lens)``;
* ``rejection_sample(draft_probs|None, draft_token_ids, target_probs, seeds, offsets, draft_lens=None)``
  with ``offsets = meta.request_offsets`` (each request's first emitted position) and
  ``seeds = meta.request_seeds``;
* ``ForcedAcceptance`` (``TPSPEC_FORCE_NUM_ACCEPTED_TOKENS``), used by ``SpecWorker``;
* ``select_draft_tokens(draft_logits, meta, step, sample=False, first_request=0, previous_drafts=None)``
  (``Channel.DRAFT``; sampled drafts on the shards, with the requests' penalties, counting
  ``previous_drafts`` ``[rows, step]`` as output, and filters) and ``DraftLogitsStore`` (each rank's
  columns of the penalised draft logits per KV slot and draft position);
* ``sharded_rejection_sample(...)``: rejection sampling on the shards, filters included (``SpecWorker``
  uses it; ``worker.sampling_stats`` counts rows verified on shards and gathered), and
  ``sharded_rejection_sample_deferred(...)``, the same without a host sync;
* ``meta.draft_offsets(step)``, ``meta.row_sampling()``, ``meta.request_sampling(offsets)``,
  ``meta.draft_penalties(previous_drafts, first_request=0)``.

Attention DP with a vocabulary-sharded LM head (the rows of all ranks stacked into one sharded
head): ``prepare`` describes only this rank's rows, so the logits must be the model's
``StackedRowsLogits``, whose ``argmax`` / ``sample`` / ``gather`` return this rank's rows; a plain
``VocabShardedLogits`` of the stacked rows makes ``select_tokens`` raise on the row-count
mismatch instead of picking wrong tokens.
"""

from .accept import PAD_TOKEN, accept_from_targets, rejection_sample, strict_accept
from .draft import DraftLogitsStore, DraftSelection, select_draft_tokens
from .forced import FORCE_ENV, ForcedAcceptance, read_forced_rate
from .metadata import RequestEntry, SpecMetadata
from .rejection import rejection_filter_plan, sharded_rejection_sample, sharded_rejection_sample_deferred
from .worker import SpecStepOutput, SpecWorker

__all__ = [
    "FORCE_ENV",
    "PAD_TOKEN",
    "DraftLogitsStore",
    "DraftSelection",
    "ForcedAcceptance",
    "RequestEntry",
    "SpecMetadata",
    "SpecStepOutput",
    "SpecWorker",
    "accept_from_targets",
    "read_forced_rate",
    "rejection_filter_plan",
    "rejection_sample",
    "select_draft_tokens",
    "sharded_rejection_sample",
    "sharded_rejection_sample_deferred",
    "strict_accept",
]
