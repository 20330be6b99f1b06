"""Case script (run under Triton's interpreter by tests/test_runtime_graphs.py): the Triton kernel of a
verification step launched ahead (``advance_triton.advance``) against the torch ops it stands for
(``GraphInputs.advance``): the same history, cached lengths, positions, visible lengths,
KV write rows, tokens and drafts, for random steps over several n-gram ranges and draft counts; and
the strict-acceptance kernel (``accept_triton.accept``) against ``accept_from_targets``.

Usage: python tests/advance_cases.py int32
"""

from __future__ import annotations

import random
import sys

import torch

from tpspec.model.drafters import NgramDrafter
from tpspec.model.batch import pages_needed
from tpspec.runtime import advance_triton
from tpspec.runtime.graph_inputs import GraphInputs

VOCAB = 50


def one_case(rng: random.Random, k: int, max_n: int, min_n: int, device: str = "cpu") -> None:
    batch, pad, page_size, slots, width = 6, rng.randint(0, 2), 4, 7, 48
    kv_pages = 12
    dev = torch.device(device)
    inputs = GraphInputs(batch=batch, num_draft=k, kv_pages=kv_pages, page_size=page_size, device=dev)
    # Cached lengths leave room for the most tokens a step emits and the next step's, as the engine's pages do.
    cache_lens = [0] * pad + [rng.randint(0, width - 2 * k - 3) for _ in range(batch - pad)]
    pages = list(range(1, 200))
    rng.shuffle(pages)
    tables = [[pages.pop() for _ in range(pages_needed(c + 2 * k + 2, page_size))] for c in cache_lens]
    last = [rng.randrange(VOCAB) for _ in range(batch)]
    drafts = [[rng.randrange(VOCAB) for _ in range(k)] for _ in range(batch)]
    inputs.fill(last, drafts, cache_lens, tables, reserve=k + 1)
    inputs.upload()
    # Small vocabularies: many repeated n-grams.
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    history = torch.randint(0, rng.choice([2, 3, 5, VOCAB]), (slots, width), dtype=torch.int32, generator=gen).to(dev)
    slot_rows = torch.tensor([slots - 1] * pad + rng.sample(range(slots - 1), batch - pad), dtype=torch.int64).to(dev)
    # Clamped: -1 marks a failed row; counts to 1 .. K + 1.
    accepted = torch.randint(-1, VOCAB + 3, (batch, k + 1), dtype=torch.int64, generator=gen).to(dev)
    num = torch.randint(0, k + 3, (batch,), dtype=torch.int64, generator=gen).to(dev)
    drafter = NgramDrafter(k, max_n, min_n)

    want_inputs = GraphInputs(batch=batch, num_draft=k, kv_pages=kv_pages, page_size=page_size, device=dev)
    want_inputs.device_buffer.copy_(inputs.device_buffer)
    want_history = history.clone()
    want_inputs.advance(accepted.clamp(0, VOCAB - 1), num, pad, want_history, slot_rows, drafter)
    advance_triton.advance(inputs, accepted, num, pad, history, slot_rows, drafter, VOCAB)
    assert torch.equal(history, want_history), (k, max_n, min_n)
    for name, got in inputs.tensors.items():
        assert torch.equal(got, want_inputs.tensors[name]), (name, k, max_n, min_n, got, want_inputs.tensors[name])


def check(device: str) -> None:
    rng = random.Random(0)
    for k in (1, 3, 4):
        for max_n in (1, 2, 3, 4):
            for min_n in range(1, max_n + 1):
                for _ in range(3):
                    one_case(rng, k, max_n, min_n, device)


def check_accept(device: str) -> None:
    """``accept_triton.accept`` against ``accept_from_targets`` (after the rows' gather): 1 to 4 drafts,
    every draft matching, none, a mismatch at each position, lengths 0 .. D, rows in any order."""
    from tpspec.speculative import accept_triton
    from tpspec.speculative.accept import accept_from_targets

    gen = torch.Generator().manual_seed(3)
    for d in (1, 2, 3, 4):
        batch = 40
        rows = torch.randperm(batch * (d + 1), generator=gen)
        row_tokens = torch.randint(0, 3, (batch * (d + 1),), generator=gen)  # 3 tokens: many matches
        row_index = rows.reshape(batch, d + 1)
        drafts = torch.randint(0, 3, (batch, d), generator=gen)
        drafts[0] = row_tokens[row_index[0, :d]]  # every draft matches
        drafts[1] = (row_tokens[row_index[1, :d]] + 1) % 3  # none does
        lens = torch.randint(0, d + 1, (batch,), generator=gen)
        lens[:2] = d
        want = accept_from_targets(row_tokens[row_index], drafts, lens, check_values=False)
        got = accept_triton.accept(*(t.to(device) for t in (row_tokens, row_index, drafts, lens)))
        for g, w, name in zip(got, want, ("accepted", "num")):
            assert torch.equal(g.cpu(), w), (d, name)
        assert int(want[1][0]) == d + 1 and int(want[1][1]) == 1


def main(dtype: str) -> None:
    check("cpu")
    check_accept("cpu")
    print(f"advance torch.{dtype}: ok")


if __name__ == "__main__":
    main(sys.argv[1])
