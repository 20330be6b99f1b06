"""Keys order candidates exactly like torch.argmax; Philox and the portable arithmetic are right."""

import math

import pytest
import torch

from tpspec import keys as K

NAN_PAYLOADS = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001, 0xFFFFFFFF]


def nan_with_bits(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def key_argmax(rows: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(rows.shape[1], dtype=torch.int64).reshape(1, -1)
    return K.unpack_indices(K.pack_keys(rows, cols).max(dim=1).values)


def adversarial_rows(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    width = 37
    rows = [torch.randn(width, generator=gen) for _ in range(40)]
    rows.append(torch.zeros(width))  # all equal -> 0
    rows.append(torch.full((width,), -3.0))
    r = torch.zeros(width); r[5] = -0.0; r[3] = -0.0; rows.append(r)  # +-0 ties
    r = torch.full((width,), -0.0); r[9] = 0.0; rows.append(r)
    r = torch.randn(width, generator=gen); r[[4, 20, 30]] = float("inf"); rows.append(r)  # inf ties
    r = torch.full((width,), float("-inf")); rows.append(r)
    r = torch.full((width,), float("-inf")); r[17] = -1e30; rows.append(r)
    for i, bits in enumerate(NAN_PAYLOADS):  # NaN of every payload/sign beats +inf; first NaN wins
        r = torch.randn(width, generator=gen); r[2] = float("inf"); r[10 + i] = nan_with_bits(bits)
        r[30] = nan_with_bits(NAN_PAYLOADS[(i + 1) % len(NAN_PAYLOADS)]); rows.append(r)
    r = torch.randn(width, generator=gen); r[[7, 8]] = r.max() + 1; rows.append(r)  # tie -> lowest
    # values that collide after rounding to the narrow dtype
    r = torch.linspace(1.0, 1.0 + 1e-4, width); rows.append(r)
    r = torch.tensor([float(x) for x in range(width)]) * 1e-40; rows.append(r)  # denormals
    r = torch.full((width,), 65504.0); r[-1] = 1e38; rows.append(r)
    out = torch.stack(rows)
    # Narrow dtypes: conversion keeps NaN-ness (payloads are tested in test_narrow_nan_payloads_and_signs).
    return out.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_key_argmax_matches_torch_argmax_on_adversarial_rows(dtype):
    gen = torch.Generator().manual_seed(1)
    rows = adversarial_rows(dtype, gen)
    assert torch.equal(key_argmax(rows), torch.argmax(rows, dim=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_nan_payloads_and_signs(dtype):
    int_dtype = torch.int16
    base = torch.zeros(4, 8, dtype=dtype)
    base[:, 1] = float("inf")
    payloads = [0x7FC1, 0xFFC1, 0x7F81, 0xFFFF] if dtype == torch.bfloat16 else [0x7E01, 0xFE01, 0x7C01, 0xFFFF]
    for i, p in enumerate(payloads):
        base[i, 3 + i] = torch.tensor([p], dtype=torch.int32).to(int_dtype).view(dtype)
        base[i, 7] = torch.tensor([payloads[-1 - i]], dtype=torch.int32).to(int_dtype).view(dtype)
    assert torch.isnan(base[:, 3:]).any(dim=1).all()
    assert torch.equal(key_argmax(base), torch.argmax(base, dim=1))


def test_random_rows_with_many_ties_all_dtypes():
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = torch.randint(-3, 4, (500, 64), generator=gen).to(dtype)  # heavy ties
        assert torch.equal(key_argmax(rows), torch.argmax(rows, dim=1))


def test_pack_unpack_roundtrip_and_order():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(1000, generator=gen) * 1e3
    values[:4] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])
    idx = torch.randint(0, 2**32, (1000,), generator=gen, dtype=torch.int64)
    keys = K.pack_keys(values, idx)
    v, i = K.unpack_keys(keys)
    assert torch.equal(i, idx)
    assert torch.equal(v, K.canonical_float32(values))
    # Signed key order == (value, -index) lexicographic order.
    order = torch.argsort(keys)
    sv, si = v[order], i[order]
    assert bool(((sv[1:] > sv[:-1]) | ((sv[1:] == sv[:-1]) & (si[1:] < si[:-1]))).all())
    # The unsigned form is what the kernel's atomic max sees: top bit of the key flipped.
    assert int(K.pack_keys(torch.tensor([-0.0]), 0)) == int(K.pack_keys(torch.tensor([0.0]), 0))
    assert int(K.pack_keys(torch.tensor([float("-inf")]), 2**32 - 1)) > K.EMPTY_KEY


def test_nan_is_canonical_and_above_inf():
    nan_keys = [int(K.pack_keys(torch.tensor([nan_with_bits(b)]), 5)) for b in NAN_PAYLOADS]
    assert len(set(nan_keys)) == 1
    assert nan_keys[0] > int(K.pack_keys(torch.tensor([float("inf")]), 0))


def test_pack_rejects_integer_values():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        K.pack_keys(torch.tensor([1, 2]), torch.tensor([0, 1]))


# ---------------------------------------------------------------- philox / noise

def _words(*values):
    return tuple(torch.tensor([v], dtype=torch.int64) for v in values)


@pytest.mark.parametrize(
    "counter,key,expected",
    [  # Random123 known-answer vectors for philox4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)
def test_philox_known_answers(counter, key, expected):
    out = K.philox4x32_10(_words(*counter), _words(*key))
    assert tuple(int(o) for o in out) == expected


def test_philox_words_layout_uses_global_column_and_all_four_words():
    seeds = torch.tensor([7, -1], dtype=torch.int64)
    offsets = torch.tensor([3, 2**40 + 5], dtype=torch.int64)
    cols = torch.arange(5, 23, dtype=torch.int64)
    words = K.philox_words(seeds, offsets, cols)
    for r in range(2):
        s, o = int(seeds[r]) & K.MASK32, int(offsets[r])
        for c, col in enumerate(cols.tolist()):
            block = col >> 2
            out = K.philox4x32_10(
                _words(block & K.MASK32, block >> 32, o & K.MASK32, (o >> 32) & K.MASK32),
                _words(s, (int(seeds[r]) >> 32) & K.MASK32),
            )
            assert int(words[r, c]) == int(out[col & 3])
    # A sub-range of columns sees the same words (noise does not depend on the shard).
    assert torch.equal(K.philox_words(seeds, offsets, cols[7:11]), words[:, 7:11])


def test_portable_log_accuracy():
    gen = torch.Generator().manual_seed(4)
    x = torch.exp(torch.empty(200_000, dtype=torch.float64).uniform_(-30, 30, generator=gen)).float()
    x = torch.cat([x, torch.tensor([1.0, 2.0, 0.5, 1.4142135, 1.4142137, 3e38, 1.2e-38])])
    ref = torch.log(x.double())
    got = K.portable_log(x).double()
    err = (got - ref).abs() / ref.abs().clamp_min(1.0)
    assert float(err.max()) < 4e-7


def test_exponential_accuracy_both_branches():
    gen = torch.Generator().manual_seed(5)
    words = torch.randint(0, 2**32, (500_000,), generator=gen, dtype=torch.int64)
    edge = torch.tensor([0, 1, 2, 1000, 2**31 - 1, 2**31, 2**32 - 129, 2**32 - 128, 2**32 - 1], dtype=torch.int64)
    words = torch.cat([words, edge])
    e = K.exponential_from_words(words).double()
    u = (words.double() + 0.5) * 2.0**-32
    ref = -torch.log1p(-u)
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all())
    assert float(((e - ref) / ref).abs().max()) < 1e-6


def test_gumbel_noise_moments():
    gen = torch.Generator().manual_seed(6)
    seeds = torch.randint(0, 2**62, (64,), generator=gen, dtype=torch.int64)
    noise = K.gumbel_noise(seeds, torch.zeros(64, dtype=torch.int64), torch.arange(4096)).double()
    # Standard Gumbel: mean = Euler-Mascheroni, variance = pi^2 / 6.
    assert abs(float(noise.mean()) - 0.5772156649) < 0.01
    assert abs(float(noise.var()) - math.pi**2 / 6) < 0.03


def test_local_row_keys_greedy_threshold_and_padding():
    logits = torch.tensor([[1.0, 5.0, 2.0, 9.0], [3.0, 1.0, 0.0, 0.0]])
    # Column 3 (global 13) is padding when vocab_size = 13.
    keys = K.local_row_keys(logits, 10, vocab_size=13)
    assert K.unpack_indices(keys).tolist() == [11, 10]
    temp = torch.tensor([1e-6, 0.0])
    seeds = torch.tensor([1, 2]); offsets = torch.tensor([0, 0])
    keys_t = K.local_row_keys(logits, 10, vocab_size=13, temperature=temp, seeds=seeds, offsets=offsets)
    assert torch.equal(keys_t, keys)  # below threshold -> greedy, bit for bit
    empty = K.local_row_keys(logits, 20, vocab_size=13)
    assert (empty == K.EMPTY_KEY).all()
