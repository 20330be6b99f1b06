"""Strict acceptance, rejection sampling (lossless, chi-square), greedy reduction,
per-request reproducibility, and the per-slot draft distribution store."""

import numpy as np
import pytest
import torch
from scipy import stats

from tpspec.speculative import DraftLogitsStore, accept_from_targets, rejection_sample, strict_accept

V = 6
P = torch.tensor([
    [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
    [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
    [0.40, 0.05, 0.05, 0.30, 0.10, 0.10],
])  # target rows p_0, p_1, p_2
Q = torch.tensor([
    [0.10, 0.40, 0.10, 0.25, 0.05, 0.10],
    [0.30, 0.10, 0.25, 0.05, 0.20, 0.10],
])  # draft rows q_0, q_1


def chi2_pvalue(tokens: np.ndarray, probs: torch.Tensor) -> float:
    counts = np.bincount(tokens, minlength=V)
    expected = probs.double().numpy()
    expected = expected / expected.sum() * len(tokens)
    assert expected.min() >= 5
    return stats.chisquare(counts, expected).pvalue


def test_strict_accept_flat_layout():
    # 1 context request, then 2 generation requests with D = 3.
    target = torch.tensor([9, 1, 2, 3, 4, 5, 6, 7, 8])
    drafts = torch.tensor([[1, 2, 3], [5, 0, 7]])
    accepted, num = strict_accept(target, drafts, num_contexts=1, batch_size=3)
    assert num.tolist() == [1, 4, 2]
    assert accepted.tolist() == [[9, -1, -1, -1], [1, 2, 3, 4], [5, 6, -1, -1]]
    # [batch_size, D] drafts (context row ignored) give the same answer.
    accepted2, num2 = strict_accept(target, torch.cat([torch.full((1, 3), 77), drafts]), 1, 3)
    assert torch.equal(accepted, accepted2) and torch.equal(num, num2)
    assert num.dtype == torch.int64 and accepted.dtype == torch.int64


def test_strict_accept_errors():
    with pytest.raises(ValueError, match="rows"):
        strict_accept(torch.arange(5), torch.zeros(2, 3, dtype=torch.int64), 1, 3)
    with pytest.raises(ValueError, match="num_contexts"):
        strict_accept(torch.arange(5), torch.zeros(2, 3, dtype=torch.int64), 4, 3)
    with pytest.raises(ValueError, match="D\\+1"):
        accept_from_targets(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))


def _batch(n: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(Q[i], n, replacement=True, generator=gen) for i in range(d)], dim=1)
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003 + 17
    offsets = torch.full((n,), 12345, dtype=torch.int64)
    return drafts, seeds, offsets


@pytest.mark.slow
def test_rejection_sampling_is_lossless():
    n, d = 240_000, 2
    drafts, seeds, offsets = _batch(n, d, seed=0)
    draft_probs = Q[:d].expand(n, d, V)
    target_probs = P.expand(n, d + 1, V)
    accepted, num = rejection_sample(draft_probs, drafts, target_probs, seeds, offsets)
    acc, num = accepted.numpy(), num.numpy()
    assert ((num >= 1) & (num <= d + 1)).all()
    assert (acc[np.arange(n), num - 1] >= 0).all() and all((acc[num <= j, j] == -1).all() for j in range(d + 1))
    # The first emitted token follows p_0; given the first draft accepted, the second follows p_1;
    # given both accepted, the bonus follows p_2.
    assert chi2_pvalue(acc[:, 0], P[0]) > 1e-3
    assert chi2_pvalue(acc[num >= 2, 1], P[1]) > 1e-3
    assert chi2_pvalue(acc[num == 3, 2], P[2]) > 1e-3
    # Acceptance rate of the first draft is sum(min(p, q)).
    rate = (num >= 2).mean()
    assert abs(rate - float(torch.minimum(P[0], Q[0]).sum())) < 0.005


@pytest.mark.slow
def test_rejection_with_deterministic_drafts_and_draft_lens_is_lossless():
    n = 200_000
    gen = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, V, (n, 2), generator=gen)  # any fixed draft choice: q = one-hot
    seeds = torch.arange(n, dtype=torch.int64) + 5
    offsets = torch.zeros(n, dtype=torch.int64)
    lens = torch.randint(0, 3, (n,), generator=gen)
    accepted, num = rejection_sample(None, drafts, P.expand(n, 3, V), seeds, offsets, draft_lens=lens)
    acc = accepted.numpy()
    assert (num.numpy() <= lens.numpy() + 1).all()
    assert chi2_pvalue(acc[:, 0], P[0]) > 1e-3
    second = (num >= 2).numpy()
    assert chi2_pvalue(acc[second, 1], P[1]) > 1e-3


def test_greedy_rows_reduce_to_strict_acceptance():
    gen = torch.Generator().manual_seed(4)
    n, d, vocab = 2000, 3, 9
    logits = torch.randn(n, d + 1, vocab, generator=gen)
    target_tokens = logits.argmax(dim=2)
    one_hot = torch.zeros_like(logits).scatter_(2, target_tokens.unsqueeze(2), 1.0)
    # Drafts often equal the target's choice so long accepted runs occur.
    drafts = torch.where(torch.rand(n, d, generator=gen) < 0.7, target_tokens[:, :d], torch.randint(0, vocab, (n, d), generator=gen))
    q = torch.softmax(torch.randn(n, d, vocab, generator=gen), dim=2)
    want = accept_from_targets(target_tokens, drafts)
    for draft_probs in (q, None):
        got = rejection_sample(draft_probs, drafts, one_hot, torch.arange(n), torch.zeros(n, dtype=torch.int64))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rejection_is_reproducible_per_request_stream():
    n, d = 512, 2
    drafts, seeds, offsets = _batch(n, d, seed=5)
    gen = torch.Generator().manual_seed(6)
    q = torch.softmax(torch.randn(n, d, V, generator=gen), dim=2)
    p = torch.softmax(torch.randn(n, d + 1, V, generator=gen), dim=2)
    a1, n1 = rejection_sample(q, drafts, p, seeds, offsets)
    perm = torch.randperm(n, generator=gen)
    a2, n2 = rejection_sample(q[perm], drafts[perm], p[perm], seeds[perm], offsets[perm])
    assert torch.equal(a2, a1[perm]) and torch.equal(n2, n1[perm])  # independent of batch position
    a3, _ = rejection_sample(q, drafts, p, seeds, offsets + 32)  # another window: other draws
    assert not torch.equal(a3, a1)


def test_rejection_sample_validation():
    drafts = torch.zeros(2, 2, dtype=torch.int64)
    p = torch.full((2, 3, V), 1.0 / V)
    z = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(None, drafts, p[:, :2], z, z)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(2, 2, V + 1), drafts, p, z, z)
    with pytest.raises(ValueError, match="draft_token_ids must lie"):
        rejection_sample(None, torch.full((2, 2), V), p, z, z)
    with pytest.raises(ValueError, match="seeds"):
        rejection_sample(None, drafts, p, torch.zeros(3, dtype=torch.int64), z)
    with pytest.raises(RuntimeError, match="flashinfer"):
        rejection_sample(None, drafts, p, z, z, backend="flashinfer")


def test_auto_never_reaches_for_flashinfer(monkeypatch):
    """``backend="auto"`` draws with each request's own stream: FlashInfer's chain sampler (one
    seed for the batch, never run on a GPU here) is not even looked up unless asked for."""
    import tpspec.speculative.accept as accept

    def looked_up():
        raise AssertionError("auto looked up flashinfer's sampler")

    monkeypatch.setattr(accept, "_flashinfer_chain", looked_up)
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 3, 8, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(2, 2, 8, generator=gen), dim=-1)
    drafts = torch.tensor([[1, 2], [3, 4]])
    z = torch.zeros(2, dtype=torch.int64)
    accepted, num = rejection_sample(q, drafts, p, z, z, needs_reproducible_streams=False)
    assert accepted.shape == (2, 3) and bool((num >= 1).all())


def test_draft_logits_store_per_slot_and_scratch():
    store = DraftLogitsStore(num_slots=3, max_draft_len=2, shard_width=4)
    a = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    b = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    store.write([2], 0, a)
    store.write(torch.tensor([0]), 0, b)
    store.write([-1], 0, torch.full((1, 4), 9.0))  # padding goes to scratch
    out = store.read(torch.tensor([0, 2]), 1)  # read in another batch order
    assert out.shape == (2, 1, 4)
    assert torch.equal(out[:, 0], torch.cat([b, a]))
    assert torch.equal(store.read([-1], 1)[0, 0], torch.full((4,), 9.0))
    with pytest.raises(ValueError, match="slot"):
        store.read(torch.tensor([3]), 1)
    with pytest.raises(ValueError, match="logits must be"):
        store.write([0], 1, torch.zeros(1, 5))
