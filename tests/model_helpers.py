"""Shared helpers of the tests: reference decode loops over a TPLlamaForCausalLM (every rank
calls them the same number of times), and a rank's slice of full logits."""

from __future__ import annotations

import torch

from tpspec.model import ForwardBatch
from tpspec.vocab_parallel import VocabShardedLogits, vocab_shard_bounds

# The tests address the paged cache through "slots": slot s owns PAGES_PER_SLOT pages of PAGE_SIZE
# tokens, scattered over the pool and in descending order, so paging is exercised for real.
NUM_SLOTS = 16
PAGE_SIZE = 8
PAGES_PER_SLOT = 16  # 128 tokens a slot


def slot_pages(slot: int) -> list[int]:
    """The block table of ``slot`` (pages ``(PAGES_PER_SLOT - 1 - j) * NUM_SLOTS + slot``)."""
    return [(PAGES_PER_SLOT - 1 - j) * NUM_SLOTS + slot for j in range(PAGES_PER_SLOT)]


def allocate_slots(model, num_slots: int = NUM_SLOTS) -> None:
    """Allocate the pages that slots ``[0, num_slots)`` use (``num_slots <= NUM_SLOTS``)."""
    model.allocate_kv_cache((PAGES_PER_SLOT - 1) * NUM_SLOTS + num_slots, PAGE_SIZE)


def make_batch(seqs: list[tuple[int, int, list[int]]], logits_rows: list[int] | None = None) -> ForwardBatch:
    """``seqs``: ``(slot, cache_len, new_tokens)``; positions = cache_len + i. Empty list -> empty batch."""
    tokens = [t for _, _, new in seqs for t in new]
    positions = [c + i for _, c, new in seqs for i in range(len(new))]
    return ForwardBatch(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
        [slot_pages(s) for s, _, _ in seqs],
        [c for _, c, _ in seqs],
        [len(new) for _, _, new in seqs],
        None if logits_rows is None else torch.tensor(logits_rows, dtype=torch.int64),
    )


def greedy_generate(model, prompts: list[list[int]], steps: int, slots: list[int] | None = None) -> list[list[int]]:
    """Prefill every prompt in one batch, then ``steps - 1`` batched decode steps; greedy tokens per prompt."""
    slots = list(range(len(prompts))) if slots is None else slots
    out = [[t] for t in model(make_batch([(s, 0, p) for s, p in zip(slots, prompts)])).argmax().tolist()]
    lens = [len(p) for p in prompts]
    for _ in range(steps - 1):
        step = model(make_batch([(s, n, [o[-1]]) for s, n, o in zip(slots, lens, out)])).argmax().tolist()
        for o, t in zip(out, step):
            o.append(t)
        lens = [n + 1 for n in lens]
    return out


def all_logits_stepwise(model, seq: list[int], slot: int) -> torch.Tensor:
    """``[len(seq), vocab]`` full logits, one token per forward (the plainest possible reference)."""
    rows = []
    for i, t in enumerate(seq):
        rows.append(model(make_batch([(slot, i, [t])])).gather())
    return torch.cat(rows)


def speculative_greedy(model, prompt: list[int], steps: int, propose, slot: int = 0) -> tuple[list[int], int, int]:
    """Greedy speculative decoding with a host drafter ``propose(history) -> drafts``.

    Returns ``(generated tokens, drafts proposed, drafts accepted)``; exactly equal to plain
    greedy decoding when the model is exact. Rejected positions are rewound by lowering cache_len.
    """
    first = model(make_batch([(slot, 0, prompt)])).argmax().tolist()
    history, cache_len, out = list(prompt) + first, len(prompt), list(first)
    proposed = accepted = 0
    while len(out) < steps:
        drafts = list(propose(history))[: steps - len(out) - 1] if steps - len(out) > 1 else []
        query = [history[-1]] + drafts
        target = model(make_batch([(slot, cache_len, query)], list(range(len(query))))).argmax().tolist()
        n_ok = 0
        while n_ok < len(drafts) and drafts[n_ok] == target[n_ok]:
            n_ok += 1
        new = drafts[:n_ok] + [target[n_ok]]
        proposed += len(drafts)
        accepted += n_ok
        cache_len += 1 + n_ok  # the last input token and the accepted drafts stay cached; the rest is rewound
        history += new
        out += new
    return out[:steps], proposed, accepted


# A mixed step: sequence A continues its prompt (context chunk), B verifies 3 drafts, C decodes one token;
# then B is rewound to keep 1 draft and takes 2 other tokens at the rejected positions.
MIXED_A = [1, 11, 29, 47, 83, 101, 131, 151, 199, 223]
MIXED_B = [1, 7, 19, 31, 61, 79, 97, 113, 211, 307, 401, 409]  # prompt = first 8; then 1 + 3 drafts
MIXED_C = [1, 3, 5, 9, 17, 33, 65]  # prompt = first 6; then 1 token
MIXED_B_REWOUND = MIXED_B[:10] + [77, 88]


def mixed_scenario(model, slots: tuple[int, int, int] = (0, 1, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the mixed steps; return (step-2 logits of all 10 rows, step-3 logits of B's 2 rows), full vocab."""
    a, b, c = slots
    model(make_batch([(a, 0, MIXED_A[:5]), (b, 0, MIXED_B[:8]), (c, 0, MIXED_C[:6])]))
    step2 = model(make_batch([(a, 5, MIXED_A[5:]), (b, 8, MIXED_B[8:12]), (c, 6, MIXED_C[6:7])],
                             list(range(10)))).gather()
    step3 = model(make_batch([(b, 10, MIXED_B_REWOUND[10:])], [0, 1])).gather()
    return step2, step3


def mixed_reference(model, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`mixed_scenario` must return, from one-token-at-a-time decoding in ``slot``."""
    la = all_logits_stepwise(model, MIXED_A, slot)
    lb = all_logits_stepwise(model, MIXED_B, slot)
    lc = all_logits_stepwise(model, MIXED_C, slot)
    lr = all_logits_stepwise(model, MIXED_B_REWOUND, slot)
    return torch.cat([la[5:10], lb[8:12], lc[6:7]]), lr[10:12]


def assert_shape_logits_match_torch_backend(backend: str) -> None:
    """Two layers of the Llama-3-8B shape (vocabulary 4096, random weights of seed 0) in bfloat16 on
    CUDA: :func:`mixed_scenario` (prefill, verification, decode, a rewound step) through the
    ``backend`` attention gives the torch backend's logits (within 3e-2)."""
    from tpspec.model import random_model, shape_config

    cfg = shape_config("llama-3-8b", num_layers=2, vocab_size=4096)
    logits = {}
    for name in ("torch", backend):
        model = random_model(cfg, device="cuda", dtype=torch.bfloat16, attention_backend=name, seed=0)
        assert model.attention.name == name
        allocate_slots(model, 4)
        logits[name] = [t.float() for t in mixed_scenario(model)]
    for got, want in zip(logits[backend], logits["torch"]):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def sharded(full: torch.Tensor, world: int, rank: int, exchange) -> VocabShardedLogits:
    """Rank ``rank``'s slice of the full ``[R, V]`` logits at TP = ``world``; the padding
    columns of the last shard hold a high value that must never win."""
    vocab = full.shape[1]
    offset, width, real = vocab_shard_bounds(vocab, world, rank)
    local = torch.full((full.shape[0], width), 50.0)
    local[:, :real] = full[:, offset:offset + real]
    return VocabShardedLogits(local, offset, vocab, exchange)
