"""Forced acceptance: env parsing, fractional rates converge, cap at the draft
length, context requests emit one token, warm-up skips (multi-rank: test_spec_ranks.py)."""

import pytest
import torch

from tpspec.speculative import FORCE_ENV, ForcedAcceptance, read_forced_rate
from tpspec.speculative.forced import POOL_SIZE


def test_env_parsing():
    assert read_forced_rate({}) is None and read_forced_rate({FORCE_ENV: " "}) is None
    assert read_forced_rate({FORCE_ENV: "2.25"}) == 2.25
    for bad in ("abc", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=FORCE_ENV):
            read_forced_rate({FORCE_ENV: bad})
    assert ForcedAcceptance.from_env(environ={}) is None
    assert ForcedAcceptance.from_env(environ={FORCE_ENV: "1"}).rate == 1.0
    with pytest.raises(ValueError, match="rate"):
        ForcedAcceptance(-0.5)


@pytest.mark.parametrize("rate", [0.25, 1.3, 2.75])
def test_fractional_rates_converge(rate):
    fa = ForcedAcceptance(rate)
    slots = torch.arange(64)
    lens = torch.full((64,), 3)
    total = torch.stack([fa.num_drafts_accepted(slots, lens) for _ in range(2000)]).double()
    assert abs(total.mean().item() - rate) < 0.01
    assert set(total.unique().tolist()) <= {float(int(rate)), float(int(rate) + 1)}


def test_pool_is_fixed_and_uniform():
    a, b = ForcedAcceptance(0.5), ForcedAcceptance(0.5)
    assert torch.equal(a.pool, b.pool) and a.pool.shape == (POOL_SIZE,)
    assert 0.0 < a.pool.min() and a.pool.max() < 1.0 and abs(a.pool.mean().item() - 0.5) < 0.01
    # Index formula: counter * 6007 + slot * 1009 mod 65536; padding slot -1 wraps around.
    a.counter.fill_(3)
    slots = torch.tensor([0, 5, -1])
    idx = [(3 * 6007 + s * 1009) % POOL_SIZE for s in (0, 5, -1)]
    assert torch.equal(a.pool_uniforms(slots), a.pool[idx])


def test_apply_caps_at_draft_len_and_contexts_emit_one():
    fa = ForcedAcceptance(2.0)
    target = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, -1, -1, -1]])
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 0, 0]])
    accepted, num = fa.apply(target, drafts, torch.tensor([3, 1, 0]), torch.tensor([0, 1, 2]))
    assert num.tolist() == [3, 2, 1]
    assert accepted.tolist() == [[1, 2, 12, -1], [4, 21, -1, -1], [30, -1, -1, -1]]
    assert int(fa.counter) == 1
    assert fa.apply(target, drafts, torch.tensor([3, 1, 0]), torch.tensor([0, 1, 2]), is_warmup=True) is None
    assert int(fa.counter) == 1
