"""Keys order candidates exactly like torch.argmax; Philox and the portable arithmetic are right."""

import math

import pytest
import torch

from tpspec import keys as K

NAN_PAYLOADS = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001, 0xFFFFFFFF]


def nan_with_bits(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def key_argmax(rows: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(rows.shape[1], dtype=torch.int64, device=rows.device).reshape(1, -1)
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_key_argmax_matches_torch_argmax_on_cuda(dtype):
    """The same on CUDA, whose argmax the local exchange's greedy path runs."""
    gen = torch.Generator().manual_seed(1)
    for rows in (adversarial_rows(dtype, gen), torch.randint(-3, 4, (500, 64), generator=gen).to(dtype)):
        rows = rows.cuda()
        assert torch.equal(key_argmax(rows).cpu(), torch.argmax(rows, dim=1).cpu())


def test_local_exchange_greedy_argmax_is_the_keys_maximum():
    """The one-rank exchange picks greedy rows with ``torch.argmax`` over the real columns: the
    keys' pick, on adversarial rows, with a vocabulary offset and padding columns; a slice wholly
    past the vocabulary still offers no candidate."""
    from tpspec.exchange import LocalKeyExchange
    from tpspec.exchange.base import Channel

    ex = LocalKeyExchange("cpu")
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = adversarial_rows(dtype, gen)
        for offset, vocab_size in ((0, None), (0, 30), (5, 40), (100, 120)):
            want = K.unpack_indices(ex._max_local_keys(rows, offset, vocab_size, None, Channel.TARGET))
            assert torch.equal(ex.argmax_logits(rows, offset, vocab_size=vocab_size, channel=Channel.TARGET), want)
        assert (ex.argmax_logits(rows, 10, vocab_size=5) == 2**32 - 1).all()


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
    for bad in (-1, 2**32, 1.0, True):
        with pytest.raises(ValueError, match=r"index must be an int in \[0, 2\*\*32\)"):
            K.pack_keys(torch.tensor([1.0]), bad)
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
    keys_t = K.local_row_keys(logits, 10, vocab_size=13, rows=K.SamplingRows(temp, seeds, offsets))
    assert torch.equal(keys_t, keys)  # below threshold -> greedy, bit for bit
    empty = K.local_row_keys(logits, 20, vocab_size=13)
    assert (empty == K.EMPTY_KEY).all()


# ------------------------------------------------------ pruning bounds of the kernel

def test_gumbel_bucket_table_bounds_the_noise_of_every_word_sampled():
    table = K.gumbel_bound_table()
    _, half_width, noise_max, noise_min = K.gumbel_bound_constants()
    gen = torch.Generator().manual_seed(11)
    words = torch.cat([
        torch.randint(0, 2**32, (400_000,), generator=gen, dtype=torch.int64),
        torch.arange(0, 4096), K.MASK32 - torch.arange(0, 4096), 2**31 + torch.arange(-4096, 4096),
        torch.tensor([2**k + d for k in range(32) for d in (-1, 0, 1) if 0 <= 2**k + d < 2**32]),
    ])
    buckets = K.gumbel_bucket_index(words)
    assert int(buckets.min()) >= 0 and int(buckets.max()) < 2 * K.GUMBEL_BUCKETS_PER_HALF
    noise = -K.portable_log(K.exponential_from_words(words)).to(torch.float64)
    estimate = table[buckets].to(torch.float64)
    # The portable noise differs from the true one by < 1e-5: well inside the absolute error.
    assert float((noise - estimate).abs().max()) <= half_width + 1e-5
    assert float(noise.max()) <= noise_max and float(noise.min()) >= noise_min
    # Each word lies inside the word range its bucket claims.
    for word, bucket in zip(words[::997].tolist(), buckets[::997].tolist()):
        lo, hi = K._bucket_word_range(bucket)
        assert lo <= word <= hi


def test_gumbel_bucket_midpoints_decrease_as_the_word_grows():
    """The kernel bounds a whole quad by its smallest word's bucket: that needs G to be
    non-increasing over the buckets taken in word order (the noise decreases in h)."""
    table = K.gumbel_bound_table()
    used = []
    for index in range(2 * K.GUMBEL_BUCKETS_PER_HALF):
        lo, hi = K._bucket_word_range(index)
        if lo >= 0:
            used.append((lo, hi, float(table[index])))
    used.sort()
    assert used[0][0] == 0 and used[-1][1] == K.MASK32
    for (lo_a, hi_a, g_a), (lo_b, _, g_b) in zip(used, used[1:]):
        assert hi_a + 1 == lo_b  # consecutive word intervals, no gaps or overlaps
        assert g_b <= g_a
    # The same through the kernel's index function, on words around every bucket edge.
    edges = torch.tensor(sorted({max(0, min(K.MASK32, e + d)) for lo, hi, _ in used for e in (lo, hi)
                                 for d in (-1, 0, 1)}), dtype=torch.int64)
    g = table[K.gumbel_bucket_index(edges)]
    assert bool((g[1:] <= g[:-1]).all())


def _pruning_rows() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    width = 2048
    lm_like = torch.randn(4, width, generator=gen) * 2.5
    lm_like[:, :20] += 18.0  # a few tokens far above the rest, like a real LM's logits
    rows = [
        torch.randn(4, width, generator=gen),
        lm_like,
        torch.full((1, width), 3.0),  # all tied
        torch.randn(2, width, generator=gen) * 1e4,  # large t
        torch.randn(1, width, generator=gen) * 3e38,  # near overflow (and |t| > 1e37 at small T)
        torch.randn(1, width, generator=gen) * 1e-40,  # subnormals
    ]
    special = torch.randn(3, width, generator=gen)
    special[0, ::7] = float("-inf")  # masked tokens
    special[1, 100] = float("inf")
    special[2, 5] = float("nan")
    rows.append(special)
    logits = torch.cat(rows)
    temps = torch.tensor([1e-5, 0.01, 0.7, 1.0, 100.0])
    return logits, temps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gumbel_pruning_bounds_hold_for_the_exact_scores(dtype):
    """The kernel skips a column when ``t + noise_max + err(t) < L0`` and scores exactly only
    columns with ``A + W >= max(L0, max(A - W))``. Both rest on: every exact score lies in
    ``[A - W, A + W]`` and below ``t + noise_max + err(t)``, and the largest logit's column
    scores at least ``L0``. Checked here for every column of adversarial and LM-like rows."""
    logits, temps = _pruning_rows()
    logits = logits.to(dtype)
    rows, width = logits.shape
    table = K.gumbel_bound_table()
    c0, noise_max, noise_min = (float(v) for v in table[-4:-1])
    abs_err, rel_err = K.GUMBEL_BOUND_ABS_ERROR, K.GUMBEL_BOUND_REL_ERROR
    columns = torch.arange(5000, 5000 + width)
    for temp in temps.tolist():
        t_rows = torch.full((rows,), temp)
        seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 3
        offsets = torch.arange(rows, dtype=torch.int64) << 20
        exact = K.canonical_float32(K.gumbel_scores(logits, columns, t_rows, seeds, offsets)).to(torch.float64)
        x = K.canonical_float32(logits)
        t = (x * (1.0 / torch.tensor(temp, dtype=torch.float32))).to(torch.float64)
        words = K.philox_words(seeds, offsets, columns)
        a = t + table[K.gumbel_bucket_index(words)].to(torch.float64)
        w = c0 + rel_err * a.abs()
        # Every finite t except huge positive ones (the kernel scores those exactly); bounds
        # that overflow float32 round outward to +-inf, as in the kernel.
        finite = torch.isfinite(t) & (t <= 1e37)
        lo32 = (a - w).to(torch.float32).to(torch.float64)
        hi32 = (a + w).to(torch.float32).to(torch.float64)
        ok = ~finite | ((exact >= lo32) & (exact <= hi32))
        assert bool(ok.all()), f"T={temp}: estimate bound broken at {(~ok).nonzero()[:5].tolist()}"
        # A quad (4 columns of one Philox block) is bounded by its largest t plus G of its
        # smallest word: every exact score of the quad lies below that estimate's A + W.
        quad_t = t.nan_to_num(nan=float("inf")).view(rows, -1, 4).amax(dim=2)
        quad_h = words.view(rows, -1, 4).amin(dim=2)
        a_quad = quad_t + table[K.gumbel_bucket_index(quad_h)].to(torch.float64)
        hi_quad = (a_quad + c0 + rel_err * a_quad.abs()).to(torch.float32).to(torch.float64)
        quad_finite = finite.view(rows, -1, 4).all(dim=2)
        ok = ~quad_finite | (exact.view(rows, -1, 4).amax(dim=2) <= hi_quad)
        assert bool(ok.all()), f"T={temp}: quad bound broken at {(~ok).nonzero()[:5].tolist()}"
        best_case = t + noise_max + abs_err + rel_err * t.abs()
        ok = ~finite | (exact <= best_case.to(torch.float32).to(torch.float64))
        assert bool(ok.all()), f"T={temp}: skip bound broken"
        # L0 from each row's largest logit.
        top = t.nan_to_num(nan=-float("inf")).max(dim=1)
        for r in range(rows):
            t_top = float(top.values[r])
            if abs(t_top) <= 1e37:
                low0 = t_top + noise_min - (abs_err + rel_err * abs(t_top))
                assert float(exact[r, int(top.indices[r])]) >= low0
