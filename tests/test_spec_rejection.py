"""Rejection sampling on vocabulary shards: the same tokens at TP 1, 2 and 4; greedy requests
verify strictly; q == p accepts every draft; the first token follows p exactly (chi-square);
the engine's sampled drafts (draft model and EAGLE-3) are verified without gathering a row."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from tpspec import VocabShardedLogits
from tpspec import distributed as D
from tpspec.exchange import AllGatherKeyExchange
from tpspec.exchange.local import LocalKeyExchange
from tpspec.speculative import accept_from_targets, sharded_rejection_sample
from tpspec.testing import run_ranks
from tpspec.vocab_parallel import vocab_shard_bounds

V, K = 50, 3  # 50 columns: uneven shards at TP 4 (13, 13, 13, 11)


def make_case(num_requests: int, seed: int, *, draft_equals_target: bool = False) -> dict:
    """Target rows, draft logits, drafts drawn from them, one greedy and one context request."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(num_requests * (K + 1), V, generator=gen) * 1.5
    draft = torch.randn(num_requests, K, V, generator=gen) * 1.5 + target.view(num_requests, K + 1, V)[:, :K] * 0.5
    if draft_equals_target:
        draft = target.view(num_requests, K + 1, V)[:, :K].clone()
    temperature = torch.full((num_requests,), 0.9)
    temperature[0] = 0.0  # a greedy request
    probs = torch.softmax(draft / temperature.clamp(min=1e-3).reshape(-1, 1, 1), dim=-1)
    drafts = torch.multinomial(probs.reshape(-1, V), 1, generator=gen).view(num_requests, K)
    drafts[0] = draft[0].argmax(dim=-1)
    lens = torch.full((num_requests,), K, dtype=torch.int64)
    lens[1] = 0  # a context request: one token from p_0
    return {"target": target, "draft": draft, "temperature": temperature, "drafts": drafts, "lens": lens,
            "seeds": torch.arange(num_requests, dtype=torch.int64) + 1000 * seed,
            "offsets": torch.full((num_requests,), 7 * 32, dtype=torch.int64),
            "row_index": torch.arange(num_requests * (K + 1)).view(num_requests, K + 1)}


def shard(full: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, int]:
    offset, width, real = vocab_shard_bounds(V, world, rank)
    local = torch.full(full.shape[:-1] + (width,), 40.0)  # padding columns must never count
    local[..., :real] = full[..., offset:offset + real]
    return local, offset


def verify(case: dict, world: int, rank: int, exchange) -> tuple[torch.Tensor, torch.Tensor]:
    target, offset = shard(case["target"], world, rank)
    draft, _ = shard(case["draft"], world, rank)
    logits = VocabShardedLogits(target, offset, V, exchange)
    return sharded_rejection_sample(logits, case["row_index"], case["temperature"], case["drafts"], case["lens"],
                                    case["seeds"], case["offsets"], draft)


def _ranks_worker(rank: int, world: int, case: dict) -> dict:
    pair = D.tp_group()  # run_ranks(tp_size=2): ranks {0, 1} and {2, 3}
    return {"tp4": verify(case, 4, rank, AllGatherKeyExchange(None)),
            "tp2": verify(case, 2, rank % 2, AllGatherKeyExchange(pair))}


def test_same_tokens_at_tp_1_2_4_and_greedy_is_strict():
    case = make_case(24, seed=1)
    ref = verify(case, 1, 0, LocalKeyExchange("cpu"))
    for result in run_ranks(_ranks_worker, 4, case, tp_size=2, timeout_s=120):
        for name in ("tp4", "tp2"):
            assert torch.equal(result[name][0], ref[0]) and torch.equal(result[name][1], ref[1]), name
    accepted, num = ref
    # The greedy request: strict verification against the target's argmax.
    argmax = case["target"].view(24, K + 1, V)[0].argmax(dim=-1)
    want, want_num = accept_from_targets(argmax.view(1, -1), case["drafts"][:1])
    assert torch.equal(accepted[0], want[0]) and int(num[0]) == int(want_num[0])
    assert int(num[1]) == 1 and bool((accepted[1, 1:] == -1).all())  # the context request
    assert 0 < int((num[2:] - 1).sum()) < 22 * K  # some drafts kept, some rejected


def test_each_request_draws_from_its_own_stream_on_the_shards():
    """A request's verdict depends on its rows, seed and offset only: the same alone, at any
    position of a permuted batch; another offset draws anew. (The same tokens at TP 2 and 4:
    the test above.)"""
    n = 24
    case = make_case(n, seed=5)
    accepted, num = verify(case, 1, 0, LocalKeyExchange("cpu"))
    per_request = ("temperature", "drafts", "lens", "seeds", "offsets", "row_index")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(6))
    permuted = dict(case, **{k: case[k][perm] for k in per_request}, draft=case["draft"][perm])
    got, got_num = verify(permuted, 1, 0, LocalKeyExchange("cpu"))
    assert torch.equal(got, accepted[perm]) and torch.equal(got_num, num[perm])
    for i in (0, 1, 5, n - 1):
        alone = dict(case, **{k: case[k][i:i + 1] for k in per_request}, draft=case["draft"][i:i + 1])
        one, one_num = verify(alone, 1, 0, LocalKeyExchange("cpu"))
        assert torch.equal(one[0], accepted[i]) and int(one_num[0]) == int(num[i]), i
    moved = dict(case, offsets=case["offsets"] + 1000 * 32)
    assert not torch.equal(verify(moved, 1, 0, LocalKeyExchange("cpu"))[0], accepted)


def test_draft_equal_to_target_accepts_everything():
    case = make_case(32, seed=2, draft_equals_target=True)
    accepted, num = verify(case, 1, 0, LocalKeyExchange("cpu"))
    sampled = torch.arange(32) >= 2
    assert bool((num[sampled] == K + 1).all())
    assert torch.equal(accepted[sampled, :K], case["drafts"][sampled])


def test_first_token_follows_the_target_distribution():
    """Over 6000 requests (one row of p_0 and q for all, drafts drawn from q), the first emitted
    token is distributed as softmax(p_0 / T): accepted drafts and residual draws together."""
    n = 6000
    case = make_case(n, seed=3)
    p0 = case["target"].view(n, K + 1, V)[:, 0]
    case["target"].view(n, K + 1, V)[:] = case["target"].view(n, K + 1, V)[:1]  # every request: request 0's rows
    case["draft"][:] = case["draft"][:1]
    case["temperature"][:] = 0.9
    case["lens"][:] = K
    gen = torch.Generator().manual_seed(4)
    q = torch.softmax(case["draft"][0] / 0.9, dim=-1)
    case["drafts"] = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(K)], 1)
    accepted, num = verify(case, 1, 0, LocalKeyExchange("cpu"))
    expected = torch.softmax(p0[0].double() / 0.9, dim=-1) * n
    observed = torch.bincount(accepted[:, 0], minlength=V).double()
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    assert stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3
    rejected_first = int((num == 1).sum())
    assert 0.1 * n < rejected_first < 0.9 * n  # both the acceptance and the residual draws contribute


# ------------------------------------------------------------------ the engine
def _engine_stats(rank: int, world: int, target_dir: str, draft_dir: str, method: str, adp: bool):
    from tpspec.mapping import Mapping
    from tpspec.runtime.config import EngineConfig, Request, SpeculativeConfig
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    spec = SpeculativeConfig(method, num_speculative_tokens=3, model=draft_dir, acceptance="rejection")
    cfg = EngineConfig(model_path=target_dir, tp_size=world, device="cpu", dtype="float32", attention_dp=adp,
                       speculative=spec, draft_model_path=draft_dir, max_batch_size=4, max_seq_len=64,
                       max_num_tokens=32)
    engine = Engine(cfg, Mapping(world, rank, enable_attention_dp=adp))
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.2, seed=2),
              SamplingParams(temperature=0.0)]
    reqs = [Request(i, tuple(p), params[i], 12) for i, p in enumerate([[5, 6, 7, 8], [9, 10, 11], [3, 4]])]
    results = engine.generate(reqs)
    stored = engine.draft_store.buffer.abs().sum().item()
    return [r.token_ids for r in results], engine.worker.sampling_stats, stored, sum(r.stats.num_accepted_drafts
                                                                              for r in results)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tpspec.model.tiny import make_tiny_checkpoint, make_tiny_eagle3_head

    root = tmp_path_factory.mktemp("rejection")
    target = make_tiny_checkpoint(root / "tiny", seed=0)
    return str(target), str(make_tiny_checkpoint(root / "draft", seed=0, draft=True)), \
        str(make_tiny_eagle3_head(root / "head", target))


@pytest.mark.parametrize("method,adp", [("draft_model", False), ("eagle3", False), ("eagle3", True)],
                         ids=["draft_model", "eagle3", "eagle3-adp"])
def test_engine_verifies_sampled_drafts_without_gathering(ckpt, method, adp):
    draft = ckpt[1] if method == "draft_model" else ckpt[2]
    results = run_ranks(_engine_stats, 2, ckpt[0], draft, method, adp, timeout_s=180)
    assert results[0][0] == results[1][0]
    tokens, worker_stats, stored, accepted = results[0]
    assert worker_stats.rows_sharded > 0 and worker_stats.rows_gathered == 0
    assert stored > 0  # the sampled drafts' logits were kept for verification
    if method == "draft_model":
        assert accepted > 0  # the draft model's sampled drafts are often kept


# ------------------------------------------------------------------ filtered target rows
def filtered_case(num_requests: int, seed: int) -> dict:
    """Requests cycling through top-k, top-p, top-k + top-p, min-p and no filter; one-hot drafts."""
    case = make_case(num_requests, seed)
    case["top_k"] = torch.tensor([[5, 2**31 - 1, 8, 2**31 - 1, 2**31 - 1][i % 5] for i in range(num_requests)])
    case["top_p"] = torch.tensor([[1.0, 0.8, 0.9, 1.0, 1.0][i % 5] for i in range(num_requests)])
    case["min_p"] = torch.tensor([[0.0, 0.0, 0.0, 0.1, 0.0][i % 5] for i in range(num_requests)])
    case["draft"] = None
    return case


def verify_filtered(case: dict, world: int, rank: int, exchange):
    target, offset = shard(case["target"], world, rank)
    logits = VocabShardedLogits(target, offset, V, exchange)
    return sharded_rejection_sample(logits, case["row_index"], case["temperature"], case["drafts"], case["lens"],
                                    case["seeds"], case["offsets"], top_k=case["top_k"], top_p=case["top_p"],
                                    min_p=case["min_p"])


def _filtered_worker(rank: int, world: int, case: dict) -> dict:
    pair = D.tp_group()
    return {"tp4": verify_filtered(case, 4, rank, AllGatherKeyExchange(None)),
            "tp2": verify_filtered(case, 2, rank % 2, AllGatherKeyExchange(pair))}


def test_filtered_rows_on_shards_same_tokens_at_tp_1_2_4():
    case = filtered_case(30, seed=5)
    ref = verify_filtered(case, 1, 0, LocalKeyExchange("cpu"))
    assert ref is not None
    for result in run_ranks(_filtered_worker, 4, case, tp_size=2, timeout_s=120):
        for name in ("tp4", "tp2"):
            assert torch.equal(result[name][0], ref[0]) and torch.equal(result[name][1], ref[1]), name


def test_filtered_first_token_follows_the_truncated_distribution():
    """6000 requests with top-k 8 + top-p 0.9 (and, apart, min-p 0.1) and one-hot drafts: the first
    emitted token follows the filtered target law (the full-row reference's keep mask)."""
    from tpspec.sampling.ops import keep_mask

    n = 6000
    for top_k, top_p, min_p in ((8, 0.9, 0.0), (2**31 - 1, 1.0, 0.1)):
        case = make_case(n, seed=6)
        rows = case["target"].view(n, K + 1, V)
        rows[:] = rows[:1]
        case["temperature"][:] = 0.9
        case["lens"][:] = K
        case["drafts"][:] = rows[0, :K].argmax(dim=-1)  # one-hot drafts at each row's mode
        case.update(top_k=torch.full((n,), top_k), top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p),
                    draft=None)
        accepted, _ = verify_filtered(case, 1, 0, LocalKeyExchange("cpu"))
        t = torch.tensor([0.9])
        kept = keep_mask(rows[0, :1], t, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
        law = torch.softmax(rows[0, 0].double() / 0.9, dim=-1) * kept
        expected = law / law.sum() * n
        observed = torch.bincount(accepted[:, 0], minlength=V).double()
        assert observed[~kept].sum() == 0  # nothing outside the filter
        keep = expected >= 5
        obs = torch.cat([observed[keep], observed[kept & ~keep].sum().reshape(1)])
        exp = torch.cat([expected[keep], expected[kept & ~keep].sum().reshape(1)])
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        assert stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def test_flat_top_p_row_is_left_to_the_gathered_path():
    """A flat row of 300 columns under top-p 0.9 needs ~270 columns: more than the candidates
    certify, so the shards decline (None) and the worker gathers."""
    vocab = 300
    logits = VocabShardedLogits(torch.zeros(2, vocab), 0, vocab, LocalKeyExchange("cpu"))
    args = (torch.arange(2).view(1, 2), torch.tensor([0.9]), torch.tensor([[7]]), torch.tensor([1]),
            torch.tensor([3]), torch.tensor([64]))
    assert sharded_rejection_sample(logits, *args, top_p=torch.tensor([0.9])) is None
    assert sharded_rejection_sample(logits, *args, top_p=torch.tensor([0.05])) is not None  # 15 columns: certified


def test_filtered_sampled_drafts_same_tokens_at_tp_1_2_4_and_lossless():
    """Drafts drawn from the filtered q (top-k 6 + top-p 0.9): verified on the shards with q cut by
    the same filters, the same tokens at TP 1, 2 and 4, and the first token follows the filtered p."""
    from tpspec.sampling.ops import keep_mask

    n = 6000
    case = make_case(n, seed=8)
    rows = case["target"].view(n, K + 1, V)
    rows[:] = rows[:1]
    case["draft"][:] = case["draft"][:1]
    case["temperature"][:] = 0.9
    case["lens"][:] = K
    case.update(top_k=torch.full((n,), 6), top_p=torch.full((n,), 0.9), min_p=torch.zeros(n))
    t = torch.full((K,), 0.9)
    q_keep = keep_mask(case["draft"][0], t, torch.full((K,), 6), torch.full((K,), 0.9), torch.zeros(K))
    q = torch.softmax(case["draft"][0] / 0.9, dim=-1) * q_keep
    gen = torch.Generator().manual_seed(9)
    case["drafts"] = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(K)], 1)

    def run(world, rank, exchange):
        target, offset = shard(case["target"], world, rank)
        draft, _ = shard(case["draft"], world, rank)
        return sharded_rejection_sample(VocabShardedLogits(target, offset, V, exchange), case["row_index"],
                                        case["temperature"], case["drafts"], case["lens"], case["seeds"],
                                        case["offsets"], draft, top_k=case["top_k"], top_p=case["top_p"],
                                        min_p=case["min_p"])

    accepted, num = run(1, 0, LocalKeyExchange("cpu"))
    small = {k: (v[:64] if isinstance(v, torch.Tensor) and v.shape[0] == n else v) for k, v in case.items()}
    small["target"] = case["target"][: 64 * (K + 1)]
    small["row_index"] = case["row_index"][:64]
    for result in run_ranks(_filtered_draft_worker, 4, small, tp_size=2, timeout_s=120):
        for name in ("tp4", "tp2"):
            assert torch.equal(result[name][0], accepted[:64]) and torch.equal(result[name][1], num[:64]), name
    p_keep = keep_mask(rows[0, :1], t[:1], torch.tensor([6]), torch.tensor([0.9]), torch.zeros(1))[0]
    law = torch.softmax(rows[0, 0].double() / 0.9, dim=-1) * p_keep
    expected = law / law.sum() * n
    observed = torch.bincount(accepted[:, 0], minlength=V).double()
    assert observed[~p_keep].sum() == 0
    keep = expected >= 5
    assert stats.chisquare(observed[keep].numpy(),
                           (expected[keep] * observed[keep].sum() / expected[keep].sum()).numpy()).pvalue > 1e-3
    assert 0.05 * n < int((num == 1).sum()) < 0.95 * n


def _filtered_draft_worker(rank: int, world: int, case: dict) -> dict:
    pair = D.tp_group()

    def run(tp, tp_rank, exchange):
        target, offset = shard(case["target"], tp, tp_rank)
        draft, _ = shard(case["draft"], tp, tp_rank)
        return sharded_rejection_sample(VocabShardedLogits(target, offset, V, exchange), case["row_index"],
                                        case["temperature"], case["drafts"], case["lens"], case["seeds"],
                                        case["offsets"], draft, top_k=case["top_k"], top_p=case["top_p"],
                                        min_p=case["min_p"])

    return {"tp4": run(4, rank, AllGatherKeyExchange(None)), "tp2": run(2, rank % 2, AllGatherKeyExchange(pair))}
