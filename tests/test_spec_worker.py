"""SpecWorker (one step: select, verify, forced) and draft-token selection, single rank."""

import numpy as np
import pytest
import torch
from scipy import stats

from tpspec import SamplingParams, VocabShardedLogits
from tpspec.exchange import AllGatherKeyExchange
from tpspec.sampling import filtered_probs, sample_tokens
from tpspec.sampling.penalties import OccurrenceCounts, apply_penalties
from tpspec.speculative import FORCE_ENV, ForcedAcceptance, SpecMetadata, SpecWorker, select_draft_tokens, strict_accept

EX = AllGatherKeyExchange()


def logits(rows: int, vocab: int, seed: int) -> VocabShardedLogits:
    gen = torch.Generator().manual_seed(seed)
    return VocabShardedLogits(torch.randn(rows, vocab, generator=gen) * 2, 0, vocab, EX)


def test_strict_greedy_step_matches_argmax_reference():
    meta = SpecMetadata(4, 3).prepare([("c", 0, None, True), ("g", 1, None, False), ("h", 2, None, False)], draft_len=3)
    lg = logits(meta.num_rows, 50, 0)
    argmax = lg.local.argmax(dim=1)
    drafts = torch.stack([torch.tensor([0, 0, 0]), argmax[1:4], torch.tensor([int(argmax[5]), 49, 49])])
    out = SpecWorker("strict", forced=None).step(lg, drafts, meta)
    want = strict_accept(argmax, drafts, num_contexts=1, batch_size=3)
    assert torch.equal(out.accepted_tokens, want[0]) and torch.equal(out.num_accepted, want[1])
    assert out.num_accepted.tolist() == [1, 4, 2]
    assert out.next_input_tokens.tolist() == [int(argmax[0]), int(argmax[4]), int(argmax[6])]
    assert torch.equal(out.target_tokens, argmax)


def test_rejection_mode_agrees_with_strict_where_it_must():
    requests = [("c", 0, SamplingParams(temperature=0.8, top_k=10, seed=4), True),
                ("g", 1, SamplingParams(temperature=1.0, seed=9), False)]
    metas = [SpecMetadata(4, 2).prepare(requests, draft_len=2) for _ in range(2)]
    lg = logits(metas[0].num_rows, 40, 1)
    drafts = torch.tensor([[0, 0], [3, 4]])
    strict = SpecWorker("strict", forced=None).step(lg, drafts, metas[0])
    rejection = SpecWorker("rejection", forced=None).step(lg, drafts, metas[1])
    # A context request emits the target's own per-row draw in both modes.
    assert rejection.accepted_tokens[0].tolist() == strict.accepted_tokens[0].tolist()
    # All-greedy batches take the strict path: same tokens.
    greedy = [("a", 0, None, False), ("b", 1, None, True)]
    m1, m2 = (SpecMetadata(4, 2).prepare(greedy, draft_len=2) for _ in range(2))
    lg2 = logits(m1.num_rows, 40, 2)
    d2 = lg2.local[:2].argmax(dim=1).reshape(1, 2).repeat(2, 1)
    a = SpecWorker("strict", forced=None).step(lg2, d2, m1)
    b = SpecWorker("rejection", forced=None).step(lg2, d2, m2)
    assert torch.equal(a.accepted_tokens, b.accepted_tokens) and a.num_accepted.tolist() == [3, 1]


@pytest.mark.slow
def test_worker_rejection_step_is_lossless():
    n, vocab = 40_000, 8
    params = SamplingParams(temperature=1.0, top_k=6, seed=None)
    meta = SpecMetadata(n, 1).prepare([(i, i, params, False) for i in range(n)], draft_len=1)
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(2, vocab, generator=gen)
    full = row.repeat(n, 1)  # rows: position 0, position 1 of every request
    q = torch.softmax(torch.randn(vocab, generator=gen), dim=0)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).reshape(n, 1)
    out = SpecWorker("rejection", forced=None).step(VocabShardedLogits(full, 0, vocab, EX), drafts, meta,
                                                    draft_probs=q.expand(n, 1, vocab))
    p0 = filtered_probs(row[:1], torch.ones(1), torch.tensor([6]), torch.ones(1), torch.zeros(1))[0].double()
    counts = np.bincount(out.accepted_tokens[:, 0].numpy(), minlength=vocab)
    live = (p0 > 0).numpy()
    assert counts[~live].sum() == 0
    expected = (p0[live] / p0[live].sum()).numpy() * n
    assert stats.chisquare(counts[live], expected).pvalue > 1e-3


def test_a_repeated_step_draws_the_forced_counts_of_the_step_it_repeats():
    """``repeat=True`` (a graphed step its candidates could not decide, run again eagerly) steps
    the forced-acceptance counter back first: the repeat accepts what the step it repeats
    accepted, and the step after it draws anew."""
    forced = ForcedAcceptance(1.5)
    worker = SpecWorker("strict", forced=forced)
    requests = [(f"r{i}", i, None, False) for i in range(8)]

    def step(repeat: bool = False) -> torch.Tensor:
        meta = SpecMetadata(8, 3).prepare(requests, draft_len=3)
        lg = logits(meta.num_rows, 50, 0)
        return worker.step(lg, torch.zeros(8, 3, dtype=torch.int64), meta, repeat=repeat).num_accepted

    first = step()
    assert int(forced.counter) == 1 and set(first.tolist()) == {2, 3}  # 1 or 2 drafts, then the target's token
    assert torch.equal(step(repeat=True), first) and int(forced.counter) == 1
    second = step()
    assert int(forced.counter) == 2 and not torch.equal(second, first)


def test_gathered_rejection_path_draws_each_request_from_its_own_stream():
    """Full draft laws send rejection sampling down the gathered path; there every request
    draws with its own Philox stream: its tokens alone equal its tokens in a batch of requests
    with other seeds (one batch-wide seed would give request i the stream of request 0)."""
    n, d, vocab = 16, 2, 32
    gen = torch.Generator().manual_seed(12)
    rows = torch.randn(n, d + 1, vocab, generator=gen) * 0.5  # flat rows: the draws vary with the stream
    q = torch.softmax(torch.randn(n, d, vocab, generator=gen) * 0.5, dim=2)
    drafts = torch.randint(0, vocab, (n, d), generator=gen)
    params = [SamplingParams(temperature=1.0, seed=1000 + 7 * i) for i in range(n)]

    def run(picks: list[int], seeds: list[SamplingParams]) -> tuple[torch.Tensor, SpecWorker]:
        meta = SpecMetadata(n, d).prepare([(i, slot, seeds[i], False) for slot, i in enumerate(picks)], draft_len=d)
        worker = SpecWorker("rejection", forced=None)
        lg = VocabShardedLogits(rows[picks].reshape(-1, vocab), 0, vocab, EX)
        out = worker.step(lg, drafts[picks], meta, draft_probs=q[picks])
        return out.accepted_tokens, worker

    batched, worker = run(list(range(n)), params)
    assert worker.sampling_stats.rows_gathered == n * (d + 1) and worker.sampling_stats.rows_sharded == 0
    for i in range(n):
        alone, _ = run([i], params)
        assert torch.equal(alone[0], batched[i]), i
    # The data tells streams apart: the batch under other seeds emits other tokens.
    reseeded, _ = run(list(range(n)), [SamplingParams(temperature=1.0, seed=5000 + i) for i in range(n)])
    assert not torch.equal(reseeded, batched)


def test_forced_acceptance_from_env(monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "2")
    meta = SpecMetadata(4, 3).prepare([("g", 0, None, False), ("c", 1, None, True)], draft_len=3)
    lg = logits(meta.num_rows, 30, 4)
    drafts = torch.tensor([[29, 28, 27], [0, 0, 0]])  # wrong drafts, accepted anyway
    worker = SpecWorker("strict")
    warm = worker.step(lg, drafts, meta, is_warmup=True)
    assert warm.num_accepted.tolist() == [1, 1]
    out = worker.step(lg, drafts, meta)
    assert out.num_accepted.tolist() == [3, 1]
    assert out.accepted_tokens[0, :2].tolist() == [29, 28]
    assert out.accepted_tokens[0, 2] == out.target_tokens[2]
    assert int(worker.forced_acceptance(torch.device("cpu")).counter) == 1


def test_draft_selection():
    requests = [("a", 0, SamplingParams(temperature=0.9, seed=1), False), ("b", 1, None, False)]
    meta = SpecMetadata(4, 2).prepare(requests, draft_len=2)
    lg = logits(2, 64, 5)
    greedy = select_draft_tokens(lg, meta, 0)
    assert greedy.logits is None and torch.equal(greedy.tokens, lg.local.argmax(dim=1))
    sampled = select_draft_tokens(lg, meta, 0, sample=True)
    again = select_draft_tokens(lg, meta, 0, sample=True)
    assert torch.equal(sampled.tokens, again.tokens)  # the draft step's stream, reproducible
    assert sampled.logits is lg.local and sampled.tokens[1] == lg.local[1].argmax()
    # The draft step's stream: the same draw as sampling request a's row with it.
    rs = meta.request_sampling(meta.draft_offsets(0))
    assert sampled.tokens[0] == lg.sample(rs.temperature, rs.seeds, rs.offsets, channel=0)[0]
    # Each draft step draws from its own stream: over 8 steps the sampled request's draws
    # change (a selection that ignored `step` would repeat step 0's token 8 times).
    meta8 = SpecMetadata(4, 8).prepare(requests, draft_len=8)
    per_step = [int(select_draft_tokens(lg, meta8, step, sample=True).tokens[0]) for step in range(8)]
    assert len(set(per_step)) > 1, per_step
    # Rows from a later request on: request b alone.
    only_b = select_draft_tokens(logits(1, 64, 6), meta, 0, sample=True, first_request=1)
    assert only_b.tokens.tolist() == [int(logits(1, 64, 6).local.argmax())]
    with pytest.raises(ValueError, match="rows"):
        select_draft_tokens(logits(3, 64, 5), meta, 0)
    # A request with a filter draws with it: the draw of its filtered row, on the shards.
    filtered = SpecMetadata(4, 2).prepare([("f", 0, SamplingParams(temperature=0.9, top_k=5, seed=1), False)], 2)
    lf = logits(1, 64, 5)
    pick = select_draft_tokens(lf, filtered, 0, sample=True)
    rf = filtered.request_sampling(filtered.draft_offsets(0))
    assert pick.logits is lf.local
    assert pick.tokens[0] == sample_tokens(lf, rf.temperature, rf.seeds, rf.offsets, top_k=rf.top_k, channel=0)[0]
    assert pick.tokens[0] in torch.topk(lf.local[0], 5).indices


def test_sampled_drafts_are_penalised_like_their_verification_rows():
    """Draft step j of a penalised request draws from its draft logits penalised with the slot's
    counts plus drafts 0..j-1 as output (the rule of the verification row j), and returns
    exactly those penalised logits as q (a greedy penalised request takes their argmax)."""
    vocab = 64
    occ = OccurrenceCounts(4, vocab_offset=0, width=vocab)
    pen = dict(repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=0.9)
    requests = [("a", 2, SamplingParams(temperature=0.9, seed=1, **pen), False),
                ("b", 0, SamplingParams(temperature=0.0, **pen), False), ("c", 1, None, False)]
    for slot, prompt in ((2, [3, 4, 5]), (0, [7, 7, 8]), (1, [3, 9])):
        occ.reset(slot, prompt)
    occ.add(torch.tensor([2, 0, 1]), torch.tensor([[6, 6, 3], [9, -1, -1], [4, 4, 4]]))
    meta = SpecMetadata(4, 3, occurrences=occ).prepare(requests, draft_len=3)
    lg = logits(3, vocab, 11)
    previous = torch.tensor([[10, 6], [11, 11], [3, 3]])  # drafts 0 and 1 of the chain
    sel = select_draft_tokens(lg, meta, 2, sample=True, previous_drafts=previous)
    params = [r[2] or SamplingParams() for r in requests]
    want = apply_penalties(lg.local, vocab_offset=0, counts=occ, slots=torch.tensor([2, 0, 1]), drafts=previous,
                           repetition=torch.tensor([p.repetition_penalty for p in params]),
                           presence=torch.tensor([p.presence_penalty for p in params]),
                           frequency=torch.tensor([p.frequency_penalty for p in params]))
    assert torch.equal(sel.logits, want)
    assert not torch.equal(want[:2], lg.local[:2]) and torch.equal(want[2], lg.local[2])  # c has no penalties
    rs = meta.request_sampling(meta.draft_offsets(2))
    ref = VocabShardedLogits(want, 0, vocab, EX)
    assert torch.equal(sel.tokens, ref.sample(rs.temperature, rs.seeds, rs.offsets, channel=0))
    assert sel.tokens[1] == want[1].argmax() and sel.tokens[2] == lg.local[2].argmax()
    # The previous drafts count: without them the rows would be penalised differently.
    alone = meta.draft_penalties(None).apply(lg.local, 0)
    assert not torch.equal(alone[:2], want[:2])
    with pytest.raises(ValueError, match="previous drafts"):
        select_draft_tokens(lg, meta, 2, sample=True)
    with pytest.raises(ValueError, match="previous_drafts"):
        meta.draft_penalties(previous[:2])


def test_worker_errors():
    with pytest.raises(ValueError, match="acceptance"):
        SpecWorker("lossy")
    meta = SpecMetadata(2, 2).prepare([("a", 0, None, False)], draft_len=2)
    lg = logits(3, 10, 0)
    with pytest.raises(ValueError, match="draft_tokens"):
        SpecWorker(forced=None).step(lg, torch.zeros(1, 3, dtype=torch.int64), meta)
    with pytest.raises(ValueError, match="draft_tokens is None"):
        SpecWorker(forced=None).step(lg, None, meta)


def test_rejection_and_strict_agree_on_rows_with_inf_or_nan_logits():
    # Such a row's target draw is a point mass on its first NaN (else first +inf) column:
    # rejection must accept a draft there and emit that column, as strict acceptance does.
    for bad in (float("inf"), float("nan")):
        x = torch.zeros(2, 8)
        x[:, 5] = bad
        requests = [("r", 0, SamplingParams(temperature=1.0, seed=1), False)]
        for draft in (3, 5):
            got = {}
            for mode in ("strict", "rejection"):
                meta = SpecMetadata(2, 1).prepare(requests, draft_len=1)
                out = SpecWorker(mode, forced=None).step(VocabShardedLogits(x.clone(), 0, 8, EX),
                                                         torch.tensor([[draft]]), meta)
                got[mode] = out.accepted_tokens.tolist()
            assert got["strict"] == got["rejection"] == ([[5, -1]] if draft == 3 else [[5, 5]]), (bad, draft, got)


def test_padding_requests_verify_no_drafts_in_either_acceptance_mode():
    # A padding request (slot -1, drafts -1) in a batch of generation requests only:
    # rejection must skip its drafts as strict acceptance does, with or without contexts.
    requests = [("r", 0, SamplingParams(temperature=1.0, seed=3), False), ("pad", -1, None, False)]
    for mode in ("strict", "rejection"):
        meta = SpecMetadata(4, 2).prepare(requests, draft_len=2)
        lg = logits(meta.num_rows, 16, 0)
        out = SpecWorker(mode, forced=None).step(lg, torch.tensor([[1, 2], [-1, -1]]), meta)
        assert out.num_accepted[1] == 1 and out.accepted_tokens[1, 1:].tolist() == [-1, -1], mode
