"""Top-k / top-p / min-p and logprobs on vocabulary shards.

The sharded draw must equal the full-row reference (``sampling.ops.sample_from_logits``)
bit for bit at every TP size (odd splits included), for every filter and combination, on
adversarial rows (ties at the top-k and top-p boundaries, flat rows that defeat the
candidates, NaN, +-inf, one-hot rows), whatever the batch order; the fallback must run
and be counted; logprobs must match float64 ``log_softmax`` and be identical at every TP
size; bad parameters raise ``ValueError`` naming the field."""

import numpy as np
import pytest
import torch
from scipy import stats

from tpspec import keys as K
from tpspec.exchange import AllGatherKeyExchange, LocalKeyExchange
from tpspec.sampling.ops import keep_mask, sample_from_logits
from tpspec.sampling.select import SamplingStats, sample_filtered, sample_tokens
from tpspec.vocab_parallel import VocabShardedLogits, vocab_shard_bounds

VOCAB = 1201  # odd: every TP size pads its last shard; wider than 4 x 65 candidates at TP <= 4
OFF_K, NAN, INF = 2**31 - 1, float("nan"), float("inf")


def adversarial_batch(seed: int = 0) -> dict:
    """Full logits and per-row parameters, the same on every rank (built from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []

    def add(logits, t, k=OFF_K, p=1.0, m=0.0):
        rows.append((logits, t, k, p, m))

    rand = lambda scale=3.0: torch.randn(VOCAB, generator=gen) * scale  # noqa: E731
    for i in range(12):  # random rows under every filter and combination
        k = [5, 40, 64, 65, 17][i % 5]
        add(rand(), 0.7 + 0.1 * i, k=k)
        add(rand(), 1.0, p=[0.05, 0.5, 0.8, 0.95, 0.999][i % 5])
        add(rand(), 0.9, m=[0.01, 0.1, 0.5, 1e-9][i % 4])
        add(rand(), 0.8, k=20, p=0.8, m=0.05 if i % 2 else 0.0)
    ties = rand().round()  # ties at the top-k boundary and inside the top-p prefix
    for k in (1, 2, 3, 7, 33):
        add(ties, 1.0, k=k)
    for p in (0.1, 0.3, 0.5, 0.7):
        add(ties, 1.0, p=p)
        add(ties, 0.5, k=12, p=p)
    two = torch.full((VOCAB,), -5.0)
    two[[10, 900]] = 2.0
    add(two, 1.0, p=0.5)  # the prefix ends exactly between the two tied columns
    add(two, 1.0, p=0.5000001)
    flat = torch.zeros(VOCAB)  # flat rows: top-p needs hundreds of columns -> retry, then gather
    add(flat, 1.0, p=0.5)
    add(flat, 2.0, p=0.9, m=0.5)
    add(flat, 1.0, m=0.5)  # min-p keeps every column: the masked exchange, no gather
    add(flat, 1.0, k=60)
    near = rand(0.01)  # near-flat: many candidates, min-p across shards
    add(near, 1.0, m=0.99)
    add(near, 1.0, p=0.3)
    special = rand()
    special[[5, 1100]] = NAN
    add(special.clone(), 1.0, k=5)
    special = rand()
    special[[7, 650]] = INF
    add(special.clone(), 1.0, p=0.9)
    add(torch.full((VOCAB,), -INF), 1.0, k=3, p=0.5)
    one_hot = torch.full((VOCAB,), -INF)
    one_hot[1199] = 0.0
    add(one_hot, 0.3, p=0.2)
    add(one_hot, 1.0, m=0.2)
    add(rand(), 1.0, k=1)
    add(rand(), 1e-6, k=5)  # greedy row with a filter: the argmax
    add(rand(), 1.0)  # no filter: today's token
    logits = torch.stack([r[0] for r in rows])
    n = logits.shape[0]
    return {
        "logits": logits,
        "temperature": torch.tensor([r[1] for r in rows], dtype=torch.float32),
        "top_k": torch.tensor([r[2] for r in rows], dtype=torch.int64),
        "top_p": torch.tensor([r[3] for r in rows], dtype=torch.float32),
        "min_p": torch.tensor([r[4] for r in rows], dtype=torch.float32),
        "seeds": torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen),
        "offsets": torch.randint(0, 2**40, (n,), generator=gen),
    }


def reference_tokens(batch: dict) -> torch.Tensor:
    return sample_from_logits(batch["logits"], batch["temperature"], batch["seeds"], batch["offsets"],
                              batch["top_k"], batch["top_p"], batch["min_p"])


def shard(full: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, int]:
    offset, width, real = vocab_shard_bounds(full.shape[1], world, rank)
    local = torch.full((full.shape[0], width), 1e30, dtype=full.dtype)  # padding must never count
    local[:, :real] = full[:, offset:offset + real]
    return local, offset


def draw(batch: dict, ex, world: int, rank: int, order: torch.Tensor | None = None) -> tuple[torch.Tensor, SamplingStats]:
    order = torch.arange(batch["logits"].shape[0]) if order is None else order
    local, offset = shard(batch["logits"][order], world, rank)
    logits = VocabShardedLogits(local, offset, VOCAB, ex)
    rows = K.SamplingRows(batch["temperature"][order], batch["seeds"][order], batch["offsets"][order],
                          top_k=batch["top_k"][order], top_p=batch["top_p"][order], min_p=batch["min_p"][order])
    stats = SamplingStats()
    return sample_filtered(logits, rows, stats=stats), stats


def logprob_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(24, VOCAB, generator=gen) * 4
    full[0, :] = 0.0  # flat: the top ids are the lowest ids
    full[1, 3] = 1e4  # one huge logit: every other logprob near -1e4
    return full, torch.randint(0, VOCAB, (24,), generator=gen)


def filters_worker(rank: int, world: int, group=None) -> dict:
    """The adversarial batch drawn on ``world`` ranks (in two batch orders) and logprobs;
    ``test_spec_ranks.py`` runs it at TP = 2, 3 and 4 inside its one spawn."""
    ex = AllGatherKeyExchange(group)
    batch = adversarial_batch()
    tokens, st = draw(batch, ex, world, rank)
    order = torch.randperm(batch["logits"].shape[0], generator=torch.Generator().manual_seed(world))
    reordered, _ = draw(batch, ex, world, rank, order)
    full, tok = logprob_inputs()
    local, offset = shard(full, world, rank)
    lp = VocabShardedLogits(local, offset, VOCAB, ex).logprobs(tok, top_n=20)
    return {"world": world, "tokens": tokens, "reordered": reordered, "order": order,
            "stats": (st.rows_sharded, st.rows_retried, st.rows_gathered), "logprobs": lp}


def check_filters_against_reference(per_rank: list[dict]) -> None:
    """Every rank's ``filters_worker`` result equals the full-row reference and TP = 1."""
    reference = reference_tokens(adversarial_batch())
    for out in per_rank:
        assert torch.equal(out["tokens"], reference), (out["tokens"] != reference).nonzero().flatten().tolist()
        assert torch.equal(out["reordered"], reference[out["order"]])
        assert out["stats"] == per_rank[0]["stats"]
    sharded, retried, gathered = per_rank[0]["stats"]
    assert sharded + gathered == reference.shape[0] and retried >= 1
    assert gathered >= 1  # the flat top-p rows defeat 4 x 65 candidates a rank
    full, tok = logprob_inputs()
    single = VocabShardedLogits(full, 0, VOCAB, LocalKeyExchange()).logprobs(tok, top_n=20)
    for out in per_rank:
        for got, want in zip(out["logprobs"], single):
            assert torch.equal(got, want)


@pytest.fixture(scope="module")
def reference():
    return reference_tokens(adversarial_batch())


def test_reference_keeps_only_declared_columns_and_rows_are_adversarial(reference):
    batch = adversarial_batch()
    keep = keep_mask(batch["logits"], batch["temperature"], batch["top_k"], batch["top_p"], batch["min_p"])
    sampled = batch["temperature"] >= K.GREEDY_TEMPERATURE_THRESHOLD
    assert bool(keep.gather(1, reference.reshape(-1, 1))[sampled].all())
    # top-k keeps exactly k columns on finite rows, ties broken by column.
    ties = batch["logits"][48]
    assert int(keep[48].sum()) == 1 and int(keep[50].sum()) == 3
    order = sorted(range(VOCAB), key=lambda j: (-float(ties[j]), j))
    assert torch.nonzero(keep[50]).flatten().tolist() == sorted(order[:3])


def test_tp1_equals_reference_and_counts_the_fallback(reference):
    batch = adversarial_batch()
    tokens, st = draw(batch, LocalKeyExchange(), 1, 0)
    assert torch.equal(tokens, reference)
    assert st.rows_gathered >= 1 and st.rows_retried >= st.rows_gathered
    assert st.rows_sharded + st.rows_gathered == batch["logits"].shape[0]
    assert 0 < st.fallback_share < 0.1


def test_logprobs_match_float64_log_softmax():
    full, tok = logprob_inputs()
    ref = torch.log_softmax(full.double(), dim=1)
    token_lp, top_ids, top_lp, ranks = VocabShardedLogits(full, 0, VOCAB, LocalKeyExchange()).logprobs(tok, top_n=20)
    assert (token_lp - ref.gather(1, tok.reshape(-1, 1)).reshape(-1)).abs().max() < 1e-5
    # vLLM's rank: the columns whose logit is at least the token's (the flat row: every column).
    assert torch.equal(ranks, (full >= full.gather(1, tok.reshape(-1, 1))).sum(dim=1))
    assert int(ranks[0]) == VOCAB and int(ranks.min()) >= 1
    top_ref = torch.topk(ref, 20, dim=1)
    assert (top_lp - top_ref.values).abs().max() < 1e-5
    assert torch.equal(top_ids[1:], top_ref.indices[1:])
    assert top_ids[0].tolist() == list(range(20))  # the flat row: ties go to the lower id
    empty = VocabShardedLogits(full, 0, VOCAB, LocalKeyExchange()).logprobs(tok)
    assert empty[1].shape == (24, 0) and torch.equal(empty[0], token_lp)


def test_no_filter_rows_give_todays_token_and_neutral_filters_change_nothing():
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(16, VOCAB, generator=gen) * 2
    t = torch.rand(16, generator=gen) + 0.2
    seeds, offsets = torch.arange(16) * 7 + 1, torch.arange(16) * 32
    logits = VocabShardedLogits(full, 0, VOCAB, LocalKeyExchange())
    today = K.unpack_indices(K.local_row_keys(full, 0, vocab_size=VOCAB, rows=K.SamplingRows(t, seeds, offsets)))
    assert torch.equal(logits.sample(t, seeds, offsets), today)
    assert torch.equal(sample_tokens(logits, t, seeds, offsets, top_k=VOCAB, top_p=1.0, min_p=0.0), today)


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=0), "top_k"), (dict(top_k=-3), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_k=torch.tensor([1.0, 2.0, 3.0])), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=torch.tensor([0.5, NAN, 0.5])), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=2.0), "min_p"),
    (dict(min_p=torch.ones(2)), "min_p"), (dict(top_p=True), "top_p"),
])
def test_bad_filter_parameters_raise_naming_the_field(kwargs, field):
    logits = VocabShardedLogits(torch.zeros(3, 10), 0, 10, LocalKeyExchange())
    with pytest.raises(ValueError, match=field):
        sample_tokens(logits, 1.0, torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), **kwargs)


def test_filters_on_a_logits_subclass_raise_instead_of_reading_the_wrong_rows():
    """A subclass (attention DP's stacked rows) holds rows other than its own in ``local``: filtered
    draws refuse it with a clear error; its unfiltered draws are its own ``sample``."""

    class Stacked(VocabShardedLogits):
        pass

    logits = Stacked(torch.randn(3, 10), 0, 10, LocalKeyExchange())
    z = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="select_tokens"):
        sample_tokens(logits, 1.0, z, z, top_k=2)
    assert torch.equal(sample_tokens(logits, 1.0, z, z), logits.sample(1.0, z, z))


def test_bad_logprobs_arguments_raise():
    logits = VocabShardedLogits(torch.zeros(3, 10), 0, 10, LocalKeyExchange())
    with pytest.raises(ValueError, match="top_n"):
        logits.logprobs(torch.zeros(3, dtype=torch.int64), top_n=21)
    with pytest.raises(ValueError, match="tokens"):
        logits.logprobs(torch.zeros(2, dtype=torch.int64))


CHI_CASES = [
    dict(t=0.8, k=4, p=1.0, m=0.0),
    dict(t=1.2, k=OFF_K, p=0.7, m=0.0),
    dict(t=1.0, k=OFF_K, p=1.0, m=0.04),
    dict(t=0.9, k=6, p=0.9, m=0.02),
]


def _truncated_law(row: torch.Tensor, case: dict) -> np.ndarray:
    keep = keep_mask(row.reshape(1, -1), torch.tensor([case["t"]]), torch.tensor([case["k"]]),
                     torch.tensor([case["p"]]), torch.tensor([case["m"]]))[0].numpy()
    z = row.double().numpy() / case["t"]
    w = np.exp(z - z.max()) * keep
    return w / w.sum()


@pytest.mark.slow
@pytest.mark.parametrize("case", CHI_CASES)
def test_filtered_draws_follow_the_exact_truncated_distribution(case):
    """Chi-square of 60 000 seeded draws of one row at TP = 1 (the sharded draw is the
    reference bit for bit at every TP size, tested above) against the exact law."""
    vocab, n = 16, 60_000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(11))
    expected = _truncated_law(row, case)
    logits = VocabShardedLogits(row.reshape(1, -1).expand(n, -1).contiguous(), 0, vocab, LocalKeyExchange())
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    tokens = sample_tokens(logits, full(case["t"], torch.float32), torch.arange(n, dtype=torch.int64) * 7919 + 3,
                           full(9, torch.int64), top_k=full(case["k"], torch.int64),
                           top_p=full(case["p"], torch.float32), min_p=full(case["m"], torch.float32))
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert counts[expected == 0].sum() == 0, "a filtered column was drawn"
    live = expected > 0
    assert 3 <= live.sum() < vocab, "the case must truncate the row"
    _, pvalue = stats.chisquare(counts[live], expected[live] * n)
    assert pvalue > 1e-3, (counts, expected * n)


def test_gather_rows_and_sum_rows_contract():
    from tpspec.exchange import cuda_module, ll_plan

    values = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    for ex in (LocalKeyExchange(), AllGatherKeyExchange()):  # a group of one: the values themselves
        assert torch.equal(ex.gather_rows(values), values)
        assert torch.equal(ex.sum_rows(values[:, 0]), values[:, 0])
        with pytest.raises(ValueError, match="int64"):
            ex.gather_rows(values.float())
        with pytest.raises(ValueError, match="2-D"):
            ex.gather_rows(values[:, 0])
        with pytest.raises(ValueError, match="1-D"):
            ex.sum_rows(values)
        with pytest.raises(ValueError, match="channel"):
            ex.sum_rows(values[:, 0], channel=7)
    for world in range(1, 9):  # the LL exchange has a gather kernel for every world size
        assert ll_plan.gather_rows_kernel(world) in cuda_module.KERNEL_NAMES
