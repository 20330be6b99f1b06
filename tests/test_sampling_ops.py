"""Full-logit sampling ops: greedy semantics, top-k/top-p/min-p against a brute-force
reference, chi-square of the draws against the filtered renormalized distribution, and
bit-equality with the sharded Gumbel-max path for temperature-only rows."""

import numpy as np
import pytest
import torch
from scipy import stats

from tpspec import keys as K
from tpspec.sampling import TOP_K_DISABLED, filtered_probs, greedy_tokens, keep_mask, sample_from_logits


def brute_force_keep(x: list[float], t: float, k: int, p: float, m: float) -> list[bool]:
    """The filter definition of docs/determinism.md, written independently, column by column in
    Python integers: ``s = x / T`` in float32, masses ``floor(exp(s - s_max) * 2**40)`` (the
    portable ``exp``, the one shared primitive), top-k the ``k`` best in key order, top-p the
    shortest prefix whose mass reaches ``ceil(round(p * 2**24) * Z / 2**24)``, min-p the columns
    with mass ``>= floor(m * 2**40)``; the best column always stays. A filter is off at
    ``k >= V``, ``p >= 1``, ``m == 0``."""
    v = len(x)
    s = [float(np.float32(xi) / np.float32(t)) + 0.0 for xi in x]  # float32 division; -0 -> +0
    order = sorted(range(v), key=lambda j: (-s[j], j))
    best = s[order[0]]
    diffs = torch.tensor([float(np.float32(s[j]) - np.float32(best)) for j in range(v)], dtype=torch.float32)
    mass = [int(e * 2**40) for e in K.portable_exp(diffs).tolist()]
    keep = [True] * v
    kept = order[:k] if k < v else order
    if k < v:
        keep = [j in kept for j in range(v)]
    if p < 1.0:
        z = sum(mass[j] for j in kept)
        target = -(-round(p * 2**24) * z // 2**24)
        before = 0
        for j in kept:
            keep[j] = keep[j] and before < target
            before += mass[j]
    if m > 0.0:
        threshold = int(float(np.float32(m)) * 2**40)
        keep = [keep[j] and mass[j] >= threshold for j in range(v)]
    keep[order[0]] = True
    return keep


def test_greedy_matches_torch_argmax_with_ties_nan_inf():
    x = torch.tensor([
        [1.0, 3.0, 3.0, -1.0],
        [float("nan"), 1.0, float("nan"), 2.0],
        [float("-inf"), float("-inf"), -5.0, float("-inf")],
        [-0.0, 0.0, -1.0, -0.0],
        [float("inf"), 1.0, float("inf"), 0.0],
    ])
    assert torch.equal(greedy_tokens(x), torch.argmax(x, dim=1))
    # Greedy rows of a mixed call take the argmax too.
    t = torch.tensor([0.0, 1.0, 1e-6, 0.0, 0.0])
    seeds = torch.arange(5, dtype=torch.int64)
    out = sample_from_logits(x, t, seeds, torch.zeros(5, dtype=torch.int64))
    assert torch.equal(out[[0, 2, 3, 4]], torch.argmax(x, dim=1)[[0, 2, 3, 4]])


def test_keep_mask_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 400, 23
    x = torch.randn(rows, vocab, generator=gen) * 2
    x = torch.where(torch.rand(rows, vocab, generator=gen) < 0.2, x.round(), x)  # ties
    t = torch.rand(rows, generator=gen) * 1.5 + 0.2
    k = torch.randint(1, vocab + 3, (rows,), generator=gen)
    k[::4] = TOP_K_DISABLED
    p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    p[1::4] = 1.0
    m = torch.rand(rows, generator=gen) * 0.3
    m[2::3] = 0.0
    # Rows whose top-p prefix ends exactly at the target: four equal columns and p = 1/2 keep two;
    # three of them (top-k 3) and p = 2/3, which rounds up at 24 bits, keep all three.
    x[-1], t[-1], k[-1], p[-1], m[-1] = torch.tensor([0.0] * 4 + [-30.0] * (vocab - 4)), 1.0, TOP_K_DISABLED, 0.5, 0.0
    x[-2], t[-2], k[-2], p[-2], m[-2] = torch.tensor([0.0] * 4 + [-30.0] * (vocab - 4)), 1.0, 3, 2 / 3, 0.0
    got = keep_mask(x, t, k, p, m)
    bad = [r for r in range(rows)
           if got[r].tolist() != brute_force_keep(x[r].tolist(), float(t[r]), int(k[r]), float(p[r]), float(m[r]))]
    assert bad == [], bad
    assert got[-1].tolist()[:4] == [True, True, False, False] and got[-2].tolist()[:4] == [True, True, True, False]
    assert bool(got.any(dim=1).all()), "every row keeps at least one column"


CASES = [
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=TOP_K_DISABLED, top_p=0.75, min_p=0.0),
    dict(temperature=1.0, top_k=TOP_K_DISABLED, top_p=1.0, min_p=0.12),
    dict(temperature=0.9, top_k=8, top_p=0.85, min_p=0.03),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_filtered_draws_follow_renormalized_distribution(case):
    gen = torch.Generator().manual_seed(1)
    vocab, n = 12, 120_000
    row = torch.randn(vocab, generator=gen) * 1.5
    keep = brute_force_keep(row.tolist(), case["temperature"], case["top_k"], case["top_p"], case["min_p"])
    z = np.array(row.tolist(), dtype=np.float64) / case["temperature"]
    w = np.exp(z - z.max()) * np.array(keep, dtype=np.float64)
    expected = w / w.sum()
    x = row.reshape(1, -1).expand(n, -1)
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    tokens = sample_from_logits(
        x, full(case["temperature"], torch.float32),
        torch.arange(n, dtype=torch.int64) * 7919 + 11, torch.full((n,), 5, dtype=torch.int64),
        full(case["top_k"], torch.int64), full(case["top_p"], torch.float32), full(case["min_p"], torch.float32),
    )
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert counts[~np.array(keep)].sum() == 0, "a filtered column was drawn"
    live = expected > 0
    assert (expected[live] * n).min() >= 5
    _, pvalue = stats.chisquare(counts[live], expected[live] * n)
    assert pvalue > 1e-3, (counts, expected * n)
    # filtered_probs is the same law.
    probs = filtered_probs(row.reshape(1, -1), full(case["temperature"], torch.float32)[:1],
                           full(case["top_k"], torch.int64)[:1], full(case["top_p"], torch.float32)[:1],
                           full(case["min_p"], torch.float32)[:1])
    np.testing.assert_allclose(probs[0].numpy(), expected, atol=1e-6)


def test_temperature_only_rows_equal_sharded_gumbel_bits():
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 64, 1000
    x = (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    t = torch.rand(rows, generator=gen) + 0.1
    t[::6] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    offsets = torch.randint(0, 2**40, (rows,), generator=gen)
    want = K.unpack_indices(K.local_row_keys(x, 0, vocab_size=vocab, rows=K.SamplingRows(t, seeds, offsets)))
    got = sample_from_logits(x, t, seeds, offsets, None, None, None)
    assert torch.equal(got, want)
    # Neutral filters change nothing.
    got2 = sample_from_logits(x, t, seeds, offsets, torch.full((rows,), TOP_K_DISABLED), torch.ones(rows), torch.zeros(rows))
    assert torch.equal(got2, want)


def test_filtered_probs_greedy_rows_are_one_hot_and_rows_sum_to_one():
    x = torch.tensor([[0.0, 2.0, 2.0, 1.0], [0.5, 0.1, 0.3, 0.2]])
    probs = filtered_probs(x, torch.tensor([0.0, 1.0]), torch.tensor([TOP_K_DISABLED, 3]), torch.tensor([1.0, 1.0]),
                           torch.tensor([0.0, 0.0]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1, 1] == 0.0
    assert torch.allclose(probs.sum(dim=1), torch.ones(2), atol=1e-6)


def test_rows_with_nan_or_inf_logits_are_point_masses_on_the_draws_column():
    """A sampled row with a NaN or +inf logit (or only -inf) has no softmax; its draw is
    the key argmax, so filtered_probs (rejection sampling's target law) is one-hot there,
    whatever the filters (min-p on NaN probabilities, a top-p of float32's smallest)."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([
        [0.0, 1.0, inf, 2.0, inf],  # the first +inf
        [nan, 1.0, inf, 2.0, nan],  # the first NaN, above +inf
        [-inf, -inf, -inf, -inf, -inf],  # nothing but -inf: column 0
        [0.0, 5.0, 1.0, 2.0, 3.0],  # finite, with a top-p that is float32's smallest
    ])
    rows = x.shape[0]
    t = torch.ones(rows)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.2e-38])
    min_p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    expected = [2, 0, 0, 1]
    probs = filtered_probs(x, t, None, top_p, min_p)
    assert probs.argmax(dim=1).tolist() == expected and torch.equal(probs.sum(dim=1), torch.ones(rows))
    for seed in range(5):  # the draws agree, seed after seed
        seeds = torch.full((rows,), seed, dtype=torch.int64)
        drawn = sample_from_logits(x, t, seeds, torch.zeros(rows, dtype=torch.int64), None, top_p, min_p)
        assert drawn.tolist() == expected


def test_bad_inputs():
    x = torch.randn(3, 5)
    z = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="temperature"):
        sample_from_logits(x, torch.ones(2), z, z)
    with pytest.raises(ValueError, match="logits"):
        sample_from_logits(torch.randn(5), torch.ones(3), z, z)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or infinite"):
            sample_from_logits(x, torch.tensor([1.0, bad, 0.0]), z, z)
