"""Per-step batch state of one-model speculative decoding.

``SpecMetadata.prepare(requests, draft_len)`` runs once per step, before the forward.
It scans the requests' sampling parameters (only when the batch changed), fills
stable device buffers (per request and per logits row), gives every row the Philox
offset of the output position it emits (``tpspec.sampling.streams``) and computes the batch flags
that choose code paths: ``is_all_greedy`` and ``temperature_only``. Under attention
DP every rank of a TP group holds different requests, so the flags are ANDed across
the group (one small all-reduce per step) before any path that runs a collective is
chosen; without attention DP every rank sees the same batch and no collective runs.

Row layout: requests in the given order; a context request owns 1 logits row, a
generation request ``draft_len + 1`` rows (its last accepted token then its drafts).
A ``slot_id`` of -1 marks a padding request (greedy, no stream).

Logit controls (``tpspec.sampling.controls``): the requests' logit biases are laid out per row
with the parameters; the step's token bitmask (structured outputs, allowed token ids, bad
words: which tokens each row may choose, computed by the engine from the drafts it verifies)
is given with :meth:`SpecMetadata.set_token_bitmask` after ``prepare``, and both reach the
selection through ``row_sampling`` (``SamplingRows.penalties``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from .. import distributed as D
from ..mapping import Mapping
from ..validation import is_int
from ..sampling.params import GREEDY, SamplingParams
from ..keys import SamplingRows
from ..sampling.controls import RowControls, row_bias
from ..sampling.penalties import OccurrenceCounts, RowPenalties, preceding_drafts
from ..sampling.streams import (
    DRAFT_LANE,
    SLOT_SPAN,
    TARGET_LANE,
    StreamAllocator,
    check_position,
    check_stream,
)


@dataclass(frozen=True)
class RequestEntry:
    """One request of a step, as ``prepare`` takes it.

    ``slot_id``: its KV slot, or -1 for a padding request (always greedy, no stream);
    ``params``: its :class:`SamplingParams` (None = greedy); ``is_context``: a context
    request owns one logits row, a generation request ``draft_len + 1``.
    ``position``: the output position of the first token this step emits (the number of
    tokens the request generated before it): row ``i`` draws the noise of position
    ``position + i``, draft step ``j`` that of ``position + j``. ``stream``: an unseeded
    request's stream number in ``[0, 2**63)``, unique per request (the engine gives its
    admission number); None: the metadata numbers each new request id itself (see
    ``tpspec.sampling.streams``). Neither field is part of the batch's parameters (equality
    ignores them). Checked and normalized when built (raises ``ValueError`` naming the request).
    """

    request_id: Hashable
    slot_id: int
    params: SamplingParams | None = None
    is_context: bool = False
    position: int = field(default=0, compare=False)
    stream: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        params = GREEDY if self.params is None else self.params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {self.request_id!r}: sampling_params must be SamplingParams or None, got "
                             f"{type(params).__name__}")
        if not is_int(self.slot_id):
            raise ValueError(f"request {self.request_id!r}: slot_id must be an int, got {self.slot_id!r}")
        if self.slot_id == -1:
            params = GREEDY  # padding requests never sample
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "is_context", bool(self.is_context))
        object.__setattr__(self, "position", check_position(f"request {self.request_id!r}: position", self.position))
        object.__setattr__(self, "stream", check_stream(f"request {self.request_id!r}: stream", self.stream))


class SpecMetadata:
    """Batch state for one step. Build once, ``prepare`` every step.

    ``max_num_requests``: most requests a step may hold; ``max_draft_len``: most
    draft tokens a generation request carries; ``device``: where the buffers live;
    ``mapping``: this rank's :class:`Mapping` (attention DP turns on the group sync and
    gives each rank its own range of unseeded stream numbers); ``group``: the group the flags are
    ANDed over (default: the TP group under attention DP, none otherwise);
    ``max_num_slots``: KV slots (default ``max_num_requests``). ``occurrences``: this rank's
    :class:`~tpspec.sampling.penalties.OccurrenceCounts` over those slots, needed once a
    request has penalties (its owner resets and updates it).

    Tensors (views of stable buffers, valid until the next ``prepare``):
    ``request_*`` ``[B]`` and ``row_*`` ``[R]``; see the properties below.
    """

    def __init__(
        self,
        max_num_requests: int,
        max_draft_len: int,
        *,
        device: str | torch.device = "cpu",
        mapping: Mapping | None = None,
        group: Any = None,
        max_num_slots: int | None = None,
        occurrences: OccurrenceCounts | None = None,
    ) -> None:
        if not isinstance(max_num_requests, int) or max_num_requests < 1:
            raise ValueError(f"max_num_requests must be a positive int, got {max_num_requests!r}")
        if not isinstance(max_draft_len, int) or max_draft_len < 0:
            raise ValueError(f"max_draft_len must be an int >= 0, got {max_draft_len!r}")
        self.max_num_requests = max_num_requests
        self.max_draft_len = max_draft_len
        self.max_num_rows = max_num_requests * (max_draft_len + 1)
        self.device = torch.device(device)
        self.mapping = mapping or Mapping()
        adp = self.mapping.enable_attention_dp
        self.group = group if group is not None else (D.tp_group() if adp else None)
        self.sync_flags = adp or group is not None
        self.num_slots = max_num_slots if max_num_slots is not None else max_num_requests
        if self.num_slots < 1:
            raise ValueError(f"max_num_slots must be >= 1, got {self.num_slots}")
        self.streams = StreamAllocator(partition=self.mapping.tp_rank if adp else 0)
        self.occurrences = occurrences

        B, R, dev = max_num_requests, self.max_num_rows, self.device
        f32, i64 = torch.float32, torch.int64
        # Per request.
        self._req_temperature = torch.zeros(B, dtype=f32, device=dev)
        self._req_top_k = torch.zeros(B, dtype=i64, device=dev)
        self._req_top_p = torch.ones(B, dtype=f32, device=dev)
        self._req_min_p = torch.zeros(B, dtype=f32, device=dev)
        self._req_slot = torch.zeros(B, dtype=i64, device=dev)
        self._req_is_context = torch.zeros(B, dtype=torch.bool, device=dev)
        self._req_row_start = torch.zeros(B, dtype=i64, device=dev)
        self._req_draft_len = torch.zeros(B, dtype=i64, device=dev)
        # Seeds and offsets change every step: one buffer, refreshed from a pinned host copy at once.
        self._req_streams = torch.zeros(2, B, dtype=i64, device=dev)
        self._req_seed, self._req_offset = self._req_streams[0], self._req_streams[1]
        self._streams_host = torch.zeros(2, B, dtype=i64, pin_memory=self.device.type == "cuda")
        self._streams_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._req_row_index = torch.zeros(B, max_draft_len + 1, dtype=i64, device=dev)
        self._req_repetition = torch.ones(B, dtype=f32, device=dev)
        self._req_presence = torch.zeros(B, dtype=f32, device=dev)
        self._req_frequency = torch.zeros(B, dtype=f32, device=dev)
        # Per row.
        self._row_temperature = torch.zeros(R, dtype=f32, device=dev)
        self._row_top_k = torch.zeros(R, dtype=i64, device=dev)
        self._row_top_p = torch.ones(R, dtype=f32, device=dev)
        self._row_min_p = torch.zeros(R, dtype=f32, device=dev)
        self._row_request = torch.zeros(R, dtype=i64, device=dev)
        self._row_position = torch.zeros(R, dtype=i64, device=dev)
        self._row_seed = torch.zeros(R, dtype=i64, device=dev)
        self._row_offset = torch.zeros(R, dtype=i64, device=dev)
        self._row_slot = torch.full((R,), -1, dtype=i64, device=dev)
        self._row_repetition = torch.ones(R, dtype=f32, device=dev)
        self._row_presence = torch.zeros(R, dtype=f32, device=dev)
        self._row_frequency = torch.zeros(R, dtype=f32, device=dev)

        self.entries: list[RequestEntry] = []
        self.draft_len = 0
        self.num_rows = 0
        self.local_is_all_greedy = True
        self.local_temperature_only = True
        self.local_any_penalties = False  # no group sync: penalties are applied locally, no path depends on it
        self.local_any_controls = False  # likewise: logit bias and token masks are local arithmetic
        self.token_bitmask: torch.Tensor | None = None  # [R, words] int32 of this step, or None (every token)
        self._req_bias: list[dict[int, float] | None] = []
        self._row_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.is_all_greedy = True
        self.temperature_only = True
        self.param_refills = 0  # how often the parameter buffers were rewritten (tests, metrics)
        self._param_key: tuple | None = None
        self._prepared = False

    # ------------------------------------------------------------------ per step
    def prepare(self, requests: Sequence[tuple], draft_len: int) -> "SpecMetadata":
        """Set up one step. ``requests``: :class:`RequestEntry` objects (a tuple of the four
        fields is taken as one). ``draft_len``: drafts per
        generation request this step (``0 .. max_draft_len``).

        Call once per step, on every rank of the group, in the same order (an unseeded
        request without an explicit ``stream`` is numbered at its first step). Under attention
        DP this is collective over the group.
        Raises ``ValueError`` for bad input (nothing is changed then); under attention DP
        the ranks still meet in the flag sync, so a bad batch on one rank makes every rank
        raise (the others a ``RuntimeError``, numbering no stream either) instead of
        leaving them waiting.
        """
        error: Exception | None = None
        try:
            self._prepare_local(requests, draft_len)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = exc
        group_ok = self._sync_flags(ok=error is None)
        if error is not None:
            raise error
        if not group_ok:
            raise RuntimeError("SpecMetadata.prepare failed on another rank of the group (bad requests there)")
        self._fill_streams()  # only once every rank is good: a failed step numbers no stream
        self.token_bitmask = None  # each step gives its own (set_token_bitmask)
        self._prepared = True
        return self

    def _prepare_local(self, requests: Sequence[tuple], draft_len: int) -> None:
        if not is_int(draft_len) or not 0 <= draft_len <= self.max_draft_len:
            raise ValueError(f"draft_len={draft_len!r} is out of range [0, {self.max_draft_len}]")
        if len(requests) > self.max_num_requests:
            raise ValueError(f"{len(requests)} requests exceed max_num_requests={self.max_num_requests}")
        entries = [self._entry(r) for r in requests]
        key = (draft_len, tuple(entries))
        if key != self._param_key:
            self._fill_params(entries, draft_len)
            self._param_key = key
        self.entries = entries  # positions and streams change every step (not part of the key)

    @staticmethod
    def _entry(request: Any) -> RequestEntry:
        if isinstance(request, RequestEntry):
            return request
        if not isinstance(request, (tuple, list)) or not 4 <= len(request) <= 6:
            raise ValueError(f"each request must be a RequestEntry (or its fields request_id, slot_id, "
                             f"sampling_params, is_context[, position[, stream]] as a tuple), got {request!r}")
        return RequestEntry(*request)

    def _fill_params(self, entries: list[RequestEntry], draft_len: int) -> None:
        rows = [1 if e.is_context else draft_len + 1 for e in entries]
        num_rows = sum(rows)
        slots = [e.slot_id for e in entries if e.slot_id != -1]
        if len(set(slots)) != len(slots):
            raise ValueError("two requests of one step share a slot_id")
        for e in entries:
            if e.slot_id != -1 and not 0 <= e.slot_id < self.num_slots:
                raise ValueError(f"slot_id={e.slot_id} of request {e.request_id!r} is out of range [0, {self.num_slots})")
        if any(e.params.has_penalties for e in entries):
            if self.occurrences is None:
                raise ValueError("a request has penalties but this SpecMetadata has no occurrence counts "
                                 "(SpecMetadata(..., occurrences=OccurrenceCounts(...)))")
            if self.mapping.enable_attention_dp:  # the rows of other ranks' requests would need their counts
                raise ValueError("penalties are not supported with attention DP")
        if self.mapping.enable_attention_dp and any(e.params.has_logit_controls for e in entries):
            raise ValueError("logit controls (structured outputs, logit_bias, allowed_token_ids, bad_words) are not "
                             "supported with attention DP")
        self.entries = entries
        self.draft_len = draft_len
        self.num_rows = num_rows
        B = len(entries)
        norm = [e.params.normalized() for e in entries]
        starts, start = [], 0
        for n in rows:
            starts.append(start)
            start += n
        row_req = [b for b, n in enumerate(rows) for _ in range(n)]
        row_pos = [i for n in rows for i in range(n)]
        dev = self.device

        def put(buf: torch.Tensor, values: list, dtype: torch.dtype) -> None:
            if values:
                buf[: len(values)].copy_(torch.tensor(values, dtype=dtype), non_blocking=False)

        f32, i64 = torch.float32, torch.int64
        put(self._req_temperature, [n[0] for n in norm], f32)
        put(self._req_top_k, [n[1] for n in norm], i64)
        put(self._req_top_p, [n[2] for n in norm], f32)
        put(self._req_min_p, [n[3] for n in norm], f32)
        put(self._req_slot, [e.slot_id for e in entries], i64)
        put(self._req_is_context, [e.is_context for e in entries], torch.bool)
        put(self._req_row_start, starts, i64)
        put(self._req_repetition, [e.params.repetition_penalty for e in entries], f32)
        put(self._req_presence, [e.params.presence_penalty for e in entries], f32)
        put(self._req_frequency, [e.params.frequency_penalty for e in entries], f32)
        # Padding requests verify nothing: they emit one (ignored) token.
        put(self._req_draft_len, [0 if e.is_context or e.slot_id == -1 else draft_len for e in entries], i64)
        put(self._row_temperature, [norm[b][0] for b in row_req], f32)
        put(self._row_top_k, [norm[b][1] for b in row_req], i64)
        put(self._row_top_p, [norm[b][2] for b in row_req], f32)
        put(self._row_min_p, [norm[b][3] for b in row_req], f32)
        put(self._row_request, row_req, i64)
        put(self._row_position, row_pos, i64)
        put(self._row_slot, [entries[b].slot_id for b in row_req], i64)
        put(self._row_repetition, [entries[b].params.repetition_penalty for b in row_req], f32)
        put(self._row_presence, [entries[b].params.presence_penalty for b in row_req], f32)
        put(self._row_frequency, [entries[b].params.frequency_penalty for b in row_req], f32)
        if B:
            # Row of position i of request b (context requests repeat their one row).
            positions = torch.arange(self.max_draft_len + 1, dtype=i64).reshape(1, -1)
            limit = torch.tensor([n - 1 for n in rows], dtype=i64).reshape(-1, 1)
            index = torch.tensor(starts, dtype=i64).reshape(-1, 1) + torch.minimum(positions, limit)
            self._req_row_index[:B].copy_(index.to(dev))
        self.local_is_all_greedy = all(e.params.is_greedy for e in entries)
        self.local_temperature_only = all(e.params.is_temperature_only for e in entries)
        self.local_any_penalties = any(e.params.has_penalties for e in entries)
        self.local_any_controls = any(e.params.has_logit_controls for e in entries)
        self._req_bias = [e.params.logit_bias for e in entries]
        self._row_bias = row_bias([self._req_bias[b] for b in row_req], dev)
        self.param_refills += 1

    def _fill_streams(self) -> None:
        streams = self.streams.streams([(e.request_id, e.slot_id == -1, e.params.seed_int64, e.stream)
                                        for e in self.entries])
        if not streams:
            return
        B, R = len(streams), self.num_rows
        if self._streams_copied is not None:
            self._streams_copied.synchronize()  # the previous step's copy has left the host buffer
        host = self._streams_host.numpy()
        host[0, :B] = [s for s, _ in streams]
        # The target lane of the request's first emitted position; padding keeps its marker.
        host[1, :B] = [base if e.slot_id == -1 else base + e.position * SLOT_SPAN + TARGET_LANE
                       for (_, base), e in zip(streams, self.entries)]
        self._req_streams.copy_(self._streams_host, non_blocking=True)
        if self._streams_copied is not None:
            self._streams_copied.record()
        row_req = self._row_request[:R]
        self._row_seed[:R].copy_(self._req_seed[:B][row_req])
        # Target row i of a request emits position ``position + i``.
        self._row_offset[:R].copy_(self._req_offset[:B][row_req] + self._row_position[:R] * SLOT_SPAN)

    def _sync_flags(self, ok: bool = True) -> bool:
        """Set the batch flags (ANDed over the group when syncing); returns whether every
        rank of the group prepared its batch (``ok``). Flags are left alone when one did not."""
        flags = [self.local_is_all_greedy, self.local_temperature_only, ok]
        if self.sync_flags and D.group_size(self.group) > 1:
            # Every rank must take the same path: AND the flags (min over 0/1) across the group.
            device = self.device if D.group_backend(self.group) == "nccl" else torch.device("cpu")
            t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device)
            D.all_reduce_(t, op="min", group=self.group)
            flags = [bool(v) for v in t.tolist()]
        all_ok = flags.pop()
        if all_ok:
            self.is_all_greedy, self.temperature_only = flags
        return all_ok

    # ------------------------------------------------------------------ views
    def _check_prepared(self) -> None:
        if not self._prepared:
            raise RuntimeError("SpecMetadata.prepare() has not been called yet")

    @property
    def num_requests(self) -> int:
        return len(self.entries)

    @property
    def num_contexts(self) -> int:
        return sum(e.is_context for e in self.entries)

    @property
    def num_generations(self) -> int:
        return self.num_requests - self.num_contexts

    @property
    def slot_ids(self) -> torch.Tensor:
        """``[B]`` int64 KV slots (-1 = padding)."""
        return self._req_slot[: self.num_requests]

    @property
    def is_context(self) -> torch.Tensor:
        """``[B]`` bool."""
        return self._req_is_context[: self.num_requests]

    @property
    def request_draft_len(self) -> torch.Tensor:
        """``[B]`` int64: ``draft_len`` for generation requests, 0 for context requests."""
        return self._req_draft_len[: self.num_requests]

    @property
    def request_row_start(self) -> torch.Tensor:
        """``[B]`` int64: first logits row of each request."""
        return self._req_row_start[: self.num_requests]

    @property
    def request_row_index(self) -> torch.Tensor:
        """``[B, draft_len + 1]`` int64: logits row of position i of request b (context
        requests repeat their single row)."""
        return self._req_row_index[: self.num_requests, : self.draft_len + 1]

    @property
    def request_seeds(self) -> torch.Tensor:
        """``[B]`` int64 Philox seeds of this step."""
        return self._req_seed[: self.num_requests]

    @property
    def request_offsets(self) -> torch.Tensor:
        """``[B]`` int64: each request's stream offset of the first output position it emits this
        step (the target lane; ``tpspec.sampling.streams``). The acceptance functions take it as
        their ``offsets`` and read the lanes of positions ``p .. p + D`` from it."""
        return self._req_offset[: self.num_requests]

    def _sampling_rows(self, n: int, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> SamplingRows:
        # Filters are None exactly when the synced temperature-only flag says so: which path
        # select_tokens takes then depends only on facts equal on every rank.
        filtered = not self.temperature_only
        return SamplingRows(
            temperature[:n], seeds[:n], offsets,
            top_k=top_k[:n] if filtered else None, top_p=top_p[:n] if filtered else None,
            min_p=min_p[:n] if filtered else None, is_all_greedy=self.is_all_greedy,
        )

    def request_sampling(self, offsets: torch.Tensor) -> SamplingRows:
        """Per-request sampling rows (``[B]``) drawing from ``offsets`` (e.g. a draft step's)."""
        self._check_prepared()
        B = self.num_requests
        return self._sampling_rows(B, self._req_temperature, self._req_top_k, self._req_top_p, self._req_min_p,
                                   self._req_seed, offsets)

    def row_sampling(self, draft_tokens: torch.Tensor | None = None) -> SamplingRows:
        """Per-row sampling rows (``[R]``) of the target logits rows, with the synced flags.

        ``draft_tokens``: the step's ``[B, D]`` drafts; a step with penalised generation
        requests needs them (row j of a request counts drafts 0..j-1 as output), and its
        rows carry :class:`~tpspec.sampling.penalties.RowPenalties`.
        """
        self._check_prepared()
        R = self.num_rows
        rows = self._sampling_rows(R, self._row_temperature, self._row_top_k, self._row_top_p, self._row_min_p,
                                   self._row_seed, self._row_offset[:R])
        penalties = self.row_penalties(draft_tokens) if self.local_any_penalties else None
        if self.local_any_controls or self.token_bitmask is not None:
            penalties = RowControls(*(self._row_bias or (None, None, None)), penalties=penalties,
                                    bitmask=self.token_bitmask)
        if penalties is not None:
            rows = dataclasses.replace(rows, penalties=penalties)
        return rows

    def set_token_bitmask(self, bitmask: torch.Tensor | None) -> None:
        """This step's token bitmask of the target logits rows: ``[R, words]`` int32 (bit ``c & 31``
        of word ``c >> 5`` set: row may choose column ``c``; see ``tpspec.sampling.controls``), or
        None (every token). Row ``j`` of a generation request is masked by the request's state
        after its drafts ``0 .. j-1``. Call after :meth:`prepare` (which clears it)."""
        self._check_prepared()
        if bitmask is not None:
            if bitmask.dim() != 2 or bitmask.shape[0] != self.num_rows or bitmask.dtype != torch.int32:
                raise ValueError(f"the token bitmask must be [{self.num_rows}, words] int32, got "
                                 f"{tuple(bitmask.shape)} {bitmask.dtype}")
            bitmask = bitmask.to(self.device)
        self.token_bitmask = bitmask

    def row_penalties(self, draft_tokens: torch.Tensor | None) -> RowPenalties:
        """The penalty inputs of the target logits rows (see :meth:`row_sampling`)."""
        self._check_prepared()
        if self.occurrences is None:
            raise ValueError("this SpecMetadata has no occurrence counts")
        R, B = self.num_rows, self.num_requests
        drafts = None
        if self.draft_len and self.num_generations:
            if draft_tokens is None or tuple(draft_tokens.shape) != (B, self.draft_len):
                raise ValueError(f"penalised generation rows need the step's draft tokens [B={B}, "
                                 f"D={self.draft_len}], got {getattr(draft_tokens, 'shape', None)}")
            drafts = preceding_drafts(draft_tokens.to(self.device), self._row_request[:R], self._row_position[:R],
                                      self.request_draft_len)
        return RowPenalties(self.occurrences, self._row_slot[:R], drafts, self._row_repetition[:R],
                            self._row_presence[:R], self._row_frequency[:R])

    def draft_penalties(self, previous_drafts: torch.Tensor | None, *, first_request: int = 0,
                        num_requests: int | None = None) -> RowPenalties:
        """The penalty inputs of one draft step's rows: requests ``first_request ..
        first_request + num_requests - 1`` (default: to the last), one row each.

        ``previous_drafts``: ``[rows, j]`` int64, those requests' drafts ``0 .. j-1`` of this
        chain when drafting step ``j`` (None or ``j = 0`` for the first step); they count as
        output, as for verification row ``j`` (see :meth:`row_penalties`), so a draft step's
        distribution is penalised exactly like the target row that verifies its draft.
        """
        self._check_prepared()
        if self.occurrences is None:
            raise ValueError("this SpecMetadata has no occurrence counts")
        B = self.num_requests
        rows = B - first_request if num_requests is None else num_requests
        if first_request < 0 or rows < 0 or first_request + rows > B:
            raise ValueError(f"draft rows {first_request}..{first_request + rows - 1} are outside the step's "
                             f"{B} requests")
        if previous_drafts is not None:
            if previous_drafts.dim() != 2 or previous_drafts.shape[0] != rows:
                raise ValueError(f"previous_drafts must be [{rows}, j], got {tuple(previous_drafts.shape)}")
            previous_drafts = previous_drafts.to(device=self.device, dtype=torch.int64)
        pick = slice(first_request, first_request + rows)
        return RowPenalties(self.occurrences, self.slot_ids[pick], previous_drafts, self._req_repetition[pick],
                            self._req_presence[pick], self._req_frequency[pick])

    def draft_controls(self, penalties: RowPenalties | None, bitmask: torch.Tensor | None, *,
                       first_request: int = 0, num_requests: int | None = None) -> RowPenalties | RowControls | None:
        """What one draft step's rows (requests ``first_request ..``, one row each) apply before
        the pick: the requests' logit biases and ``bitmask`` (``[rows, words]`` int32, the token
        bitmask of the position each row drafts: the same as the verification row that checks the
        draft) on top of ``penalties`` (from :meth:`draft_penalties`, or None). None when
        nothing applies."""
        self._check_prepared()
        B = self.num_requests
        rows = B - first_request if num_requests is None else num_requests
        if first_request < 0 or rows < 0 or first_request + rows > B:
            raise ValueError(f"draft rows {first_request}..{first_request + rows - 1} are outside the step's "
                             f"{B} requests")
        if bitmask is not None and (bitmask.dim() != 2 or bitmask.shape[0] != rows or bitmask.dtype != torch.int32):
            raise ValueError(f"the draft step's token bitmask must be [{rows}, words] int32, got "
                             f"{tuple(bitmask.shape)} {bitmask.dtype}")
        bias = row_bias(self._req_bias[first_request:first_request + rows], self.device)
        if bias is None and bitmask is None:
            return penalties
        return RowControls(*(bias or (None, None, None)), penalties=penalties,
                           bitmask=None if bitmask is None else bitmask.to(self.device))

    def draft_offsets(self, step: int) -> torch.Tensor:
        """``[B]`` int64 offsets of draft step ``step`` (0-based) of every request: the draft lane
        of the position that step proposes (``position + step``)."""
        self._check_prepared()
        if not is_int(step) or not 0 <= step < self.max_draft_len:
            raise ValueError(f"draft step {step!r} is out of range [0, {self.max_draft_len})")
        return self.request_offsets + (step * SLOT_SPAN + DRAFT_LANE - TARGET_LANE)

    def release(self, request_id: Hashable) -> None:
        """Forget the stream number the metadata gave an unseeded ``request_id`` without an
        explicit ``stream`` (it finished; a request that comes back keeps it if not released)."""
        self.streams.release(request_id)
