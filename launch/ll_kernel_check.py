"""Quick bit-exactness check of the fused LL kernel on one GPU, in one process (~30 s).

Compares ``LLKeyExchange.max_logits_keys`` with the CPU-exact ``keys.local_row_keys`` on 150
cases and more: fp32, bf16 and fp16; 1 to 3000 rows (grids of one block per row up to several
blocks per row, and more blocks than one wave); slices of 8 to 200K columns at vocab offsets
that are multiples of 4 (and a vocab that cuts the last slice short); random, LM-like,
adversarial (NaN, +-inf, ties, all -inf rows, greedy rows mixed in) and low-temperature
sampled rows with per-row seeds and offsets, and all-greedy calls (no temperature). Meant for
iterating on the kernel: point ``TPSPEC_LL_SOURCE_DIR`` at a modified copy of
``csrc/ll_exchange`` and run this before timing it with ``tpspec bench exchange``. The GPU
tests (``tests/test_ll_gpu.py``) remain the full check across ranks.

Without ``--shapes``, shapes are added where the default ones miss a route (kernel, sampled route,
columns or quads a thread, collector gather) that some plan takes on this GPU, so every kernel
and route a plan can select is checked. The kernels the cases ran are printed.

Usage: python3 launch/ll_kernel_check.py [--shapes 3x16384,8x16384]   (exit code 1 when any case differs)
``--shapes`` replaces the ten shapes (rows x width, comma-separated), to check a change of plan at
the shapes it touches; the bf16 plan (``tpspec.exchange.ll_plan.plan``) of each shape is printed.
"""
import argparse
import sys

import torch

from tpspec import keys as K
from tpspec.exchange.ll import LLKeyExchange
from tpspec.exchange.ll_plan import plan


SHAPES = ((1, 16384), (8, 65536), (256, 16384), (64, 1000), (3, 4099), (256, 65536), (5, 8), (1024, 520),
          (3000, 64), (1, 131072))
# Where the default shapes miss a route some plan takes on this GPU, the first of these that
# takes it is added (the routes depend on the GPU's SM count).
EXTRA_ROWS = (1, 2, 3, 5, 8, 16, 33, 64, 128, 512)
EXTRA_WIDTHS = (512, 1000, 2500, 4099, 9000, 16384, 33000, 65536, 99000, 131072, 200000)
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def route(rows: int, width: int, dtype: str, mode: str, sms: int) -> tuple:
    """What a plan makes the kernel run: its kernel and its routes inside."""
    p = plan(rows, width, dtype, mode, sms)
    return p.kernel, p.sampled_route, p.per_thread, p.gather


def covering_shapes(shapes: tuple, sms: int) -> tuple[tuple[int, int], ...]:
    """``shapes`` plus, for every route a plan on ``sms`` SMs takes within the extra grid and
    ``shapes`` miss, the first extra shape that takes it."""
    def routes(r: int, w: int) -> set:
        return {route(r, w, d, m, sms) for d in DTYPE_NAMES for m in ("sampled", "greedy")}

    covered = set().union(*(routes(r, w) for r, w in shapes))
    extra = []
    for r in EXTRA_ROWS:
        for w in EXTRA_WIDTHS:
            new = routes(r, w) - covered
            if new:
                extra.append((r, w))
                covered |= new
    return tuple(shapes) + tuple(extra)


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"3x16384,8x65536"`` -> ``((3, 16384), (8, 65536))``."""
    try:
        shapes = tuple((int(r), int(w)) for r, w in (item.lower().split("x") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes must look like 3x16384,8x65536, got {text!r}") from None
    if not shapes or any(r < 1 or w < 1 for r, w in shapes):
        raise argparse.ArgumentTypeError(f"rows and widths must be positive, got {text!r}")
    return shapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="rows x width list, e.g. 3x16384,8x65536")
    shapes = parser.parse_args().shapes
    if not torch.cuda.is_available():
        print("ll_kernel_check: needs a CUDA device", file=sys.stderr)
        return 2
    ll = LLKeyExchange(None, max_rows=4096, num_channels=1)
    gen = torch.Generator().manual_seed(11)
    bad = total = 0
    covered: set[str] = set()  # the kernels the plans of the cases picked
    if shapes != SHAPES:
        for rows, width in shapes:
            for mode in ("sampled", "greedy"):
                print(f"{rows} x {width} {mode} bf16: {plan(rows, width, 'bfloat16', mode, ll.plan_sms)}")
    else:
        shapes = covering_shapes(SHAPES, ll.plan_sms)
        if shapes != SHAPES:
            print(f"added for routes the default shapes miss on {ll.plan_sms} SMs: {shapes[len(SHAPES):]}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, width in shapes:
            for kind in ("randn", "lm", "adv", "lowt", "greedy"):
                x = torch.randn(rows, width, generator=gen) * 3
                t = torch.full((rows,), 0.8)
                if kind == "lm":  # a dozen logits far above the rest, as a language model gives
                    top = torch.randint(0, width, (rows, 12), generator=gen)
                    x.scatter_(1, top, 18.0 + torch.rand(rows, 12, generator=gen))
                if kind == "adv":
                    x = torch.randint(-2, 3, (rows, width), generator=gen).float()  # many ties
                    m = torch.rand(rows, width, generator=gen)
                    x[m < 0.001] = float("nan")
                    x[(m > 0.5) & (m < 0.502)] = float("inf")
                    x[(m > 0.6) & (m < 0.7)] = float("-inf")
                    x[0] = float("-inf")
                    t[::3] = 0.0  # greedy rows mixed in
                if kind == "lowt":
                    t = torch.rand(rows, generator=gen) * 0.05 + 1e-4
                seeds = torch.randint(0, 2**62, (rows,), generator=gen)
                offsets = torch.randint(0, 2**40, (rows,), generator=gen) * 4
                logits = x.to(dtype).cuda()
                vocab_offset = 4 * int(torch.randint(0, 1000, (1,), generator=gen))
                vocab = vocab_offset + width - (3 if kind == "adv" else 0)
                kw = dict(vocab_size=vocab, rows=K.SamplingRows(t.cuda(), seeds.cuda(), offsets.cuda()))
                if kind == "greedy":
                    kw = dict(vocab_size=vocab)
                mode = "greedy" if kind == "greedy" else "sampled"
                covered.add(plan(rows, vocab - vocab_offset, dtype, mode, ll.plan_sms).kernel)
                got = ll.max_logits_keys(logits, vocab_offset, **kw)
                want = K.local_row_keys(logits, vocab_offset, **kw)
                total += 1
                if not torch.equal(got, want):
                    bad += 1
                    print("MISMATCH", dtype, rows, width, kind, int((got != want).sum()))
    ll.check()
    ll.close()
    print(f"kernels: {', '.join(sorted(covered))}")
    print(f"check: {total - bad}/{total} cases bit-exact")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
