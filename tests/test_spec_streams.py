"""SpecMetadata and the per-request Philox streams: seeded requests reproduce
across batch compositions, positions and slot histories; unseeded requests never share a
stream; parameter buffers are rewritten only when the batch changes; bad input raises."""

import pytest
import torch

from tpspec import SamplingParams, VocabShardedLogits
from tpspec.exchange import AllGatherKeyExchange
from tpspec.sampling import SLOT_SPAN, UNSEEDED_OFFSET_BASE, UNSEEDED_SEED, WindowLayout, select_tokens
from tpspec.speculative import SpecMetadata

D = 2
VOCAB = 300
SEEDED = SamplingParams(temperature=0.9, seed=1234)
SEEDED_TOPK = SamplingParams(temperature=0.9, top_k=20, seed=99)
UNSEEDED = SamplingParams(temperature=1.0)


def step_logits(step: int, rows: int) -> torch.Tensor:
    """The same logits row for the tracked request at a given step, whatever the batch."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(1, VOCAB, generator=gen).expand(rows, -1).contiguous()


def run_history(batches):
    """Run steps; return, per step of the tracked request 'r', its (row seeds, row offsets, tokens).
    Every row of step n carries the logits of r's n-th step."""
    meta = SpecMetadata(8, D)
    ex = AllGatherKeyExchange()
    seen = []
    for requests in batches:
        meta.prepare(requests, draft_len=D)
        rs = meta.row_sampling()
        logits = VocabShardedLogits(step_logits(len(seen), meta.num_rows), 0, VOCAB, ex)
        tokens = select_tokens(logits, meta)
        b = [r[0] for r in requests].index("r") if any(r[0] == "r" for r in requests) else None
        if b is None:
            continue
        rows = meta.request_row_index[b].unique()
        seen.append((rs.seeds[rows].tolist(), rs.offsets[rows].tolist(), tokens[rows].tolist()))
    return seen


@pytest.mark.parametrize("params", [SEEDED, SEEDED_TOPK])
def test_seeded_request_reproduces_across_batches_positions_and_slot_history(params):
    alone = run_history([
        [("r", 0, params, True)],
        [("r", 0, params, False)],
        [("r", 0, params, False)],
    ])
    crowded = run_history([
        [("x", 3, UNSEEDED, True), ("y", 1, SEEDED, True)],       # slot 3 has a history
        [("x", 3, UNSEEDED, False), ("y", 1, SEEDED, False)],
        [("y", 1, SEEDED, False), ("z", 0, UNSEEDED, True), ("r", 3, params, True)],  # new owner of slot 3
        [("z", 0, UNSEEDED, False), ("r", 3, params, False), ("y", 1, SEEDED, False)],
        [("r", 3, params, False), ("q", 5, SamplingParams(temperature=0.0), True)],
    ])
    assert alone == crowded
    # The tokens differ from step to step (the stream advances).
    assert len({tuple(s[1]) for s in alone}) == 3


def test_unseeded_requests_never_share_a_stream():
    meta = SpecMetadata(4, D)
    windows = set()
    for _ in range(3):
        meta.prepare([("a", 0, UNSEEDED, False), ("b", 1, UNSEEDED, False), ("c", 2, SamplingParams(temperature=1.0, seed=42), False)],
                     draft_len=D)
        seeds, starts = meta.request_seeds.tolist(), meta.request_windows.tolist()
        assert seeds[:2] == [UNSEEDED_SEED, UNSEEDED_SEED]
        assert starts[0] >= UNSEEDED_OFFSET_BASE and starts[1] >= UNSEEDED_OFFSET_BASE
        assert starts[2] < UNSEEDED_OFFSET_BASE  # a user seed of 42 never replays the unseeded range
        windows.update(starts[:2])
    span = meta.layout.span
    assert len(windows) == 6 and all(abs(a - b) >= span for a in windows for b in windows if a != b)
    # Two unseeded requests of one step with the same logits draw differently.
    meta.prepare([("a", 0, UNSEEDED, True), ("b", 1, UNSEEDED, True)], draft_len=0)
    rs = meta.row_sampling()
    logits = torch.zeros(2, 5000)  # uniform rows: a shared stream would show as equal tokens
    tokens = select_tokens(VocabShardedLogits(logits, 0, 5000, AllGatherKeyExchange()), meta)
    assert tokens[0] != tokens[1]
    assert rs.offsets[0] != rs.offsets[1]


def test_window_layout_slots_are_disjoint():
    layout = WindowLayout(3)
    slots = [layout.target_row(i) for i in range(4)] + [layout.draft_step(j) for j in range(3)] + [layout.acceptance]
    assert len(set(slots)) == len(slots) == layout.num_slots
    assert all(s % SLOT_SPAN == 0 and 0 <= s < layout.span for s in slots)
    meta = SpecMetadata(2, 3).prepare([("a", 0, SEEDED, False)], draft_len=3)
    offs = meta.row_sampling().offsets.tolist() + [int(meta.draft_offsets(j)[0]) for j in range(3)]
    offs.append(int(meta.acceptance_offsets()[0]))
    assert len(set(offs)) == 8 and max(offs) - min(offs) < layout.span


def test_param_buffers_refill_only_when_batch_changes():
    meta = SpecMetadata(4, D)
    batch = [("a", 0, SEEDED, False), ("b", 1, UNSEEDED, False)]
    meta.prepare(batch, draft_len=D)
    temp_ptr = meta.row_sampling().temperature.data_ptr()
    offsets_before = meta.row_sampling().offsets.clone()
    meta.prepare(batch, draft_len=D)
    assert meta.param_refills == 1
    assert not torch.equal(meta.row_sampling().offsets, offsets_before)  # streams still advance
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
    assert meta.num_rows == 2 and meta.layout.span == 2 * SLOT_SPAN
    assert meta.request_row_index.tolist() == [[0], [1]]
