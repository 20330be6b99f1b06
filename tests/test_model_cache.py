"""KV cache semantics at TP = 1: mixed batches equal step-by-step decoding, rewind, slots,
batch validation; and the drafters."""

from __future__ import annotations

import pytest
import torch

from model_helpers import (allocate_slots, all_logits_stepwise, greedy_generate, make_batch, mixed_reference,
                           mixed_scenario, speculative_greedy)
from tpspec.model import DraftModel, ForwardBatch, NgramDrafter, load_model, make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_checkpoint(root / "target", seed=0)
    draft = make_tiny_checkpoint(root / "draft", seed=0, draft=True)
    return target, draft


@pytest.fixture(scope="module")
def model(tiny):
    m = load_model(tiny[0])
    allocate_slots(m, 8)
    return m


def test_mixed_batch_equals_step_by_step(model):
    step2, step3 = mixed_scenario(model, slots=(0, 1, 2))
    ref2, ref3 = mixed_reference(model, slot=3)
    torch.testing.assert_close(step2, ref2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step3, ref3, atol=1e-5, rtol=1e-5)
    assert torch.equal(step2.argmax(-1), ref2.argmax(-1)) and torch.equal(step3.argmax(-1), ref3.argmax(-1))


def test_rewind_overwrites_stale_entries(model):
    seq = [1, 40, 41, 42, 43, 44, 45, 46]
    ref = all_logits_stepwise(model, seq, slot=4)
    # Fill slot 5 with a different continuation, rewind to 4 cached tokens, write the real one.
    model(make_batch([(5, 0, seq[:4] + [400, 401, 402, 403, 404, 405])]))
    out = model(make_batch([(5, 4, seq[4:])], [0, 1, 2, 3])).gather()
    torch.testing.assert_close(out, ref[4:], atol=1e-5, rtol=1e-5)


def test_slots_are_independent_and_order_free(model):
    prompts = [[1, 9, 8, 7], [1, 300, 301], [1, 2, 3, 4, 5, 6]]
    together = greedy_generate(model, prompts, 6, slots=[6, 2, 4])
    alone = [greedy_generate(model, [p], 6, slots=[0])[0] for p in prompts]
    assert together == alone


def test_speculative_greedy_with_ngram_and_draft_model_equals_plain_greedy(tiny, model):
    prompts = [[1, 5, 17, 300, 42, 3], [1, 8, 9, 10, 8, 9, 10, 8]]
    plain = greedy_generate(model, prompts, 24, slots=[0, 1])
    ngram = NgramDrafter(num_draft_tokens=4)
    total_accepted = 0
    for p, ref in zip(prompts, plain):
        out, _, accepted = speculative_greedy(model, p, 24, ngram.propose, slot=2)
        assert out == ref
        total_accepted += accepted
    draft = DraftModel(tiny[1], target_config=model.config)
    allocate_slots(draft, 1)
    assert draft.config.num_layers == 1

    def propose_with_draft(history, k=3):
        # Re-run the draft over the whole history (simple, exact), then k - 1 greedy steps.
        tokens = [int(draft(make_batch([(0, 0, history)])).argmax(channel=0)[0])]
        for i in range(k - 1):
            tokens.append(int(draft(make_batch([(0, len(history) + i, tokens[-1:])])).argmax(channel=0)[0]))
        return tokens

    draft_accepted = 0
    for p, ref in zip(prompts, plain):
        out, _, accepted = speculative_greedy(model, p, 24, propose_with_draft, slot=2)
        assert out == ref
        draft_accepted += accepted
    assert total_accepted > 0 and draft_accepted > 0  # both drafters are sometimes right


def test_ngram_drafter():
    d = NgramDrafter(num_draft_tokens=3, max_ngram=3, min_ngram=1)
    assert d.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]  # 3-gram [1, 2, 3] seen at 0, followed by 4, 1, 2
    assert d.propose([5, 6, 7, 5, 6, 9, 5, 6]) == [9, 5, 6]  # the latest occurrence wins
    assert d.propose([1, 2, 3, 9, 3]) == [9, 3]  # 1-gram fallback, truncated at the end of history
    assert d.propose([1, 2, 3, 4]) == [] and d.propose([]) == [] and d.propose([7]) == []
    assert NgramDrafter(2, max_ngram=2, min_ngram=2).propose([1, 2, 3, 9, 3]) == []
    with pytest.raises(ValueError, match="num_draft_tokens"):
        NgramDrafter(0)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(2, max_ngram=1, min_ngram=2)


def test_ngram_drafter_follows_its_definition():
    """Random histories over small vocabularies (many repeated n-grams) against the definition
    read literally: for n from the largest allowed down, the latest earlier window equal to the
    last n tokens, and what followed it."""
    import random

    def by_definition(hist, k, max_n, min_n):
        for n in range(min(max_n, len(hist) - 1), min_n - 1, -1):
            for start in range(len(hist) - n - 1, -1, -1):
                if hist[start:start + n] == hist[len(hist) - n:]:
                    return hist[start + n:start + n + k]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        hist = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randint(0, 40))]
        max_n = rng.randint(1, 4)
        min_n, k = rng.randint(1, max_n), rng.randint(1, 5)
        assert NgramDrafter(k, max_n, min_n).propose(hist) == by_definition(hist, k, max_n, min_n), (hist, max_n, min_n)


def test_ngram_drafts_on_the_device_equal_the_host_drafts():
    """A batch of random histories (small vocabularies: many repeated n-grams; lengths from 1,
    ragged, junk after each row's end) drafted at once on the device: every row the padded drafts
    of the host drafter on that row's history, for every n-gram range and draft count."""
    import random

    rng = random.Random(1)
    for max_n in range(1, 5):
        for min_n in range(1, max_n + 1):
            for k in (1, 3, 5):
                drafter = NgramDrafter(k, max_n, min_n)
                width = 48
                hists = [[rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randint(1, width))]
                         for _ in range(64)]
                table = torch.tensor([h + [rng.randrange(5) for _ in range(width - len(h))] for h in hists])
                lengths = torch.tensor([len(h) for h in hists])
                got = drafter.draft_on_device(table, lengths).tolist()
                assert got == [drafter.draft(h) for h in hists], (max_n, min_n, k)


def test_draft_vocab_must_match(tmp_path, tiny):
    other = make_tiny_checkpoint(tmp_path / "other", vocab_size=300, tokenizer=False)
    target_cfg = load_model(tiny[0]).config
    with pytest.raises(ValueError, match="vocab_size=300.*512"):
        DraftModel(other, target_config=target_cfg)


def test_bad_batches_are_named(tiny):
    m = load_model(tiny[0])
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        m(make_batch([(0, 0, [1, 2])]))
    m.allocate_kv_cache(4, 4)  # pages 0..3 of 4 tokens
    t = torch.tensor([1, 2, 3])

    def batch(table, cached, new):
        return ForwardBatch(torch.tensor(new), torch.arange(cached, cached + len(new)), [table], [cached], [len(new)])

    cases = [
        (lambda: ForwardBatch(t, t, [[0]], [0], [2]), "sum\\(query_lens\\)=2"),
        (lambda: ForwardBatch(t, t, [[0], [1]], [0], [3]), "one block table, cache_len and query_len"),
        (lambda: ForwardBatch(t, t, [[0], [-1]], [0, 0], [2, 1]), "non-negative page ids"),
        (lambda: ForwardBatch(t, t, [[0], [1]], [0, 0], [3, 0]), "query_lens must all be >= 1"),
        (lambda: ForwardBatch(t.int(), t, [[0]], [0], [3]), "token_ids must be a 1-D int64"),
        (lambda: ForwardBatch(t, t, [[0]], [0], [3], torch.tensor([3])), "logits_rows must lie in \\[0, 3\\)"),
        (lambda: m(batch([4], 0, [1])), "page ids must lie in \\[0, 4\\)"),
        (lambda: m(batch([0], 2, [1, 2, 3])), "needs 2 pages of 4 tokens, its block table has 1"),
        (lambda: m(batch([0], 0, [1, 512])), "token ids must lie in \\[0, 512\\)"),
        (lambda: m.allocate_kv_cache(0, 8), "num_pages must be a positive int"),
        (lambda: m.allocate_kv_cache(8, 0), "page_size must be a positive int"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    # Reallocation gives a usable cache of the new size, exactly the pages asked for.
    m.allocate_kv_cache(3, 16)
    assert m.caches[0].k.shape == (3, 16, 2, 16)
    assert m.kv_cache_bytes(3, 16) == 2 * 2 * 3 * 16 * 2 * 16 * 4 == sum(c.nbytes for c in m.caches)
    assert m(batch([2, 0], 15, [1, 2, 3])).num_rows == 1
