"""Quick bit-exactness check of the fused LL kernel on one GPU, in one process (~20 s).

Compares ``LLKeyExchange.max_logits_keys`` with the CPU-exact ``keys.local_row_keys`` on 150
cases: fp32, bf16 and fp16; 1 to 3000 rows (grids of one block per row up to several blocks
per row, and more blocks than one wave); slices of 8 to 128K columns at vocab offsets that
are multiples of 4 (and a vocab that cuts the last slice short); random, LM-like, adversarial
(NaN, +-inf, ties, all -inf rows, greedy rows mixed in) and low-temperature sampled rows with
per-row seeds and offsets, and all-greedy calls (no temperature). Sampled calls take the plain
kernels, their ``_one_tile`` twins and (1 x 16K, 3 x 4099, 5 x 8) their ``_columns`` twins. Meant for iterating on
the kernel: point ``TPSPEC_LL_SOURCE_DIR`` at a modified copy of ``csrc/ll_exchange`` and
run this before timing it with ``tpspec bench exchange``. The GPU tests
(``tests/test_ll_gpu.py``) remain the full check across ranks.

Usage: python3 launch/ll_kernel_check.py [--shapes 3x16384,8x16384]   (exit code 1 when any case differs)
``--shapes`` replaces the ten shapes (rows x width, comma-separated), to check a change of plan at
the shapes it touches; the plan and the sampled bf16 kernel each shape gets are printed.
"""
import argparse
import sys

import torch

from tpspec import keys as K
from tpspec.exchange.ll import LLKeyExchange, fused_kernel_name, plan_chunks


SHAPES = ((1, 16384), (8, 65536), (256, 16384), (64, 1000), (3, 4099), (256, 65536), (5, 8), (1024, 520),
          (3000, 64), (1, 131072))


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
    if shapes != SHAPES:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for rows, width in shapes:
            plan = plan_chunks(rows, width, 2, sms, True)
            kernel = fused_kernel_name(torch.bfloat16, plan[0], True)
            print(f"{rows} x {width}: sampled bf16 plan {plan}, kernel {kernel}")
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
                got = ll.max_logits_keys(logits, vocab_offset, **kw)
                want = K.local_row_keys(logits, vocab_offset, **kw)
                total += 1
                if not torch.equal(got, want):
                    bad += 1
                    print("MISMATCH", dtype, rows, width, kind, int((got != want).sum()))
    ll.check()
    ll.close()
    print(f"check: {total - bad}/{total} cases bit-exact")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
