"""The model at TP = 2 and 4 (gloo, CPU): same greedy tokens as TP = 1, logits within fp32
tolerance, attention DP (replicated head and LM-head TP) equal to plain TP, sliced loading.

One spawn per TP size runs every check (spawns are the expensive part)."""

from __future__ import annotations

import pytest
import torch

from model_helpers import (allocate_slots, greedy_generate, make_batch, mixed_reference, mixed_scenario,
                           speculative_greedy)
from tpspec import distributed as D
from tpspec.mapping import Mapping
from tpspec.model.comm import VarlenRows
from tpspec.model import DraftModel, NgramDrafter, load_model, make_tiny_checkpoint
from tpspec.testing import run_ranks

PROMPTS = [[1, 5, 17, 300, 42, 3], [1, 8, 9, 10, 8, 9, 10, 8], [1, 250, 251], [1, 77, 66, 55, 44, 33, 22, 11, 0, 1]]
STEPS = 10
SPEC_PROMPT = [1, 8, 9, 10, 8, 9, 10, 8]
SAMPLE_SEEDS = [1000 + i for i in range(len(PROMPTS))]


def _sampled_prefill(model, prompts, indices):
    """Prefill ``prompts``; return their last rows' full logits and Gumbel samples drawn with
    per-prompt seeds (keyed by the global prompt index)."""
    logits = model(make_batch([(10 + i, 0, p) for i, p in zip(indices, prompts)]))
    seeds = torch.tensor([SAMPLE_SEEDS[i] for i in indices], dtype=torch.int64)
    tokens = logits.sample(torch.full((len(indices),), 0.8), seeds, torch.zeros_like(seeds)).tolist()
    return logits.gather(), tokens


VARLEN_COUNTS = [2, 0, 3, 1]


def _varlen_checks(rank: int, world: int) -> list:
    """Stack/unstack rows of uneven counts (one rank holds none), through both reduce-scatter paths."""
    counts = VARLEN_COUNTS[:world]
    rows = VarlenRows(counts, D.tp_group(), torch.device("cpu"))
    mine = torch.arange(counts[rank] * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    results = [rows.gather(mine)]
    partial = (rank + 1) * torch.arange(sum(counts) * 2, dtype=torch.float32).view(-1, 2)
    for nccl_path in (False, True):  # gloo on CPU can also run the padded reduce_scatter_tensor path
        rows.nccl = nccl_path
        results.append(rows.reduce_scatter(partial))
    return results


def run_checks(rank: int, world: int, target: str, draft: str) -> dict:
    """Everything one rank does; rank-local results go back to the test for comparison."""
    out: dict = {"varlen": _varlen_checks(rank, world)}
    plain = load_model(target, Mapping(world, rank))
    out["load"] = (plain.load_stats.bytes_read, plain.load_stats.checkpoint_bytes)
    allocate_slots(plain, 16)
    out["greedy"] = greedy_generate(plain, PROMPTS, STEPS)
    out["prompt_logits"] = plain(make_batch([(8, 0, PROMPTS[3])], list(range(len(PROMPTS[3]))))).gather()
    out["mixed"] = mixed_scenario(plain, slots=(0, 1, 2))
    out["spec"] = speculative_greedy(plain, SPEC_PROMPT, STEPS, NgramDrafter(3).propose, slot=5)[0]
    out["sampled"] = _sampled_prefill(plain, PROMPTS, range(len(PROMPTS)))
    dm = DraftModel(draft, Mapping(world, rank), exchange=plain.exchange, target_config=plain.config)
    allocate_slots(dm, 4)
    out["draft"] = greedy_generate(dm, PROMPTS[:2], STEPS)

    # Attention DP: rank r owns prompts r, r + world, ... (uneven counts and lengths; at TP=4 with
    # 4 prompts every rank has one, so rank world-1 also runs empty batches below).
    mine = list(range(rank, len(PROMPTS), world))
    for lm_head_tp in (False, True):
        adp = load_model(target, Mapping(world, rank, enable_attention_dp=True, enable_lm_head_tp_in_adp=lm_head_tp))
        allocate_slots(adp, 16)
        out[f"adp{lm_head_tp}"] = greedy_generate(adp, [PROMPTS[i] for i in mine], STEPS)
        out[f"adp{lm_head_tp}_sampled"] = _sampled_prefill(adp, [PROMPTS[i] for i in mine], mine)
        # A step where only rank 0 has work: the others pass empty batches and still join the collectives.
        only0 = [PROMPTS[0]] if rank == 0 else []
        out[f"adp{lm_head_tp}_only0"] = greedy_generate(adp, only0, 3, slots=[0] if rank == 0 else [])
    # A bad batch on the last rank only (slot out of range): every rank raises, none waits.
    bad = make_batch([(99 if rank == world - 1 else 0, 0, [1, 2])])
    try:
        adp(bad)
        out["adp_bad_batch"] = "no error"
    except (ValueError, RuntimeError) as exc:
        out["adp_bad_batch"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_tp")
    target = make_tiny_checkpoint(root / "target", seed=7, tokenizer=False)
    draft = make_tiny_checkpoint(root / "draft", seed=7, draft=True, tokenizer=False)
    return target, draft


@pytest.fixture(scope="module")
def reference(tiny):
    """The same checks at TP = 1 in this process."""
    model = load_model(tiny[0])
    allocate_slots(model, 16)
    dm = DraftModel(tiny[1], target_config=model.config)
    allocate_slots(dm, 4)
    return {
        "greedy": greedy_generate(model, PROMPTS, STEPS),
        "prompt_logits": model(make_batch([(8, 0, PROMPTS[3])], list(range(len(PROMPTS[3]))))).gather(),
        "mixed": mixed_reference(model, slot=3),
        "spec": greedy_generate(model, [SPEC_PROMPT], STEPS, slots=[5])[0],
        "sampled": _sampled_prefill(model, PROMPTS, range(len(PROMPTS))),
        "draft": greedy_generate(dm, PROMPTS[:2], STEPS),
        "only0": greedy_generate(model, [PROMPTS[0]], 3, slots=[0])[0],
        "plain_model": model,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_tp1(tiny, reference, world):
    results = run_ranks(run_checks, world, *tiny, timeout_s=240)
    ref = reference
    counts = VARLEN_COUNTS[:world]
    stacked = torch.cat([torch.arange(c * 2, dtype=torch.float32).view(-1, 2) + 100 * r for r, c in enumerate(counts)])
    summed = sum(r + 1 for r in range(world)) * torch.arange(sum(counts) * 2, dtype=torch.float32).view(-1, 2)
    for rank, out in enumerate(results):
        gathered, *scattered = out["varlen"]
        assert torch.equal(gathered, stacked)
        start = sum(counts[:rank])
        for got in scattered:
            assert torch.equal(got, summed[start : start + counts[rank]])
        assert out["greedy"] == ref["greedy"], rank
        torch.testing.assert_close(out["prompt_logits"], ref["prompt_logits"], atol=1e-4, rtol=1e-4)
        assert len(out["mixed"]) == len(ref["mixed"]) > 0
        for got, want in zip(out["mixed"], ref["mixed"]):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert out["spec"] == ref["spec"]
        torch.testing.assert_close(out["sampled"][0], ref["sampled"][0], atol=1e-4, rtol=1e-4)
        assert out["sampled"][1] == ref["sampled"][1]  # same seeds -> same Gumbel draws at every TP size
        assert out["draft"] == ref["draft"]
        mine = list(range(rank, len(PROMPTS), world))
        for lm_head_tp in (False, True):
            assert out[f"adp{lm_head_tp}"] == [ref["greedy"][i] for i in mine], (rank, lm_head_tp)
            logits, tokens = out[f"adp{lm_head_tp}_sampled"]
            torch.testing.assert_close(logits, ref["sampled"][0][mine], atol=1e-4, rtol=1e-4)
            assert tokens == [ref["sampled"][1][i] for i in mine], (rank, lm_head_tp)
            assert out[f"adp{lm_head_tp}_only0"] == ([ref["only0"]] if rank == 0 else []), (rank, lm_head_tp)
        want_bad = ("ValueError: sequence 0: page ids must lie in" if rank == world - 1 else
                    f"RuntimeError: the forward batch of rank(s) [{world - 1}] of the attention-DP group is invalid")
        assert out["adp_bad_batch"].startswith(want_bad), (rank, out["adp_bad_batch"])

    # Sliced loading: each rank reads about 1/world of the checkpoint (norms are replicated, and at
    # TP=4 each of the 2 KV heads is read by 2 ranks), and the ranks together read it about once.
    per_rank = [out["load"][0] for out in results]
    total = results[0]["load"][1]
    assert all(b < 1.1 * total / world for b in per_rank), (per_rank, total)
    assert total <= sum(per_rank) < 1.2 * total


def test_attention_never_uses_cudnn_sdpa(tiny, monkeypatch):
    """cuDNN attention builds a plan per new shape, and eager decode changes shape every step
    (on an H200 each eager attention call took ~20 ms). The model must call SDPA with the
    cuDNN backend disabled, in eager steps and graphs alike."""
    import torch.nn.functional as F

    from tests.model_helpers import allocate_slots, greedy_generate

    seen = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = load_model(tiny[0])
    allocate_slots(model, 2)
    greedy_generate(model, [[1, 2, 3], [4, 5]], steps=3)
    assert seen and not any(seen), f"cuDNN SDPA enabled in {sum(seen)} of {len(seen)} attention calls"
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process-wide setting is left alone
