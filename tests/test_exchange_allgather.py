"""Sharded selection through the all-gather exchange on 2, 3 and 4 gloo ranks (CPU).

Each rank builds the same full logits from a fixed seed, keeps its vocab slice, and
picks tokens through the exchange; the parent compares every rank's tokens with
torch.argmax of the full logits and with the TP=1 draw.
"""

import pytest
import torch
from scipy import stats

from tpspec import AllGatherKeyExchange, Mapping, VocabParallelHead, VocabShardedLogits
from tpspec import keys as K
from tpspec.testing import run_ranks
from tpspec.vocab_parallel import vocab_shard_bounds

VOCABS = [1000, 999, 1024, 61]
ROW_COUNTS = [1, 2, 17, 300]


def full_logits(seed: int, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows plus adversarial ones: ties across every shard boundary, NaN, +-inf, +-0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    x = torch.where(torch.rand(rows, vocab, generator=gen) < 0.3, x.round(), x)  # many exact ties
    for r in range(0, rows, 7):
        kind = (r // 7) % 5
        if kind == 0:  # equal maxima in every shard -> lowest index wins
            x[r] = 0.0
            x[r, torch.arange(vocab - 1, -1, -(vocab // 5 + 1))] = 4.0
        elif kind == 1:
            x[r, -1] = float("nan"); x[r, vocab // 2] = float("nan"); x[r, 0] = float("inf")
        elif kind == 2:
            x[r] = float("-inf"); x[r, vocab - 1] = -1.0
        elif kind == 3:
            x[r] = -0.0; x[r, vocab // 3] = 0.0
        else:
            x[r] = float("inf")
    return x.to(dtype)


def shard(full: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, int]:
    vocab = full.shape[1]
    offset, width, real = vocab_shard_bounds(vocab, world, rank)
    local = torch.full((full.shape[0], width), 7.0, dtype=full.dtype)  # padding must never win
    local[:, :real] = full[:, offset:offset + real]
    return local, offset


def streams(rows: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + salt)
    temperature = torch.rand(rows, generator=gen) * 2 + 0.05
    temperature[::5] = 0.0  # some greedy rows in a sampled batch
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen, dtype=torch.int64)
    offsets = torch.randint(0, 2**40, (rows,), generator=gen, dtype=torch.int64)
    return temperature, seeds, offsets


def rank_worker(rank: int, world: int) -> dict:
    ex = AllGatherKeyExchange()
    out: dict = {"greedy": {}, "gumbel": {}}
    for vocab in VOCABS:
        if (world - 1) * -(-vocab // world) >= vocab:
            continue
        for rows in ROW_COUNTS:
            for dtype in (torch.float32, torch.bfloat16):
                full = full_logits(vocab * 31 + rows, rows, vocab, dtype)
                local, offset = shard(full, world, rank)
                out["greedy"][(vocab, rows, str(dtype))] = ex.argmax_logits(local, offset, vocab_size=vocab)
                t, s, o = streams(rows, vocab)
                out["gumbel"][(vocab, rows, str(dtype))] = ex.argmax_logits(
                    local, offset, vocab_size=vocab, rows=K.SamplingRows(t, s, o)
                )
    # argmax_tokens from per-rank (max, argmax): ties across ranks go to the lowest global index.
    full = full_logits(5, 40, 999, torch.float32)
    local, offset = shard(full, world, rank)
    _, _, real = vocab_shard_bounds(999, world, rank)
    mx, am = local[:, :real].max(dim=1)
    out["argmax_tokens"] = ex.argmax_tokens(mx, am, offset)
    # Unseeded sampled rows: the exchange's step counter gives fresh, rank-agreeing draws each call.
    flat = torch.zeros(8, 999)
    local, offset = shard(flat, world, rank)
    temp = torch.ones(8)
    out["unseeded"] = [ex.argmax_logits(local, offset, vocab_size=999, rows=K.SamplingRows(temp)) for _ in range(3)]
    # The head: full weight split by rank, forward -> sharded logits.
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(999, 16, generator=gen)
    hidden = torch.randn(5, 16, generator=gen)
    head = VocabParallelHead(16, 999, Mapping(world, rank), ex)
    head.load_full_weight(weight)
    logits = head(hidden)
    out["head_argmax"] = logits.argmax()
    out["head_gather"] = logits.gather()
    out["head_sample"] = logits.sample(0.7, torch.arange(5), torch.zeros(5, dtype=torch.int64))
    out["head_local"] = (tuple(logits.local.shape), head.shard_width, bool((head.weight[head.real_width:] == 0).all()))
    lp, top_ids, top_lp, ranks = logits.logprobs(torch.zeros(5, dtype=torch.int64), top_n=3)
    out["logprob_dtypes"] = (lp.dtype, top_lp.dtype, tuple(top_ids.shape))
    # The filters' collectives: rank-major columns side by side; an exact int64 sum (float64 would round).
    out["gather_rows"] = ex.gather_rows(torch.arange(6, dtype=torch.int64).reshape(3, 2) + 100 * rank)
    out["sum_rows"] = ex.sum_rows(torch.full((3,), 2**60 + rank, dtype=torch.int64))
    # A batch of no rows gathers to [0, vocab]; a mapping naming another rank is refused.
    out["gather_empty"] = tuple(VocabShardedLogits(torch.zeros(0, head.shard_width), head.vocab_offset, 999,
                                                   ex).gather().shape)
    try:
        VocabParallelHead(16, 999, Mapping(world, (rank + 1) % world), ex)
        out["wrong_rank"] = "no error"
    except ValueError as exc:
        out["wrong_rank"] = str(exc)
    return out


def reference(world_results: list[dict]) -> None:
    ex1 = AllGatherKeyExchange()  # no process group: TP = 1
    for rank_out in world_results:
        assert rank_out["greedy"].keys() == world_results[0]["greedy"].keys()
        for key, tokens in rank_out["greedy"].items():
            vocab, rows, dtype = key
            full = full_logits(vocab * 31 + rows, rows, vocab, getattr(torch, dtype.split(".")[1]))
            assert torch.equal(tokens, torch.argmax(full, dim=1)), f"greedy mismatch at {key}"
            t, s, o = streams(rows, vocab)
            tp1 = ex1.argmax_logits(full, 0, vocab_size=vocab, rows=K.SamplingRows(t, s, o))
            assert torch.equal(rank_out["gumbel"][key], tp1), f"Gumbel draw differs from TP=1 at {key}"
        full = full_logits(5, 40, 999, torch.float32)
        assert torch.equal(rank_out["argmax_tokens"], torch.argmax(full, dim=1))
        for a, b in zip(rank_out["unseeded"], world_results[0]["unseeded"]):
            assert torch.equal(a, b)
        gen = torch.Generator().manual_seed(9)
        weight = torch.randn(999, 16, generator=gen)
        hidden = torch.randn(5, 16, generator=gen)
        full = hidden @ weight.T
        assert torch.equal(rank_out["head_argmax"], torch.argmax(full, dim=1))
        torch.testing.assert_close(rank_out["head_gather"], full, rtol=1e-5, atol=1e-5)
        tp1 = ex1.argmax_logits(full, 0, vocab_size=999, rows=K.SamplingRows(
            torch.full((5,), 0.7), torch.arange(5), torch.zeros(5, dtype=torch.int64)))
        assert torch.equal(rank_out["head_sample"], tp1)
        assert rank_out["gather_empty"] == (0, 999)
        world = len(world_results)
        width = -(-999 // world)
        assert rank_out["head_local"] == ((5, width), width, True)  # the last shard's padding rows are zero
        assert rank_out["logprob_dtypes"] == (torch.float64, torch.float64, (5, 3))
        want = torch.cat([torch.arange(6, dtype=torch.int64).reshape(3, 2) + 100 * r for r in range(world)], dim=1)
        assert torch.equal(rank_out["gather_rows"], want)
        assert rank_out["sum_rows"].tolist() == [world * 2**60 + sum(range(world))] * 3
        assert "but this process is rank" in rank_out["wrong_rank"]
    first = world_results[0]["unseeded"]
    assert not all(torch.equal(first[0], d) for d in first[1:]), "unseeded draws did not change between calls"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_selection_matches_full_logits(world):
    reference(run_ranks(rank_worker, world))


def test_tp1_without_process_group_and_padding_never_wins():
    ex = AllGatherKeyExchange()
    logits = torch.tensor([[0.0, 1.0, 50.0]])
    assert ex.argmax_logits(logits, 0, vocab_size=2).tolist() == [1]
    t = torch.tensor([1.0])
    for off in range(50):
        tok = ex.argmax_logits(logits, 0, vocab_size=2, rows=K.SamplingRows(t, torch.tensor([3]), torch.tensor([off])))
        assert int(tok) < 2


@pytest.mark.slow
def test_gumbel_draw_is_exact_chi_square():
    """200k independent rows (distinct offsets) of one distribution: the draws follow softmax(logits / T)."""
    ex = AllGatherKeyExchange()
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.25, -0.5, 3.0])
    temperature = 0.8
    n = 200_000
    rows = logits.expand(n, -1)
    tokens = ex.argmax_logits(rows, 0, rows=K.SamplingRows(torch.full((n,), temperature),
                                                      torch.full((n,), 1234, dtype=torch.int64), torch.arange(n)))
    counts = torch.bincount(tokens, minlength=10).double()
    expected = torch.softmax(logits.double() / temperature, 0) * n
    assert float(expected.min()) >= 5
    p = stats.chisquare(counts.numpy(), expected.numpy()).pvalue
    assert p > 1e-3, f"chi-square p={p}"
    # The sharded draw of the same rows is the same draw (TP invariance at the key level).
    left = K.local_row_keys(rows[:1000, :4], 0, rows=K.SamplingRows(torch.full((1000,), temperature),
                                                                  torch.full((1000,), 1234), torch.arange(1000)))
    right = K.local_row_keys(rows[:1000, 4:], 4, rows=K.SamplingRows(torch.full((1000,), temperature),
                                                                   torch.full((1000,), 1234), torch.arange(1000)))
    assert torch.equal(K.unpack_indices(torch.maximum(left, right)), tokens[:1000])


def test_different_offsets_and_seeds_give_different_draws():
    ex = AllGatherKeyExchange()
    rows = torch.zeros(1, 1000)
    draws = {int(ex.argmax_logits(rows, 0, rows=K.SamplingRows(torch.ones(1), torch.tensor([s]),
                                                               torch.tensor([o])))) for s in range(5) for o in range(5)}
    assert len(draws) > 20


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(logits=torch.zeros(3, 4, dtype=torch.int32)), "float32, bfloat16 or float16"),
        (dict(logits=torch.zeros(4)), "2-D"),
        (dict(rows=K.SamplingRows(torch.ones(2))), "temperature has 2 rows but the logits have 3"),
        (dict(rows=K.SamplingRows(torch.ones(3, 1))), "1-D"),
        (dict(rows=K.SamplingRows(torch.ones(3, dtype=torch.int64))), "floating"),
        (dict(vocab_offset=-1), "vocab_offset=-1 is out of range"),
        (dict(vocab_offset=1.0), "vocab_offset must be an int"),
        (dict(rows=K.SamplingRows(torch.ones(3), torch.zeros(3, dtype=torch.int64))), "seeds and offsets together"),
        (dict(rows=K.SamplingRows(torch.ones(3), torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))),
         "seeds must be int64"),
        (dict(rows=torch.ones(3)), "rows must be a SamplingRows"),
        (dict(channel=5), "channel=5 is out of range"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, match):
    ex = AllGatherKeyExchange()
    call = dict(logits=torch.zeros(3, 4), vocab_offset=0)
    call.update(kwargs)
    logits = call.pop("logits")
    offset = call.pop("vocab_offset")
    with pytest.raises(ValueError, match=match):
        ex.argmax_logits(logits, offset, **call)


def test_argmax_tokens_and_max_keys_validation():
    ex = AllGatherKeyExchange()
    with pytest.raises(ValueError, match="local_argmax has 2 rows"):
        ex.argmax_tokens(torch.zeros(3), torch.zeros(2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="int32 or int64"):
        ex.argmax_tokens(torch.zeros(3), torch.zeros(3), 0)
    with pytest.raises(ValueError, match="keys must be int64"):
        ex.max_keys(torch.zeros(3, dtype=torch.int32))
    # Every call checks its channel, as the LL exchange does, whether it uses slots or not.
    with pytest.raises(ValueError, match="channel=2 is out of range"):
        ex.max_keys(torch.zeros(3, dtype=torch.int64), channel=2)
    with pytest.raises(ValueError, match="channel=True is out of range"):
        ex.argmax_tokens(torch.zeros(3), torch.zeros(3, dtype=torch.int64), 0, channel=True)
    wide = AllGatherKeyExchange(num_channels=4)
    assert wide.max_keys(torch.zeros(3, dtype=torch.int64), channel=3).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="num_channels"):
        AllGatherKeyExchange(num_channels=0)


def _padding_rank_worker(rank: int, world: int) -> list:
    # A split whose last rank holds only padding (offset >= vocab_size) is valid: that rank
    # offers no candidate and every rank still gets the full-logits token.
    ex = AllGatherKeyExchange()
    local = torch.tensor([[0.0, 1.0], [2.0, -1.0]]) if rank == 0 else torch.full((2, 2), 9.0)
    greedy = ex.argmax_logits(local, 2 * rank, vocab_size=2)
    sampled = ex.argmax_logits(local, 2 * rank, vocab_size=2,
                               rows=K.SamplingRows(torch.ones(2), torch.tensor([3, 4]), torch.tensor([0, 0])))
    return [greedy.tolist(), sampled.tolist()]


def test_a_rank_holding_only_padding_offers_no_candidate():
    results = run_ranks(_padding_rank_worker, 2)
    assert results[0] == results[1]
    greedy, sampled = results[0]
    assert greedy == [1, 0]
    assert all(0 <= t < 2 for t in sampled)


def test_head_rejects_bad_splits_and_shapes():
    with pytest.raises(ValueError, match="cannot be split"):
        vocab_shard_bounds(5, 4, 0)  # ceil(5/4)=2: the last rank would start at 6
    head = VocabParallelHead(8, 10)
    with pytest.raises(ValueError, match=r"hidden must be \[rows, 8\]"):
        head(torch.zeros(2, 7))
    with pytest.raises(ValueError, match=r"must be \[10, 8\]"):
        head.load_full_weight(torch.zeros(9, 8))
    with pytest.raises(ValueError, match="hidden is torch.float64 on cpu, the head is torch.float32"):
        head(torch.zeros(2, 8, dtype=torch.float64))
    for bad in (dict(hidden_size=10.0), dict(hidden_size=-1), dict(vocab_size=True)):
        with pytest.raises(ValueError, match="must be a positive int"):
            VocabParallelHead(**{"hidden_size": 8, "vocab_size": 10, **bad})
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
        VocabParallelHead(8, 10, dtype=torch.float64)
    for bad, match in ((dict(vocab_size=-1), "vocab_size must be a positive int"),
                       (dict(vocab_offset=2.0), "vocab_offset must be an int >= 0"),
                       (dict(exchange=None), "exchange must be a KeyExchange")):
        with pytest.raises(ValueError, match=match):
            VocabShardedLogits(**{"local": torch.zeros(2, 5), "vocab_offset": 0, "vocab_size": 5,
                                  "exchange": head.exchange, **bad})
    # A bad bias is refused before anything is copied: the head keeps its old weights.
    biased = VocabParallelHead(4, 10, bias=True)
    biased.load_full_weight(torch.ones(10, 4), torch.full((10,), 5.0))
    with pytest.raises(ValueError, match=r"bias must be \[10\]"):
        biased.load_full_weight(torch.full((10, 4), 2.0), torch.randn(3))
    assert biased.weight[0].tolist() == [1.0] * 4 and biased.bias.tolist() == [5.0] * 10
    with pytest.raises(ValueError, match="built with bias=False"):
        head.load_full_weight(torch.zeros(10, 8), torch.zeros(10))


def test_sample_rejects_non_finite_temperatures():
    head = VocabParallelHead(8, 10)
    head.load_full_weight(torch.randn(10, 8))
    logits = head(torch.randn(3, 8))
    seeds, offsets = torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.int64)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="temperature must be finite"):
            logits.sample(bad, seeds, offsets)
        with pytest.raises(ValueError, match="NaN or infinite"):
            logits.sample(torch.tensor([1.0, bad, 0.5]), seeds, offsets)
    with pytest.raises(ValueError, match="temperature must be a float or a"):
        logits.sample("0.8", seeds, offsets)
    with pytest.raises(ValueError, match="temperature has 2 rows but the logits have 3"):
        logits.sample(torch.ones(2), seeds, offsets)
    # Finite values still work, and a greedy row (T=0) is the argmax.
    tokens = logits.sample(torch.tensor([0.0, 1.0, 0.5]), seeds, offsets)
    assert tokens[0].item() == logits.argmax()[0].item()


def test_replicated_head_under_attention_dp_picks_locally():
    """Under attention DP the head is whole on every rank: no collective, local argmax."""
    from tpspec.exchange import LocalKeyExchange

    head = VocabParallelHead(4, 10, Mapping(2, 1, 2, enable_attention_dp=True))
    assert isinstance(head.exchange, LocalKeyExchange) and head.shard_width == 10
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    head.load_full_weight(weight)
    hidden = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(head(hidden).argmax(), torch.argmax(hidden @ weight.T, dim=1))
    with pytest.raises(ValueError, match="channel=5 is out of range"):
        head.exchange.max_keys(torch.zeros(2, dtype=torch.int64), channel=5)  # as every exchange does
