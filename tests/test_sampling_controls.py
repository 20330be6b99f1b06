"""Logit controls on vocabulary shards: parameter checks, the token bitmask read at each rank's
columns, controlled slices equal to the controlled full row bit for bit, masked draws on shards
equal to the full-row reference (greedy, temperature, top-k / top-p / min-p) at TP 1 to 4 with
every token allowed by its row's mask and no more traffic than unmasked rows (8 bytes a row a
rank, far below a logits row), and the grammar state a rank keeps (llguidance, the tiny model's
tokenizer): masks after drafts without moving the matcher, bad words by vLLM's rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tpspec import keys as K
from tpspec import SamplingParams, StructuredOutputsParams
from tpspec.exchange import AllGatherKeyExchange
from tpspec.sampling.controls import RowControls, allowed_columns, bitmask_words, pack_bits, row_bias
from tpspec.sampling.ops import sample_from_logits
from tpspec.sampling.penalties import OccurrenceCounts, RowPenalties
from tpspec.sampling.select import select_tokens
from tpspec.testing import run_ranks
from tpspec.vocab_parallel import VocabShardedLogits

from test_sampling_sharded import VOCAB, adversarial_batch, shard


# ------------------------------------------------------------------ parameters

@pytest.mark.parametrize("kwargs,match", [
    ({}, "exactly one of.*got none"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of.*got regex, choice"),
    ({"json": 5}, "json must be a dict or its JSON text"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"choice": "abc"}, "choice must be a non-empty list of strings"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "choice must be a non-empty list of strings"),
    ({"json_object": False}, "json_object must be True"),
    ({"grammar": None, "json_object": True, "disable_any_whitespace": 1}, "disable_any_whitespace must be a bool"),
    ({"regex": "a+", "whitespace_pattern": " "}, "whitespace_pattern applies to json"),
])
def test_structured_outputs_params_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"structured_outputs": {"json": {}}}, "structured_outputs must be a StructuredOutputsParams"),
    ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {5: 100.5}}, r"logit_bias values must be floats in \[-100, 100\]"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be a non-empty list of token ids"),
    ({"bad_words": "the"}, "bad_words must be a list of non-empty strings"),
    ({"bad_words": ["ok", "  "]}, "bad_words must be a list of non-empty strings"),
])
def test_sampling_params_control_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_controls_are_normalized_and_hash_equal():
    a = SamplingParams(logit_bias={np.int64(5): 1, 7: -2.5}, allowed_token_ids=[9, 3, 9], bad_words=["x", "x", "y"],
                       structured_outputs=StructuredOutputsParams(json={"b": 1, "a": 2}))
    b = SamplingParams(logit_bias={5: 1.0, 7: -2.5}, allowed_token_ids=(3, 9), bad_words=("x", "y"),
                       structured_outputs=StructuredOutputsParams(json={"a": 2, "b": 1}))
    assert a == b and hash(a) == hash(b)
    assert a.logit_bias == {5: 1.0, 7: -2.5} and a.allowed_token_ids == (3, 9) and a.bad_words == ("x", "y")
    assert a.has_logit_controls and not SamplingParams().has_logit_controls
    assert a != dataclasses.replace(b, logit_bias={5: 1.0})
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")


# ------------------------------------------------------------------ bitmask and slices

def test_allowed_columns_reads_any_slice_of_the_bitmask():
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(6, 224, generator=gen) < 0.4
    bitmask = pack_bits(allowed)
    assert bitmask.shape == (6, 7) and bitmask.dtype == torch.int32
    for offset, width in [(0, 224), (0, 203), (51, 51), (153, 51), (200, 51), (7, 300), (224, 16), (31, 2)]:
        got = allowed_columns(bitmask, offset, width)
        want = torch.zeros(6, width, dtype=torch.bool)
        real = max(0, min(224, offset + width) - offset)
        want[:, :real] = allowed[:, offset:offset + real]
        assert torch.equal(got, want), (offset, width)
    assert bitmask_words(512) == 16 and bitmask_words(513) == 17


def _controls(rows: int, vocab: int, *, seed: int = 0, penalties: bool = True) -> tuple[RowControls, torch.Tensor]:
    """Random controls of ``rows`` rows over ``vocab`` columns: a bias on a few columns of most
    rows, penalties with random counts, and a bitmask allowing a random subset (at least one column;
    some rows one column, some a handful). Also the allowed ``[rows, vocab]`` bool."""
    gen = torch.Generator().manual_seed(seed)
    words = bitmask_words(vocab)
    allowed = torch.zeros(rows, words * 32, dtype=torch.bool)
    for r in range(rows):
        kind = r % 4
        if kind == 0:
            cols = torch.randint(0, vocab, (1,), generator=gen)
        elif kind == 1:
            cols = torch.randint(0, vocab, (5,), generator=gen)
        elif kind == 2:
            cols = torch.nonzero(torch.rand(vocab, generator=gen) < 0.3).flatten()
        else:
            cols = torch.arange(vocab)  # no mask on this row
        allowed[r, cols] = True
    biases = [None if r % 3 == 0 else {int(c): float(v) for c, v in zip(
        torch.randint(0, vocab, (4,), generator=gen).tolist(), (torch.randn(4, generator=gen) * 5).tolist())}
        for r in range(rows)]
    pen = None
    if penalties:
        counts = OccurrenceCounts(rows, vocab_offset=0, width=vocab)
        for slot in range(rows):
            counts.reset(slot, torch.randint(0, vocab, (20,), generator=gen).tolist())
        counts.add(torch.arange(rows), torch.randint(0, vocab, (rows, 6), generator=gen))
        pen = RowPenalties(counts, torch.arange(rows), None, torch.full((rows,), 1.3), torch.full((rows,), 0.4),
                           torch.full((rows,), 0.2))
    return RowControls(*row_bias(biases), penalties=pen, bitmask=pack_bits(allowed)), allowed[:, :vocab]


def _sliced(controls: RowControls, offset: int, width: int) -> RowControls:
    """The controls as one rank holds them: its own occurrence counts (the bias and bitmask are
    global, each rank reads its columns)."""
    if controls.penalties is None:
        return controls
    full = controls.penalties.counts
    mine = OccurrenceCounts(full.num_slots, vocab_offset=offset, width=width)
    tc, ts = mine._tables()
    real = max(0, min(full.width - offset, width))
    tc[:full.num_slots, :real] = full.output_counts[:, offset:offset + real]
    ts[:full.num_slots, :real] = full.prompt_seen[:, offset:offset + real]
    return dataclasses.replace(controls, penalties=dataclasses.replace(controls.penalties, counts=mine))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_controlled_slices_equal_the_controlled_full_row(tp, dtype):
    controls, allowed = _controls(12, VOCAB)
    full = (torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    full[0, 3] = -0.0
    reference = controls.apply(full, 0)
    assert torch.equal(torch.isinf(reference) & (reference < 0), ~allowed)
    parts = []
    for rank in range(tp):
        local, offset = shard(full, tp, rank)
        real = min(VOCAB - offset, local.shape[1])
        parts.append(_sliced(controls, offset, local.shape[1]).apply(local, offset)[:, :real])
    got = torch.cat(parts, dim=1)
    assert torch.equal(got.view(torch.int32), reference.view(torch.int32))  # bit for bit, -0.0 included


# ------------------------------------------------------------------ draws on shards

def _count_traffic(ex: AllGatherKeyExchange) -> dict:
    """Wrap ``ex``'s collectives (and full-row gathers) to count the bytes each rank receives."""
    seen = {"bytes": 0, "gathers": 0}

    def wrap(name: str) -> None:
        original = getattr(ex, name)

        def counted(values, *, channel=1):
            out = original(values, channel=channel)
            seen["bytes"] += out.numel() * out.element_size() * (ex.world_size if name == "max_keys" else 1)
            return out

        setattr(ex, name, counted)

    for name in ("max_keys", "gather_rows", "sum_rows"):
        wrap(name)
    return seen


def masked_draws_worker(rank: int, world: int, device: str = "cpu") -> dict:
    """The adversarial batch under random controls, drawn on ``world`` ranks: filtered rows,
    temperature rows and greedy rows (on ``device="cuda"`` through the LL exchange)."""
    if device == "cuda":
        from tpspec import distributed as D
        from tpspec.exchange.ll import LLKeyExchange

        torch.cuda.set_device(rank % torch.cuda.device_count())
        ex = LLKeyExchange(D.tp_group(), max_rows=128)
    else:
        ex = AllGatherKeyExchange()
    dev = ex.device
    batch = {k: v.to(dev) for k, v in adversarial_batch(seed=5).items()}
    rows = batch["logits"].shape[0]
    controls, _ = _controls(rows, VOCAB, seed=2)
    local, offset = shard(batch["logits"].cpu(), world, rank)
    mine = _sliced(controls, offset, local.shape[1])
    logits = VocabShardedLogits(local.to(dev), offset, VOCAB, ex)
    out = {}
    filtered = K.SamplingRows(batch["temperature"], batch["seeds"], batch["offsets"], top_k=batch["top_k"],
                              top_p=batch["top_p"], min_p=batch["min_p"], penalties=mine)
    out["filtered"] = select_tokens(logits, filtered).cpu()
    traffic = _count_traffic(ex)
    plain = K.SamplingRows(batch["temperature"], batch["seeds"], batch["offsets"], penalties=mine)
    out["temperature"] = select_tokens(logits, plain).cpu()
    out["temperature_bytes"] = traffic["bytes"]
    traffic["bytes"] = 0
    greedy = dataclasses.replace(plain, temperature=torch.full((rows,), 1e-6, device=dev), is_all_greedy=True)
    out["greedy"] = select_tokens(logits, greedy).cpu()
    out["greedy_bytes"] = traffic["bytes"]
    if device == "cuda":
        ex.close()
    return out


def _references(batch: dict, controls: RowControls) -> dict:
    full = controls.apply(batch["logits"], 0)
    n = full.shape[0]
    off = torch.full((n,), 2**31 - 1, dtype=torch.int64)
    return {"filtered": sample_from_logits(full, batch["temperature"], batch["seeds"], batch["offsets"],
                                           batch["top_k"], batch["top_p"], batch["min_p"]),
            "temperature": sample_from_logits(full, batch["temperature"], batch["seeds"], batch["offsets"], off,
                                              torch.ones(n), torch.zeros(n)),
            "greedy": torch.argmax(full, dim=1)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_masked_draws_on_shards_equal_the_full_row_reference(world):
    batch = adversarial_batch(seed=5)
    controls, allowed = _controls(batch["logits"].shape[0], VOCAB, seed=2)
    reference = _references(batch, controls)
    results = [masked_draws_worker(0, 1)] if world == 1 else run_ranks(masked_draws_worker, world)
    rows = batch["logits"].shape[0]
    # Rows whose allowed columns all hold -inf have nothing to draw (their token is the reference's too).
    drawable = ~(controls.apply(batch["logits"], 0) == float("-inf")).all(dim=1)
    assert bool(drawable.all() == False) and int(drawable.sum()) > rows - 4  # noqa: E712 - a few such rows
    for res in results:
        for kind in ("filtered", "temperature", "greedy"):
            assert torch.equal(res[kind], reference[kind]), kind
            assert bool(allowed[torch.arange(rows), res[kind]][drawable].all()), kind
        # The masks add nothing to the exchange: one 8-byte key a row a rank, far below a logits row / 8.
        assert res["temperature_bytes"] == res["greedy_bytes"] == 8 * rows * world
        assert res["greedy_bytes"] / rows < 4 * VOCAB / 8


def test_masked_sampled_draws_follow_the_masked_softmax():
    """Chi-square: a temperature row with a bias and a mask draws from softmax over the allowed
    columns of the biased logits."""
    from scipy import stats

    vocab, rows = 40, 6000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4)).expand(rows, vocab)
    allowed = torch.zeros(rows, 64, dtype=torch.bool)
    allowed[:, [1, 5, 6, 20, 33, 39]] = True
    controls = RowControls(*row_bias([{5: 2.0, 20: -1.0, 7: 50.0}] * rows), bitmask=pack_bits(allowed))
    sharded = VocabShardedLogits(logits.contiguous(), 0, vocab, AllGatherKeyExchange())
    seeds = torch.full((rows,), 11, dtype=torch.int64)
    tokens = select_tokens(sharded, K.SamplingRows(torch.full((rows,), 0.8), seeds, torch.arange(rows) * 32,
                                                   penalties=controls))
    one = RowControls(*row_bias([{5: 2.0, 20: -1.0, 7: 50.0}]), bitmask=pack_bits(allowed[:1]))
    expect = torch.softmax(one.apply(logits[:1], 0)[0].double() / 0.8, dim=0).numpy()
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert set(np.nonzero(counts)[0]) <= {1, 5, 6, 20, 33, 39}
    keep = expect > 0
    assert stats.chisquare(counts[keep], expect[keep] * rows).pvalue > 1e-3


# ------------------------------------------------------------------ through the step's metadata

def test_metadata_carries_bias_and_masks_to_target_rows_and_draft_steps():
    """``SpecMetadata`` lays out each request's bias on its rows; the step's bitmask reaches the
    selection; a draft step applies the bias and its own bitmask, greedy or sampled (the sampled
    draft's logits, q, are the controlled ones)."""
    from tpspec.exchange import LocalKeyExchange
    from tpspec.speculative import SpecMetadata, select_draft_tokens

    vocab, d = 64, 2
    gen = torch.Generator().manual_seed(7)
    requests = [("ctx", 0, SamplingParams(temperature=0, logit_bias={9: 100}), True),
                ("plain", 1, SamplingParams(temperature=0), False),
                ("masked", 2, SamplingParams(temperature=0.9, seed=4), False)]  # masked by the step's bitmask
    meta = SpecMetadata(4, d).prepare(requests, draft_len=d)
    assert meta.local_any_controls and meta.num_rows == 1 + 2 * (d + 1)
    logits = torch.randn(meta.num_rows, vocab, generator=gen)
    allowed = torch.ones(meta.num_rows, vocab, dtype=torch.bool)
    allowed[4:, :] = False
    allowed[4:, [3, 11, 40]] = True  # the masked request's rows: three tokens its grammar allows
    meta.set_token_bitmask(pack_bits(allowed))
    ex = LocalKeyExchange("cpu")
    rows = meta.row_sampling(torch.zeros(3, d, dtype=torch.int64))
    tokens = select_tokens(VocabShardedLogits(logits, 0, vocab, ex), rows)
    assert tokens[0] == 9  # the bias of the context request's row
    assert torch.equal(tokens[1:4], logits[1:4].argmax(dim=1))  # untouched rows
    assert all(int(t) in (3, 11, 40) for t in tokens[4:])
    with pytest.raises(ValueError, match=r"token bitmask must be \[7, words\] int32"):
        meta.set_token_bitmask(pack_bits(allowed[:3]))
    meta.prepare(requests, draft_len=d)
    assert meta.token_bitmask is None  # each step brings its own

    draft_rows = torch.randn(2, vocab, generator=gen)  # the two generation requests' draft step 0
    bits = pack_bits(allowed[[1, 4]])
    greedy = select_draft_tokens(VocabShardedLogits(draft_rows, 0, vocab, ex), meta, 0, first_request=1,
                                 bitmask=bits)
    assert greedy.logits is None and greedy.tokens[0] == draft_rows[0].argmax() and int(greedy.tokens[1]) in (3, 11, 40)
    sampled = select_draft_tokens(VocabShardedLogits(draft_rows, 0, vocab, ex), meta, 0, sample=True,
                                  first_request=1, bitmask=bits)
    assert int(sampled.tokens[1]) in (3, 11, 40)
    assert torch.equal(torch.isinf(sampled.logits[1]), ~allowed[4])  # q of the masked draft is masked
