"""Penalties and logprobs on vocab shards: the penalised values equal an independent
full-row reference bit for bit, at TP = 1, 2 and 3 (one spawn of 3 gloo ranks); a
verification row j counts drafts 0..j-1; a slot's counts restart with its new owner;
neutral rows keep their bits; logprobs match float64 ``log_softmax``; bad parameters
raise ``ValueError`` naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from model_helpers import sharded
from tpspec import SamplingParams
from tpspec.exchange import AllGatherKeyExchange
from tpspec.sampling import select_tokens
from tpspec.sampling.penalties import OccurrenceCounts, apply_penalties
from tpspec.speculative import SpecMetadata, SpecWorker
from tpspec.testing import run_ranks
from tpspec.vocab_parallel import vocab_shard_bounds

VOCAB = 37  # splits unevenly at TP = 2 (19 + 18) and TP = 3 (13 + 13 + 11)
D = 3
PEN = dict(repetition_penalty=0.5, presence_penalty=-1.5, frequency_penalty=0.7)
PEN2 = dict(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=-0.3)
PROMPTS = {0: [3, 3, 20, 36], 1: [1, 2, 18, 19, 30], 2: [0, 36, 5], 3: [7]}
OUTPUTS = {1: [[4, 4, 18, -1], [30, 31, 4, 4]], 2: [[12, 13, 36, -1]], 3: [[8, 9, -1, -1]]}
BATCHES = {
    # Greedy and temperature rows: the sharded exchange paths.
    "sharded": [("c", 0, SamplingParams(temperature=0.0, **PEN), True),
                ("g", 1, SamplingParams(temperature=0.9, seed=5, **PEN), False),
                ("n", 3, SamplingParams(temperature=1.1, seed=6), False),
                ("h", 2, SamplingParams(temperature=0.0, **PEN2), False)],
    # A top-k row: the batch takes the filtered path.
    "gathered": [("c", 0, SamplingParams(temperature=0.8, seed=1, **PEN2), True),
                 ("g", 1, SamplingParams(temperature=1.0, top_k=4, seed=5, **PEN), False),
                 ("n", 3, SamplingParams(temperature=1.1, seed=6), False)],
}
DRAFTS = torch.tensor([[0, 0, 0], [4, 18, 4], [7, 36, 36], [2, 2, 2]])


# ----------------------------------------------------------------------------- references

def reference_row(row: np.ndarray, prompt: list[int], output: list[int], r: float, p: float, f: float) -> np.ndarray:
    """The penalty semantics written out column by column in numpy float32."""
    x = row.astype(np.float32).copy()
    r32, p32, f32 = np.float32(r), np.float32(p), np.float32(f)
    for v in set(prompt) | set(output):
        x[v] = x[v] / r32 if x[v] > 0 else x[v] * r32
    for v in set(output):
        x[v] = x[v] - f32 * np.float32(output.count(v))
        x[v] = x[v] - p32
    return x


def bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    return np.where(np.isnan(a), np.float32("nan"), a).view(np.uint32)  # one NaN pattern


def logits_for(name: str, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randint(-6, 7, (rows, VOCAB), generator=gen).float() * 0.75  # many ties, zeros, negatives
    x[0, 5] = -0.0
    x[0, 6] = float("inf")
    x[-1, 7] = float("-inf")
    return x




def fill_counts(counts: OccurrenceCounts) -> None:
    """The same history on every rank: slot 2 had an earlier owner with other tokens."""
    counts.reset(2, [9, 9, 10])
    counts.add(torch.tensor([2]), torch.tensor([[11, 11, 12, 36]]))
    for slot, prompt in PROMPTS.items():
        counts.reset(slot, prompt)
    for slot, chunks in OUTPUTS.items():
        for chunk in chunks:
            counts.add(torch.tensor([slot, -1]), torch.tensor([chunk, [1, 2, 3, 4]]))  # slot -1: ignored


def history(slot: int) -> tuple[list[int], list[int]]:
    out = [t for chunk in OUTPUTS.get(slot, []) for t in chunk if t >= 0]
    return PROMPTS[slot], out


# ----------------------------------------------------------------------------- one rank's work

def penalty_worker(rank: int, world: int, group=None) -> dict:
    ex = AllGatherKeyExchange(group)
    offset, width, _ = vocab_shard_bounds(VOCAB, world, rank)
    result: dict = {}
    for name, requests in BATCHES.items():
        out: dict = {}
        for mode in ("strict", "rejection"):
            counts = OccurrenceCounts(4, vocab_offset=offset, width=width)
            fill_counts(counts)
            meta = SpecMetadata(4, D, occurrences=counts).prepare(requests, draft_len=D)
            full = logits_for(name, meta.num_rows)
            logits = sharded(full, world, rank, ex)
            rs = meta.row_sampling(draft_tokens=DRAFTS[: meta.num_requests])
            out["penalised"] = rs.penalties.apply(logits.local, offset)
            out["tokens"] = select_tokens(logits, rs) if mode == "strict" else out["tokens"]
            step = SpecWorker(mode, forced=None).step(logits, DRAFTS[: meta.num_requests], meta)
            out[mode] = (step.accepted_tokens, step.num_accepted)
        out["row_request"] = meta._row_request[: meta.num_rows].clone()
        out["row_position"] = meta._row_position[: meta.num_rows].clone()
        tokens = torch.arange(meta.num_rows) % VOCAB
        out["logprobs"] = sharded(logits_for(name, meta.num_rows), world, rank, ex).logprobs(tokens, top_n=5)
        result[name] = out
    return result


def ranks_worker(rank: int, world: int) -> dict:
    """TP = 3 over the world group and TP = 2 over ranks 0 and 1 (rank 2 idles there)."""
    pair = dist.new_group([0, 1])
    out = {3: penalty_worker(rank, world, dist.group.WORLD)}
    if rank < 2:
        out[2] = penalty_worker(rank, 2, pair)
    return out


@pytest.fixture(scope="module")
def tp1() -> dict:
    return penalty_worker(0, 1)


@pytest.fixture(scope="module")
def multi_rank() -> list[dict]:
    return run_ranks(ranks_worker, 3)


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name", sorted(BATCHES))
def test_full_rows_equal_the_reference(tp1, name):
    """TP = 1 (the whole vocabulary as one slice) against the numpy reference, bit for bit;
    row j of a generation request counts drafts 0..j-1 as output."""
    requests = BATCHES[name]
    got = tp1[name]["penalised"]
    full = logits_for(name, got.shape[0])
    for r in range(got.shape[0]):
        b, j = int(tp1[name]["row_request"][r]), int(tp1[name]["row_position"][r])
        _, slot, params, is_context = requests[b]
        prompt, output = history(slot)
        output = output + ([] if is_context else DRAFTS[b, :j].tolist())
        want = reference_row(full[r].numpy(), prompt, output, params.repetition_penalty,
                             params.presence_penalty, params.frequency_penalty)
        assert (bits(got[r]) == bits(want)).all(), (name, r)


def test_drafts_matter(tp1):
    """Rows 1..D of a penalised generation request differ from what they would be without
    the drafts before them (so the test above can fail)."""
    got = tp1["sharded"]["penalised"]
    full = logits_for("sharded", got.shape[0])
    prompt, output = history(1)
    r, p, f = (PEN[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty"))
    rows = [r_ for r_ in range(got.shape[0]) if int(tp1["sharded"]["row_request"][r_]) == 1]
    for j, row in enumerate(rows):
        without = reference_row(full[row].numpy(), prompt, output, r, p, f)
        assert (bits(got[row]) != bits(without)).any() == (j > 0)


def test_same_tokens_and_values_at_tp_1_2_3(tp1, multi_rank):
    for tp in (2, 3):
        for rank in range(tp):
            for name in BATCHES:
                got, want = multi_rank[rank][tp][name], tp1[name]
                offset, width, real = vocab_shard_bounds(VOCAB, tp, rank)
                assert (bits(got["penalised"][:, :real]) == bits(want["penalised"][:, offset:offset + real])).all()
                assert torch.equal(got["tokens"], want["tokens"]), (tp, rank, name)
                for mode in ("strict", "rejection"):
                    assert all(torch.equal(a, b) for a, b in zip(got[mode], want[mode])), (tp, rank, name, mode)
                for a, b in zip(got["logprobs"], want["logprobs"]):  # the same bits (a row with +inf: NaN)
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_penalties_change_tokens(tp1):
    """The same logits without penalties pick other tokens on some rows."""
    requests = [(i, s, SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed), c)
                for i, s, p, c in BATCHES["sharded"]]
    meta = SpecMetadata(4, D).prepare(requests, draft_len=D)
    logits = sharded(logits_for("sharded", meta.num_rows), 1, 0, AllGatherKeyExchange(None))
    assert not torch.equal(select_tokens(logits, meta), tp1["sharded"]["tokens"])


def test_counts_restart_with_the_slot_owner():
    fresh = OccurrenceCounts(3, vocab_offset=10, width=8)
    fresh.reset(1, [12, 12, 30, 3])
    used = OccurrenceCounts(3, vocab_offset=10, width=8)
    used.reset(1, [11, 17])
    used.add(torch.tensor([1, 0]), torch.tensor([[11, 11, 16], [12, -1, 13]]))
    assert used.output_counts[1].tolist() == [0, 2, 0, 0, 0, 0, 1, 0]
    used.reset(1, [12, 12, 30, 3])  # a new owner
    assert torch.equal(used.output_counts[1], fresh.output_counts[1])
    assert torch.equal(used.prompt_seen[1], fresh.prompt_seen[1])
    assert used.prompt_seen[1].nonzero().reshape(-1).tolist() == [2]  # only 12 is in columns [10, 18)
    assert used.output_counts[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]  # other slots keep theirs
    used.add(torch.tensor([-1, 7]), torch.tensor([[12, 13], [14, 15]]))  # no slot: counted nowhere
    assert used._tables()[0][:, :8].sum() == 2 and used._tables()[0][3, :8].sum() == 0  # the sink row: zero


def test_neutral_rows_keep_their_bits():
    counts = OccurrenceCounts(2, vocab_offset=0, width=6)
    counts.reset(0, [0, 1, 2, 3, 4, 5])
    counts.add(torch.tensor([0]), torch.tensor([[0, 1, 2, 3, 4, 5]]))
    x = torch.tensor([[-0.0, 0.0, 1.5, -2.25, float("nan"), float("-inf")]], dtype=torch.bfloat16)
    out = apply_penalties(x, vocab_offset=0, counts=counts, slots=torch.tensor([0]), drafts=None,
                          repetition=torch.tensor([1.0]), presence=torch.tensor([0.0]), frequency=torch.tensor([0.0]))
    assert out.dtype == torch.float32
    assert (bits(out) == bits(x.float())).all()
    assert torch.signbit(out[0, 0]) and not torch.signbit(out[0, 1])


def test_counts_must_cover_the_slice():
    counts = OccurrenceCounts(2, vocab_offset=0, width=6)
    with pytest.raises(ValueError, match="occurrence counts cover columns"):
        apply_penalties(torch.zeros(1, 7), vocab_offset=0, counts=counts, slots=torch.tensor([0]), drafts=None,
                        repetition=torch.ones(1), presence=torch.zeros(1), frequency=torch.zeros(1))


def test_penalised_generation_rows_need_the_drafts():
    meta = SpecMetadata(2, D, occurrences=OccurrenceCounts(2, vocab_offset=0, width=VOCAB))
    meta.prepare([("g", 0, SamplingParams(**PEN), False)], draft_len=D)
    with pytest.raises(ValueError, match="draft tokens"):
        meta.row_sampling()
    with pytest.raises(ValueError, match="occurrence counts"):
        SpecMetadata(2, D).prepare([("g", 0, SamplingParams(**PEN), False)], draft_len=D)


def test_logprobs_match_float64_log_softmax():
    """The logprobs the runtime reports (raw logits, on shards) at TP = 1; the multi-rank test
    above checks TP = 2 and 3 give the same bits."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(6, VOCAB, generator=gen) * 4
    full[2] = 1.0  # a flat row: every top-N entry ties
    full[3, :5] = full[3].max() + 1  # a tie at the top
    tokens = torch.tensor([0, 5, 36, 4, 17, 9])
    logits = sharded(full, 1, 0, AllGatherKeyExchange(None))
    lp, ids, top, _ = logits.logprobs(tokens, top_n=4)
    want = torch.log_softmax(full.double(), dim=-1)
    assert torch.allclose(lp.double(), want[torch.arange(6), tokens], atol=1e-5, rtol=0)
    assert torch.allclose(top.double(), want.gather(1, ids), atol=1e-5, rtol=0)
    assert torch.allclose(top.double(), want.topk(4, dim=1).values, atol=1e-5, rtol=0)  # the best four, in order
    assert ids[2].tolist() == [0, 1, 2, 3] and ids[3].tolist() == [0, 1, 2, 3]  # ties: lower ids first
    assert sharded(full, 1, 0, AllGatherKeyExchange(None)).logprobs(tokens)[1].shape == (6, 0)
    with pytest.raises(ValueError, match="top_n"):
        sharded(full, 1, 0, AllGatherKeyExchange(None)).logprobs(tokens, top_n=21)


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", "1.1"), ("repetition_penalty", None), ("repetition_penalty", True),
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", float("nan")),
    ("frequency_penalty", 3), ("frequency_penalty", None),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.0), ("logprobs", True), ("logprobs", np.float32(3)),
])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_numpy_scalars_are_accepted():
    p = SamplingParams(repetition_penalty=np.float32(1.25), presence_penalty=np.float64(-2.0),
                       frequency_penalty=np.int64(1), logprobs=np.int32(20))
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.logprobs) == (1.25, -2.0, 1.0, 20)
    assert type(p.logprobs) is int and type(p.frequency_penalty) is float
    assert SamplingParams(presence_penalty=-0.0) == SamplingParams() and not SamplingParams().has_penalties
    assert SamplingParams(frequency_penalty=0.1).has_penalties
