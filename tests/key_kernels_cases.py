"""Checks of the selection kernels (``tpspec.keys_triton``, ``tpspec.sampling.kernels_triton``), run
on CUDA tensors (GPU tests) or on CPU tensors under Triton's interpreter (``python
tests/key_kernels_cases.py GROUP int64`` with ``TRITON_INTERPRET=1`` set before Triton is imported;
each check prints ``<name> torch.int64: ok``).

Every check compares bit for bit with the torch function the kernel stands for: the portable
``exp``/``log``, the exponential and the Philox words; keys with and without temperatures in three
dtypes, past the vocabulary and past the slice; the block maxima and the best keys a row; the mass
sums and counts of logprobs; the penalties; the filtered draw from candidates (random filter mixes,
rows with a NaN or infinite best, padded candidates, undecided top-p and min-p rows); and, with the
switch on, ``select_tokens`` / ``sample_tokens`` / ``VocabShardedLogits.logprobs`` against the switch
off at TP 1 and, under the interpreter, TP 2 (gloo ranks).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import triton
import triton.language as tl

from interpreted import interpreted_main
from tpspec import keys as K
from tpspec import keys_triton as KT
from tpspec import vocab_parallel
from tpspec.sampling import kernels_triton as ST
from tpspec.sampling import select
from tpspec.sampling.ops import scaled_scores
from tpspec.sampling.penalties import OccurrenceCounts, apply_penalties

BITS = {torch.float32: torch.int32, torch.int64: torch.int64}


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    view = BITS.get(a.dtype)
    ok = torch.equal(a.view(view), b.view(view)) if view is not None else torch.equal(a, b)
    if not ok:
        bad = (a != b).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: differs at {bad}")


@triton.jit
def _helper_kernel(a_ptr, b_ptr, c_ptr, d_ptr, out_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    if WHICH == 0:
        tl.store(out_ptr + i, KT.portable_exp(tl.load(a_ptr + i, mask=ok, other=0.0)), mask=ok)
    elif WHICH == 1:
        tl.store(out_ptr + i, KT.portable_log(tl.load(a_ptr + i, mask=ok, other=1.0)), mask=ok)
    elif WHICH == 2:
        tl.store(out_ptr + i, KT.exponential_from_words(tl.load(b_ptr + i, mask=ok, other=0)), mask=ok)
    else:
        s = tl.load(a_ptr + i, mask=ok, other=0.0)
        cols = tl.load(b_ptr + i, mask=ok, other=0)
        seeds = tl.load(c_ptr + i, mask=ok, other=0)
        offsets = tl.load(d_ptr + i, mask=ok, other=0)
        tl.store(out_ptr + i, KT.gumbel_at(s, cols, seeds, offsets), mask=ok)


def _helper(which: int, n: int, device: str, a=None, b=None, c=None, d=None) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.float32, device=device)
    dummy = torch.zeros(1, device=device)
    args = [t if t is not None else dummy for t in (a, b, c, d)]
    _helper_kernel[(triton.cdiv(n, 512),)](*args, out, n, WHICH=which, BLOCK=512, enable_fp_fusion=False)
    return out


def check_portable_arithmetic(device: str, _dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    n = 20000 if device == "cpu" else 1 << 20
    x = -torch.rand(n, generator=gen) * 80
    x[:6] = torch.tensor([0.0, -0.0, -64.0, -1e-30, float("-inf"), -0.5])
    _same(_helper(0, n, device, a=x.to(device)).cpu(), K.portable_exp(x), "portable_exp")
    y = torch.rand(n, generator=gen) * 200 + 1e-30
    y[:3] = torch.tensor([1.0, 2.0 ** -126, 0.5])
    _same(_helper(1, n, device, a=y.to(device)).cpu(), K.portable_log(y), "portable_log")
    words = torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64)
    words[:5] = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1])
    _same(_helper(2, n, device, b=words.to(device)).cpu(), K.exponential_from_words(words), "exponential_from_words")
    cols = torch.randint(0, 2**22, (n,), generator=gen)
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    offsets = torch.randint(-2**63, 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    scores = torch.randn(n, generator=gen) * 5
    got = _helper(3, n, device, *(t.to(device) for t in (scores, cols, seeds, offsets))).cpu()
    want = K.gumbel_scores_at(scores.reshape(-1, 1), cols.reshape(-1, 1), seeds, offsets).reshape(-1)
    _same(got, want, "gumbel_at (Philox, exponential, log)")


def _slice_cases(device: str) -> list[tuple[int, int, int, int]]:
    """(rows, width, vocab_offset, vocab_size): whole rows, a middle and a padded last slice, a
    width that is not a multiple of the block; on CUDA a Llama 3 row at TP 1 and TP 8."""
    cases = [(3, 1000, 0, 1000), (4, 700, 500, 1100), (2, 4096, 4096, 8000), (2, 300, 0, 250), (1, 5, 0, 5)]
    if device == "cuda":
        cases += [(64, 128256, 0, 128256), (64, 16032, 7 * 16032, 128256)]
    return cases


def check_score_keys(device: str, _dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, width, offset, vocab in _slice_cases(device):
            x = (torch.randn(rows, width, generator=gen) * 4).to(dtype)
            x[0, :4] = torch.tensor([0.0, -0.0, float("nan"), float("-inf")])[:width].to(dtype)
            temperature = torch.tensor([0.7, 0.0, 1.3, 2.0, 1e-6])[torch.arange(rows) % 5]
            columns = torch.arange(offset, offset + width)
            for t in (None, temperature):
                keys, block_max = KT.score_keys(x.to(device), offset, vocab, None if t is None else t.to(device))
                keys, block_max = keys.cpu(), block_max.cpu()
                s = K.canonical_float32(x) if t is None else scaled_scores(x, t)
                want = torch.where(columns < vocab, K.pack_keys(s, columns.reshape(1, -1)), torch.tensor(K.EMPTY_KEY))
                _same(keys[:, :width], want, f"score_keys {dtype} {rows}x{width}+{offset}")
                assert (keys[:, width:] == K.EMPTY_KEY).all()
                _same(block_max, keys.view(rows, -1, KT.KEY_BLOCK).max(dim=2).values, "block maxima")
                for count in (1, 5, 20, 64, 256):
                    if KT.top_keys_apply(width, offset, vocab, count):
                        got = KT.top_keys(keys.to(device), block_max.to(device), count).cpu()
                        _same(got, torch.topk(want, count).values, f"top_keys {count}")
            best, _ = K.unpack_keys(want.max(dim=1).values)
            picks = torch.randint(0, width, (rows, 1), generator=gen)
            high = (want.gather(1, picks) >> 32).reshape(-1)
            masses, counts = KT.row_masses_and_counts(keys.to(device), best.to(device), high.to(device), width)
            values, _ = K.unpack_keys(want)
            real = want != K.EMPTY_KEY
            _same(masses.cpu(), torch.where(real, K.column_masses(values, best), 0).sum(dim=1), "mass sums")
            _same(counts.cpu(), (real & ((want >> 32) >= high.reshape(-1, 1))).sum(dim=1), "counts at or above")


def check_row_argmax(device: str, _dtype) -> None:
    """``row_argmax`` against ``torch.argmax`` of the real columns: ties to the lowest column, the
    first NaN, ``-0.0 == +0.0``, every value -inf, a winner in the last partial block; and the
    argmax of a one-rank head with the switch on, the kernel seen to run."""
    from tpspec.exchange.local import LocalKeyExchange
    from tpspec.vocab_parallel import VocabShardedLogits

    gen = torch.Generator().manual_seed(21)
    cases = [(3, 5000, 0, 5000), (2, 4100, 300, 4350), (1, 7, 0, 7), (4, 2048, 0, 2048)]
    if device == "cuda":
        cases += [(1, 128256, 0, 128256), (32, 128256, 0, 128256), (64, 16032, 0, 16000)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, width, offset, vocab in cases:
            real = min(width, vocab - offset)
            x = (torch.randn(rows, width, generator=gen) * 4).to(dtype)
            x[0, real // 3] = x[0, real // 2] = x[0].max() + 1  # a tie: the lower column wins
            if rows > 1:
                x[1, :] = float("-inf")
                x[1, real - 1] = float("nan")
                x[1, real // 2] = float("nan")  # the first NaN wins
            if rows > 2:
                x[2, :] = -1.0
                x[2, real - 2] = -0.0
                x[2, real - 1] = 0.0  # -0.0 == +0.0: the first of them
            if rows > 3:
                x[3, :] = float("-inf")  # no finite value: column 0
            x[-1, real - 1] = float("inf")  # the last partial block's column
            if real < width:
                x[:, real:] = float("nan")  # padding columns are never chosen
            want = torch.argmax(x[:, :real], dim=1) + offset
            got = KT.row_argmax(x.to(device), offset, real).cpu()
            _same(got, want, f"row_argmax {dtype} {rows}x{width}+{offset}")
            with _argmax_kernel_on() as calls:
                head = VocabShardedLogits(x.to(device), offset, vocab, LocalKeyExchange(device))
                _same(head.argmax().cpu(), want, "a one-rank head's argmax with the kernel")
            assert calls == [1], "the switch sends a one-rank argmax to the kernel"
    # Logits of another dtype are refused as without the kernel, not rounded to float32 keys.
    with _argmax_kernel_on():
        head = VocabShardedLogits(torch.ones(1, 300, dtype=torch.float64, device=device), 0, 300,
                                  LocalKeyExchange(device))
        try:
            head.argmax()
            raise AssertionError("float64 logits must be refused")
        except ValueError as exc:
            assert "float32, bfloat16 or float16" in str(exc)


@contextlib.contextmanager
def _argmax_kernel_on():
    """The one-rank argmax kernel switched on (here: under the interpreter); yields the list its
    calls are appended to."""
    calls: list[int] = []
    saved = (KT.row_argmax, vocab_parallel.GREEDY_ARGMAX_KERNEL, vocab_parallel.KEY_KERNELS_UNDER_INTERPRETER)
    real = saved[0]
    KT.row_argmax = lambda *a: calls.append(1) or real(*a)
    vocab_parallel.GREEDY_ARGMAX_KERNEL = vocab_parallel.KEY_KERNELS_UNDER_INTERPRETER = True
    try:
        yield calls
    finally:
        KT.row_argmax, vocab_parallel.GREEDY_ARGMAX_KERNEL, vocab_parallel.KEY_KERNELS_UNDER_INTERPRETER = saved


@contextlib.contextmanager
def _set(*settings):
    """Each ``(module, name, value)`` set for the block, the old values back after it."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
    for module, name, value in settings:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _key_kernels_on(*settings):
    """The key kernels on wherever this runs (the interpreter or CUDA), and ``settings`` (see :func:`_set`)."""
    return _set((vocab_parallel, "KEY_KERNELS_UNDER_INTERPRETER", True), (vocab_parallel, "KEY_KERNELS_ON_CUDA", True),
                *settings)


@contextlib.contextmanager
def _calls(module, name):
    """``module.name`` counted for the block: yields the list each call appends to."""
    calls: list[int] = []
    real = getattr(module, name)
    with _set((module, name, lambda *a, **k: calls.append(1) or real(*a, **k))):
        yield calls


def check_penalties(device: str, _dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    for rows, width, offset, _ in _slice_cases(device):
        for dtype in (torch.float32, torch.bfloat16):
            counts = OccurrenceCounts(6, vocab_offset=offset, width=width, device=device)
            for slot in range(6):
                counts.reset(slot, torch.randint(offset, offset + width, (7,), generator=gen).tolist())
            out = torch.randint(offset - 3, offset + width + 3, (6, 9), generator=gen)
            counts.add(torch.arange(6), out.to(device))
            slots = torch.randint(-2, 8, (rows,), generator=gen)  # past both ends too: no request
            x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
            x[0, :3] = torch.tensor([0.0, -0.0, float("nan")])[:width].to(dtype)
            rep = torch.rand(rows, generator=gen) + 0.5
            pres = torch.randn(rows, generator=gen)
            freq = torch.randn(rows, generator=gen)
            args = dict(vocab_offset=offset, counts=counts, slots=slots.to(device), drafts=None,
                        repetition=rep.to(device), presence=pres.to(device), frequency=freq.to(device))
            vocab_parallel.KEY_KERNELS_UNDER_INTERPRETER = vocab_parallel.KEY_KERNELS_ON_CUDA = True
            got = apply_penalties(x.to(device), **args).cpu()
            vocab_parallel.KEY_KERNELS_UNDER_INTERPRETER = vocab_parallel.KEY_KERNELS_ON_CUDA = False
            want = apply_penalties(x.to(device), **args).cpu()
            _same(got, want, f"penalties {dtype} {rows}x{width}")


def check_penalized_keys_and_counts(device: str, _dtype) -> None:
    """``penalized_keys`` against ``score_keys`` of ``penalize``'s slice, and ``count_tokens``
    against the torch counting (``COUNT_KERNEL`` off), bit for bit."""
    from tpspec.sampling import penalties as P

    gen = torch.Generator().manual_seed(17)
    for rows, width, offset, vocab in _slice_cases(device):
        for dtype in (torch.float32, torch.bfloat16):
            prompts = torch.randint(offset, offset + width, (6, 7), generator=gen)
            out = torch.randint(offset - 3, offset + width + 3, (6, 9), generator=gen)
            out[1, 2:] = out[1, 1]  # one token many times in a row
            out[2, 4:] = -1  # padding
            long_output = torch.randint(offset - 3, offset + width + 3, (1, 300), generator=gen)
            tables = []
            for kernel in (False, True):
                counts = OccurrenceCounts(6, vocab_offset=offset, width=width, device=device)
                for slot in range(6):
                    counts.reset(slot, prompts[slot].tolist())
                with _key_kernels_on((P, "COUNT_KERNEL", kernel)):
                    counts.add(torch.tensor([0, 1, 2, 3, -1, 7]).to(device), out.to(device))
                    counts.add(torch.tensor([5, 5]).to(device), out[:2].to(device))  # the same slot twice
                    counts.add(torch.tensor([4, 0, 3]).to(device), out[3:].to(device),  # the first tokens of each
                               torch.tensor([0, 5, 12]).to(device))
                    # A resumed request's whole output at once: more tokens than one loop of the kernel.
                    counts.add(torch.tensor([2]).to(device), long_output.to(device))
                tables.append(counts)
            _same(tables[1].output_counts.cpu(), tables[0].output_counts.cpu(), f"count_tokens {rows}x{width}")
            counts = tables[1]
            assert counts.output_counts.sum() > 0
            table_counts, table_seen = counts.tables()
            slots = torch.randint(-2, 8, (rows,), generator=gen)  # past both ends too: no request
            index = counts._slot_index(slots.to(device))
            x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
            x[0, :3] = torch.tensor([0.0, -0.0, float("nan")])[:width].to(dtype)
            rep = (torch.rand(rows, generator=gen) + 0.5).to(device)
            pres = torch.randn(rows, generator=gen).to(device)
            freq = torch.randn(rows, generator=gen).to(device)
            t = torch.tensor([0.7, 0.0, 1.3, 2.0, 1e-6])[torch.arange(rows) % 5].to(device)
            x = x.to(device)
            penalised = ST.penalize(x, table_counts, table_seen, index, rep, pres, freq)
            want = KT.score_keys(penalised, offset, vocab, t)
            got = ST.penalized_keys(x, offset, vocab, t, table_counts, table_seen, slots.to(device), rep, pres, freq,
                                    num_slots=counts.num_slots)
            _same(got[0].cpu(), want[0].cpu(), f"penalized_keys {dtype} {rows}x{width}+{offset}")
            _same(got[1].cpu(), want[1].cpu(), f"penalized_keys block maxima {dtype} {rows}x{width}+{offset}")


def _random_candidates(rows: int, n: int, gen: torch.Generator) -> dict:
    """Candidate keys best first over a few ranks' columns, some rows padded, one with a NaN best,
    one with an infinite best, and random filters of every kind."""
    values = torch.randn(rows, n, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    columns = torch.randperm(1 << 20, generator=gen)[: rows * n].reshape(rows, n)
    keys = K.pack_keys(values, columns)
    pad = torch.randint(0, n // 2, (rows,), generator=gen)
    keys = torch.where(torch.arange(n).reshape(1, -1) >= n - pad.reshape(-1, 1), torch.tensor(K.EMPTY_KEY), keys)
    keys[0, 0] = K.pack_keys(torch.tensor(float("nan")), 3)
    keys[1, 0] = K.pack_keys(torch.tensor(float("inf")), 5)
    if rows > 2:
        keys[2, 0] = K.pack_keys(torch.tensor(float("-inf")), 6)
    if rows > 3 and n >= 4:  # four equal scores (masses 2**40 each) and top-p 1/2: a prefix that ends exactly at it
        keys[3] = K.EMPTY_KEY
        keys[3, :4] = K.pack_keys(torch.ones(4), torch.tensor([9, 4, 7, 1]))
    ranked = torch.sort(keys, dim=1, descending=True).values
    floor = ranked.gather(1, torch.randint(0, n, (rows, 1), generator=gen)).reshape(-1)
    floor[:2] = K.EMPTY_KEY
    kind = torch.randint(0, 8, (rows,), generator=gen)
    if rows > 3:
        kind[3] = 2
    k_on, p_on, m_on = (kind & 1) == 1, (kind & 2) == 2, (kind & 4) == 4
    top_k = torch.randint(1, n + 3, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.99 + 0.01
    top_p[3 % rows] = 0.5
    min_p = torch.rand(rows, generator=gen) * 0.3
    total = (torch.rand(rows, generator=gen) * 2**44).to(torch.int64) + 2**40
    seeds = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen, dtype=torch.int64)
    offsets = torch.randint(0, 2**40, (rows,), generator=gen, dtype=torch.int64)
    return dict(ranked=ranked, floor=floor, total=total, top_k=top_k, k_on=k_on, p_on=p_on, m_on=m_on,
                top_p=top_p, min_p=min_p, seeds=seeds, offsets=offsets)


def check_candidate_draw(device: str, _dtype) -> None:
    gen = torch.Generator().manual_seed(14)
    shapes = [(40, 64), (16, 128), (9, 2), (8, 300)] + ([(64, 2048), (8, 8192)] if device == "cuda" else [])
    verdicts = []
    for rows, n in shapes:
        case = _random_candidates(rows, n, gen)
        for with_total in (False, True):
            args = dict(case, total=case["total"] if with_total else None)
            want = select.decide_and_draw(**args)
            got = ST.draw_candidates(**{k: (None if v is None else v.to(device)) for k, v in args.items()})
            _same(got[0].cpu(), want[0], f"drawn {rows}x{n} total={with_total}")
            _same(got[1].cpu(), want[1], f"decided {rows}x{n} total={with_total}")
            verdicts.append(want[1])
    verdicts = torch.cat(verdicts)
    assert verdicts.any() and not verdicts.all(), "the cases decide some rows and leave some undecided"


def check_draw_rows(device: str, _dtype) -> None:
    """``draw_rows`` against the torch path it replaces: ``_row_filters`` and the parameters' fills,
    ``decide_and_draw``, then ``draw_filtered``'s final tokens and verdicts, over random candidates,
    temperatures at and around the greedy threshold, top-p values whose fixed point is a tie (half
    to even), each filter absent in turn, with and without plain tokens."""
    gen = torch.Generator().manual_seed(19)
    vocab = 1 << 20
    for rows, n in [(40, 64), (16, 128), (9, 2)] + ([(64, 2048)] if device == "cuda" else []):
        case = _random_candidates(rows, n, gen)
        threshold = K.GREEDY_TEMPERATURE_THRESHOLD
        temperature = torch.tensor([0.7, 0.0, threshold, 1.3, 5e-6])[torch.arange(rows) % 5].to(torch.float32)
        top_k = case["top_k"].clone()
        top_k[::7] = vocab  # off
        top_p = case["top_p"].clone()
        top_p[1::6] = 1.0  # off
        top_p[2::6] = (2 * torch.arange(len(top_p[2::6])) + 5_000_001).to(torch.float32) / 2**25  # ties at 2**24
        min_p = case["min_p"].clone()
        min_p[::3] = 0.0  # off
        plain = torch.randint(0, vocab, (rows,), generator=gen)
        for absent, plain_tokens, total in ((None, plain, case["total"]), (None, None, None),
                                            ("top_k", None, case["total"]), ("top_p", plain, None),
                                            ("min_p", plain, case["total"])):
            filters = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
            if absent is not None:
                filters[absent] = None
            sampling = K.SamplingRows(temperature, case["seeds"], case["offsets"], **filters)
            k_on, p_on, m_on, _ = select._row_filters(sampling, vocab, torch.device("cpu"))
            filtered = k_on | p_on | m_on

            def fill(t, value, dtype):
                return torch.full((rows,), value, dtype=dtype) if t is None else t

            drawn, decided = select.decide_and_draw(
                case["ranked"], case["floor"], total, fill(filters["top_k"], 2**31 - 1, torch.int64), k_on,
                p_on, m_on, fill(filters["top_p"], 1.0, torch.float32),
                fill(filters["min_p"], 0.0, torch.float32), case["seeds"], case["offsets"])
            decided = decided | ~filtered
            base = plain_tokens if plain_tokens is not None else torch.zeros(rows, dtype=torch.int64)
            want = torch.where(decided, torch.where(filtered, drawn, base), torch.zeros_like(base))

            def dev(t):
                return None if t is None else t.to(device)

            got = ST.draw_rows(dev(case["ranked"]), dev(case["floor"]), dev(total), dev(temperature),
                               dev(filters["top_k"]), dev(filters["top_p"]), dev(filters["min_p"]),
                               dev(case["seeds"]), dev(case["offsets"]), dev(plain_tokens), vocab_size=vocab,
                               greedy_threshold=threshold)
            what = f"draw_rows {rows}x{n} without {absent} plain={plain_tokens is not None} total={total is not None}"
            _same(got[0].cpu(), want, what + ": tokens")
            _same(got[1].cpu(), decided, what + ": verdicts")
    # The fixed points themselves: top-p (half to even) and min-p (truncated), ties and ends included.
    top_p = torch.cat([torch.rand(5000, generator=gen), torch.tensor([0.0, 1.0, 0.5, 2.0**-25, 3 * 2.0**-25]),
                       (2 * torch.arange(100) + 1).to(torch.float32) / 2**25]).to(torch.float32)
    assert ((top_p * 2**24) % 1 == 0.5).sum() >= 100  # ties
    bits = torch.empty(len(top_p), dtype=torch.int64, device=device)
    thresholds = torch.empty(len(top_p), dtype=torch.int64, device=device)
    _fixed_point_kernel[(triton.cdiv(len(top_p), 512),)](top_p.to(device), bits, thresholds, len(top_p), BLOCK=512,
                                                         enable_fp_fusion=False)
    _same(bits.cpu(), K.top_p_fixed(top_p), "top-p fixed point")
    _same(thresholds.cpu(), K.min_p_threshold(top_p), "min-p threshold")


@triton.jit
def _fixed_point_kernel(x_ptr, bits_ptr, thr_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(bits_ptr + i, ST._top_p_fixed(x), mask=i < n)
    tl.store(thr_ptr + i, ST._min_p_threshold(x), mask=i < n)


def _selection_inputs(rows: int, vocab: int, device: str, gen: torch.Generator):
    from tpspec.sampling.penalties import RowPenalties

    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    temperature = torch.tensor([0.7, 0.0, 1.1, 0.5])[torch.arange(rows) % 4]
    top_k = torch.tensor([20, 5, 1000000, 50])[torch.arange(rows) % 4]
    top_p = torch.tensor([0.8, 1.0, 0.9, 1.0])[torch.arange(rows) % 4]
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.05])[torch.arange(rows) % 4]
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 5
    offsets = torch.arange(rows, dtype=torch.int64) + 3
    counts = OccurrenceCounts(rows, vocab_offset=0, width=vocab, device=device)
    for slot in range(rows):
        counts.reset(slot, torch.randint(0, vocab, (9,), generator=gen).tolist())
    counts.add(torch.arange(rows), torch.randint(0, vocab, (rows, 6), generator=gen).to(device))
    penalties = RowPenalties(counts, torch.arange(rows).to(device), None, torch.full((rows,), 1.05).to(device),
                             torch.full((rows,), 0.2).to(device), torch.full((rows,), 0.1).to(device))
    rows_obj = K.SamplingRows(temperature.to(device), seeds.to(device), offsets.to(device), top_k=top_k.to(device),
                              top_p=top_p.to(device), min_p=min_p.to(device), penalties=penalties)
    return logits, rows_obj


def _select_all(logits_full: torch.Tensor, rows_obj, exchange, offset: int, width: int, vocab: int):
    from tpspec.vocab_parallel import VocabShardedLogits

    local = logits_full[:, offset:offset + width]
    if local.shape[1] < width:
        local = torch.cat([local, torch.zeros(local.shape[0], width - local.shape[1], device=local.device)], dim=1)
    sharded = VocabShardedLogits(local.contiguous(), offset, vocab, exchange)
    tokens = select.select_tokens(sharded, rows_obj)
    plan = select.FilterPlan.of_rows(rows_obj, vocab, local.device)
    deferred, decided = select.select_tokens_deferred(sharded, rows_obj, plan)
    logprobs = sharded.logprobs(tokens, top_n=5)
    return [tokens.cpu(), deferred.cpu(), decided.cpu(), *(t.cpu() for t in logprobs)]


# What the selection runs with the key kernels on and every other switch at its default: the draw with the
# rows' filters read in its kernel (draw_rows); these rows' plain and top-p-only rows keep the penalties apart.
KERNELS = ((KT, ("score_keys", "top_keys", "row_masses_and_counts")), (ST, ("penalize", "draw_rows")))


def _switched(fn):
    """``fn()`` with the key kernels off, then on: both results. Asserts that every kernel ran with
    the switch on and none with it off."""
    results = []
    calls: dict[str, int] = {}
    saved = [(module, name, getattr(module, name)) for module, names in KERNELS for name in names]

    def counted(name, func):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return func(*args, **kwargs)
        return call

    for module, name, func in saved:
        setattr(module, name, counted(name, func))
    try:
        for on in (False, True):
            vocab_parallel.KEY_KERNELS_UNDER_INTERPRETER = vocab_parallel.KEY_KERNELS_ON_CUDA = on
            try:
                results.append(fn())
            finally:
                vocab_parallel.KEY_KERNELS_UNDER_INTERPRETER = vocab_parallel.KEY_KERNELS_ON_CUDA = False
            ran = sorted(calls)
            assert ran == (sorted(n for _, n, _ in saved) if on else []), (on, ran)
    finally:
        for module, name, func in saved:
            setattr(module, name, func)
    return results


def check_selection_tp1(device: str, _dtype) -> None:
    from tpspec.exchange.local import LocalKeyExchange

    gen = torch.Generator().manual_seed(15)
    vocab = 9000 if device == "cpu" else 128256
    rows = 8 if device == "cpu" else 64
    logits, rows_obj = _selection_inputs(rows, vocab, device, gen)
    off, on = _switched(lambda: _select_all(logits, rows_obj, LocalKeyExchange(device), 0, vocab, vocab))
    for name, a, b in zip(("tokens", "deferred", "decided", "token logprobs", "top ids", "top logprobs", "ranks"),
                          off, on):
        _same(b, a, f"TP 1 {name}")


def check_fused_penalties_tp1(device: str, _dtype) -> None:
    """A deferred draw of penalised rows that are all filtered (top-k, top-p with top-k, top-p alone)
    with the penalties inside the keys kernel (``PENALIZED_KEYS_KERNEL``) gives the tokens and
    verdicts of the penalised slice drawn by the same kernels, and ``select_tokens``' tokens on the
    decided rows; the fused kernel is seen to run, and not to run for a plan with a plain row."""
    from tpspec.exchange.local import LocalKeyExchange
    from tpspec.vocab_parallel import VocabShardedLogits

    gen = torch.Generator().manual_seed(18)
    vocab = 9000 if device == "cpu" else 128256
    rows = 8 if device == "cpu" else 64
    logits, rows_obj = _selection_inputs(rows, vocab, device, gen)
    import dataclasses

    temperature = torch.tensor([0.7, 1.0, 0.3, 0.5])[torch.arange(rows) % 4].to(device)
    top_k = torch.tensor([20, 5, 1000000, 50])[torch.arange(rows) % 4].to(device)
    top_p = torch.tensor([0.8, 1.0, 0.9, 1.0])[torch.arange(rows) % 4].to(device)
    # Every row's 30 best columns seen in its prompt and a strong repetition penalty: the draw without
    # the penalties would pick among other columns.
    counts = OccurrenceCounts(rows, vocab_offset=0, width=vocab, device=device)
    for slot in range(rows):
        counts.reset(slot, torch.topk(logits[slot].cpu(), 30).indices.tolist())
    penalties = dataclasses.replace(rows_obj.penalties, counts=counts,
                                    repetition=torch.full((rows,), 50.0, device=device))
    filtered = dataclasses.replace(rows_obj, temperature=temperature, top_k=top_k, top_p=top_p, min_p=None,
                                   penalties=penalties)
    sharded = VocabShardedLogits(logits.contiguous(), 0, vocab, LocalKeyExchange(device))
    results = []
    with _calls(ST, "penalized_keys") as calls:
        for fused in (False, True):
            with _key_kernels_on((select, "PENALIZED_KEYS_KERNEL", fused)):
                plan = select.FilterPlan.of_rows(filtered, vocab, logits.device)
                assert not plan.any_plain and plan.any_top_p_total
                tokens, decided = select.select_tokens_deferred(sharded, filtered, plan)
            results.append((tokens.cpu(), decided.cpu()))
            assert calls == ([1] if fused else []), (fused, calls)
        with _key_kernels_on():
            reference = select.select_tokens(sharded, filtered).cpu()
            calls.clear()
            greedy_row = dataclasses.replace(filtered, temperature=torch.where(
                torch.arange(rows, device=device) == 0, 0.0, temperature))
            plan = select.FilterPlan.of_rows(greedy_row, vocab, logits.device)
            select.select_tokens_deferred(sharded, greedy_row, plan)
        assert calls == [], "a plan with a plain row draws from the penalised slice"
    (off_tokens, off_decided), (on_tokens, on_decided) = results
    _same(on_tokens, off_tokens, "fused penalties: tokens")
    _same(on_decided, off_decided, "fused penalties: verdict")
    if device == "cpu":  # these rows' top-p prefixes are certified; at 128256 columns they need not be
        assert bool(on_decided), "every row decided from its candidates"
    if bool(on_decided):
        _same(on_tokens, reference, "fused penalties against select_tokens")
        best = torch.topk(logits.cpu(), 30).indices
        assert not (best == on_tokens.reshape(-1, 1)).any(), "no row drew a penalised column"


def check_draw_rows_selection_tp1(device: str, _dtype) -> None:
    """The deferred and the plain selection with ``FILTERS_IN_DRAW_KERNEL`` on give the tokens and
    verdicts of the switch off (the key kernels on in both), for a batch with greedy, top-p-only and
    penalised rows, and one of filtered rows only; ``draw_rows`` is seen to run."""
    from tpspec.exchange.local import LocalKeyExchange

    gen = torch.Generator().manual_seed(20)
    vocab = 9000 if device == "cpu" else 128256
    rows = 8 if device == "cpu" else 64
    logits, mixed = _selection_inputs(rows, vocab, device, gen)
    import dataclasses

    only_filtered = dataclasses.replace(mixed, temperature=torch.tensor([0.7, 1.0, 0.3, 0.5])[torch.arange(rows) % 4]
                                        .to(device), min_p=None)
    with _calls(ST, "draw_rows") as calls:
        for rows_obj in (mixed, only_filtered):
            results = []
            for on in (False, True):
                calls.clear()
                with _key_kernels_on((select, "FILTERS_IN_DRAW_KERNEL", on)):
                    results.append(_select_all(logits, rows_obj, LocalKeyExchange(device), 0, vocab, vocab)[:3])
                assert bool(calls) == on, (on, calls)
            for name, a, b in zip(("tokens", "deferred", "decided"), *results):
                _same(b, a, f"draw_rows in the selection: {name}")


def _tp2_worker(rank: int, world: int, vocab: int) -> list[torch.Tensor]:
    from tpspec.exchange.allgather import AllGatherKeyExchange
    from tpspec import distributed as D

    gen = torch.Generator().manual_seed(16)
    logits, rows_obj = _selection_inputs(8, vocab, "cpu", gen)
    width = -(-vocab // world)
    offset = rank * width
    counts = OccurrenceCounts(8, vocab_offset=offset, width=width)
    for slot in range(8):  # the same prompts and outputs as the full-row counts, this rank's columns
        counts.reset(slot, rows_obj.penalties.counts.prompt_seen[slot].nonzero().flatten().tolist())
    full = rows_obj.penalties.counts.output_counts
    for slot in range(8):
        tokens = torch.repeat_interleave(torch.arange(vocab), full[slot].to(torch.int64))
        counts.add(torch.tensor([slot]), tokens.reshape(1, -1))
    import dataclasses

    rows_obj = dataclasses.replace(rows_obj, penalties=dataclasses.replace(rows_obj.penalties, counts=counts))
    exchange = AllGatherKeyExchange(D.tp_group())
    off, on = _switched(lambda: _select_all(logits, rows_obj, exchange, offset, width, vocab))
    with _key_kernels_on((select, "FILTERS_IN_DRAW_KERNEL", False)):
        flags_apart = _select_all(logits, rows_obj, exchange, offset, width, vocab)
    return off, on, flags_apart


def check_selection_tp2(device: str, _dtype) -> None:
    """Two gloo ranks (CPU only): the kernels on each rank's slice give the switch-off results, which
    equal TP 1's, and so do they with the filters' flags computed in torch around the draw kernel
    (``FILTERS_IN_DRAW_KERNEL`` off)."""
    if device != "cpu":
        return
    from tpspec.exchange.local import LocalKeyExchange
    from tpspec.testing import run_ranks

    vocab = 17999  # an odd vocabulary: the last slice is padded
    results = run_ranks(_tp2_worker, 2, vocab, env={"TRITON_INTERPRET": "1"}, timeout_s=300)
    gen = torch.Generator().manual_seed(16)
    logits, rows_obj = _selection_inputs(8, vocab, "cpu", gen)
    tp1 = _select_all(logits, rows_obj, LocalKeyExchange(), 0, vocab, vocab)
    for off, on, flags_apart in results:
        for a, b, c, want in zip(off, on, flags_apart, tp1):
            _same(a, want, "TP 2 without kernels against TP 1")
            _same(b, want, "TP 2 with kernels against TP 1")
            _same(c, want, "TP 2 with the filters' flags in torch around the draw kernel against TP 1")


CHECKS = {
    "arithmetic": [check_portable_arithmetic, check_score_keys, check_row_argmax, check_penalties,
                   check_penalized_keys_and_counts, check_candidate_draw, check_draw_rows],
    "selection": [check_selection_tp1, check_fused_penalties_tp1, check_draw_rows_selection_tp1,
                  check_selection_tp2],
}


if __name__ == "__main__":
    sys.modules.setdefault("key_kernels_cases", sys.modules["__main__"])  # run_ranks imports the worker by name
    interpreted_main(CHECKS, KT)
