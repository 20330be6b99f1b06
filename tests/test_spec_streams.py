"""SpecMetadata and the per-request Philox streams: the noise of a request's output position
depends only on its stream and that position (not on the step, the batch, its slot or the draft
length); unseeded requests never share a stream; parameter buffers are rewritten only when the
batch changes; bad input raises."""

import pytest
import torch

from tpspec import SamplingParams, VocabShardedLogits
from tpspec.exchange import AllGatherKeyExchange
from tpspec.sampling import SLOT_SPAN, UNSEEDED_OFFSET_BASE, position_offset, select_tokens
from tpspec.sampling.streams import ACCEPT_RESIDUAL_LANE, ACCEPT_UNIFORM_LANE, DRAFT_LANE, TARGET_LANE
from tpspec.speculative import RequestEntry, SpecMetadata

D = 2
VOCAB = 300
SEEDED = SamplingParams(temperature=0.9, seed=1234)
SEEDED_TOPK = SamplingParams(temperature=0.9, top_k=20, seed=99)
UNSEEDED = SamplingParams(temperature=1.0)


def position_logits(position: int) -> torch.Tensor:
    """The tracked request's logits row at an output position, whatever the step or batch."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + position))


def run_history(schedule, max_draft_len=D):
    """``schedule``: per step ``(requests, draft_len)``, requests as tuples; the tracked request is
    'r'. Every row of every request carries the logits of r's output position it emits. Returns
    ``{position: (seed, offset, token)}`` of r's rows."""
    meta = SpecMetadata(8, max_draft_len)
    ex = AllGatherKeyExchange()
    seen = {}
    for requests, draft_len in schedule:
        meta.prepare(requests, draft_len=draft_len)
        rs = meta.row_sampling()
        rows = []
        for e in meta.entries:
            n = 1 if e.is_context else draft_len + 1
            rows += [position_logits(e.position + i) for i in range(n)]
        tokens = select_tokens(VocabShardedLogits(torch.stack(rows), 0, VOCAB, ex), meta)
        for b, e in enumerate(meta.entries):
            if e.request_id != "r":
                continue
            for i, row in enumerate(meta.request_row_index[b].unique().tolist()):
                seen[e.position + i] = (int(rs.seeds[row]), int(rs.offsets[row]), int(tokens[row]))
    return seen


@pytest.mark.parametrize("params", [SEEDED, SEEDED_TOPK])
def test_noise_is_keyed_by_output_position(params):
    """Position p of a seeded request draws the same noise and token alone one token a step, in
    verification rows of 2 or 4 drafts, beside other requests, in another slot, after other
    requests used its slot: only (seed, p) decide it."""
    alone = run_history([([("r", 0, params, True, 0)], 0)] + [([("r", 0, params, False, p)], 0) for p in range(1, 9)])
    crowded = run_history([
        ([("x", 3, UNSEEDED, True), ("y", 1, SEEDED, True, 0)], 4),
        ([("x", 3, UNSEEDED, False, 1), ("y", 1, SEEDED, False, 1)], 4),
        ([("y", 1, SEEDED, False, 6), ("r", 3, params, True, 0)], 4),  # r in the slot x used
        ([("r", 3, params, False, 1), ("q", 0, SamplingParams(temperature=0.0), True)], 4),  # positions 1..5
        ([("y", 1, SEEDED, False, 11), ("r", 3, params, False, 6)], 2),  # 6..8
    ], max_draft_len=4)
    assert alone == {p: crowded[p] for p in alone}
    assert {p: v[:2] for p, v in alone.items()} == {p: (params.seed, position_offset(0, p)) for p in alone}
    assert len({v[2] for v in alone.values()}) > 3  # the noise moves with the position


def test_lanes_of_a_step_never_collide():
    """Target rows, draft steps and the acceptance lanes of one step are distinct offsets, and a
    draft step j reads the lane of the position it proposes."""
    meta = SpecMetadata(2, 3).prepare([RequestEntry("a", 0, SEEDED, False, position=7)], draft_len=3)
    target = meta.row_sampling().offsets.tolist()
    drafts = [int(meta.draft_offsets(j)[0]) for j in range(3)]
    assert target == [position_offset(0, 7 + i, TARGET_LANE) for i in range(4)]
    assert drafts == [position_offset(0, 7 + j, DRAFT_LANE) for j in range(3)]
    accept = [position_offset(0, 7 + j, lane) for j in range(4) for lane in (ACCEPT_UNIFORM_LANE, ACCEPT_RESIDUAL_LANE)]
    assert len(set(target + drafts + accept)) == len(target + drafts + accept)
    assert int(meta.request_offsets[0]) == target[0]
    with pytest.raises(ValueError, match="draft step"):
        meta.draft_offsets(3)


def test_unseeded_requests_never_share_a_stream():
    meta = SpecMetadata(4, D)
    streams = set()
    for p in range(3):
        meta.prepare([("a", 0, UNSEEDED, False, p), ("b", 1, UNSEEDED, False, p),
                      RequestEntry("e", 3, UNSEEDED, False, position=p, stream=42),
                      ("c", 2, SamplingParams(temperature=1.0, seed=42), False, p)], draft_len=D)
        seeds, offsets = meta.request_seeds.tolist(), meta.request_offsets.tolist()
        assert all(o >= UNSEEDED_OFFSET_BASE for o in offsets[:3])
        assert offsets[3] < UNSEEDED_OFFSET_BASE  # a user seed of 42 never replays stream 42
        assert seeds[2] == 42 and len(set(seeds[:3])) == 3
        streams.add(tuple(seeds[:3]))
    assert len(streams) == 1  # a request keeps its stream from step to step
    # Two unseeded requests of one step with the same logits draw differently.
    meta.prepare([("a", 0, UNSEEDED, True), ("b", 1, UNSEEDED, True)], draft_len=0)
    logits = torch.zeros(2, 5000)  # uniform rows: a shared stream would show as equal tokens
    tokens = select_tokens(VocabShardedLogits(logits, 0, 5000, AllGatherKeyExchange()), meta)
    assert tokens[0] != tokens[1]
    # A released id is a new request: a new stream.
    before = int(meta.request_seeds[0])
    meta.release("a")
    meta.prepare([("a", 0, UNSEEDED, True)], draft_len=0)
    assert int(meta.request_seeds[0]) != before


def test_param_buffers_refill_only_when_batch_changes():
    meta = SpecMetadata(4, D)
    batch = [("a", 0, SEEDED, False), ("b", 1, UNSEEDED, False)]
    meta.prepare(batch, draft_len=D)
    temp_ptr = meta.row_sampling().temperature.data_ptr()
    offsets_before = meta.row_sampling().offsets.clone()
    meta.prepare([r + (3,) for r in batch], draft_len=D)  # three tokens later
    assert meta.param_refills == 1  # positions are not parameters
    assert torch.equal(meta.row_sampling().offsets, offsets_before + 3 * SLOT_SPAN)
    meta.prepare(batch + [("c", 2, SEEDED_TOPK, True)], draft_len=D)
    assert meta.param_refills == 2
    assert meta.row_sampling().temperature.data_ptr() == temp_ptr  # stable buffers
    assert not meta.temperature_only and not meta.is_all_greedy
    meta.prepare([("a", 0, None, False), ("p", -1, UNSEEDED, False)], draft_len=D)
    assert meta.is_all_greedy  # padding requests are greedy
    assert meta.request_draft_len.tolist() == [D, 0]


def test_row_layout():
    meta = SpecMetadata(4, 3).prepare(
        [("c", 0, None, True), ("g", 1, SEEDED, False), ("h", 2, None, True)], draft_len=2
    )
    assert meta.num_rows == 5 and meta.num_contexts == 2
    assert meta.request_row_index.tolist() == [[0, 0, 0], [1, 2, 3], [4, 4, 4]]
    assert meta.request_row_start.tolist() == [0, 1, 4]


@pytest.mark.parametrize(
    "requests, draft_len, match",
    [
        ([("a", 0, None, False)], 3, "draft_len"),
        ([("a", 0, None, False), ("b", 0, None, False)], 1, "slot"),
        ([("a", 9, None, False)], 1, "slot_id=9"),
        ([("a", 0, {"temperature": 1.0}, False)], 1, "SamplingParams"),
        ([("a", 0, None)], 1, "request_id, slot_id"),
        ([(str(i), i, None, True) for i in range(5)], 1, "max_num_requests"),
        ([("a", 0, None, False, -1)], 1, "position"),
        ([("a", 0, None, False, 2**56)], 1, "position"),
        ([("a", 0, UNSEEDED, False, 0, 2**63)], 1, "stream"),
        ([("a", 0, UNSEEDED, False, 0, "x")], 1, "stream"),
    ],
)
def test_prepare_errors(requests, draft_len, match):
    meta = SpecMetadata(4, 2)
    with pytest.raises(ValueError, match=match):
        meta.prepare(requests, draft_len=draft_len)


def test_unprepared_metadata_raises():
    with pytest.raises(RuntimeError, match="prepare"):
        SpecMetadata(2, 1).row_sampling()


def test_no_speculation_layout():
    meta = SpecMetadata(2, 0).prepare([("a", 0, SEEDED, True), ("b", 1, UNSEEDED, False)], draft_len=0)
    assert meta.num_rows == 2
    assert meta.request_row_index.tolist() == [[0], [1]]
