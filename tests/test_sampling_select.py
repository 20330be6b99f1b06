"""Token selection on vocab shards (``tpspec.sampling.select_tokens``) and a full
``SpecWorker`` step at TP = 1: which path each batch takes, greedy semantics, and the
same token for a row drawn on shards or on gathered logits. ``tp_worker`` is also run
on 2 and 4 gloo ranks by ``test_spec_ranks.py`` (one spawn for all multi-rank checks)."""

import dataclasses

import pytest
import torch

from model_helpers import sharded
from tpspec import SamplingParams, VocabShardedLogits
from tpspec.exchange import AllGatherKeyExchange
from tpspec.sampling import select_tokens
from tpspec.speculative import SpecMetadata, SpecWorker, select_draft_tokens

VOCAB = 1001  # uneven: the last shard is padded at TP = 2, 4
D = 3
COMMON = [  # requests shared by the temperature-only and the mixed batch (same ids, slots, order)
    ("g0", 0, None, True),
    ("s1", 1, SamplingParams(temperature=0.8, seed=7), False),
    ("u2", 2, SamplingParams(temperature=1.3), False),
    ("s3", 3, SamplingParams(temperature=0.5, seed=2**63 + 5), True),
    ("g4", 4, SamplingParams(temperature=0.0, seed=1), False),
]
BATCHES = {
    "greedy": [("a", 0, None, True), ("b", 1, None, False), ("c", 2, SamplingParams(temperature=0.9, top_k=1), False)],
    "temperature": COMMON,
    "mixed": COMMON + [
        ("k5", 5, SamplingParams(temperature=1.0, top_k=30, seed=11), False),
        ("p6", 6, SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02), True),
    ],
}


def logits_for(name: str, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(rows, VOCAB, generator=gen) * 2.5
    x[:, 997] = x[:, 3]  # a tie across shards at TP = 2 and 4
    return x




def tp_worker(rank: int, world: int, group=None) -> dict:
    ex = AllGatherKeyExchange(group)
    out: dict = {}
    for name, requests in BATCHES.items():
        meta = SpecMetadata(8, D).prepare(requests, draft_len=D)
        full = logits_for(name, meta.num_rows)
        logits = sharded(full, world, rank, ex)
        out[name] = {
            "flags": (meta.is_all_greedy, meta.temperature_only),
            "tokens": select_tokens(logits, meta),
            "argmax": full.argmax(dim=1),
            "row_index": meta.request_row_index.clone(),
        }
        # A whole worker step in both acceptance modes, drafts half right.
        gen = torch.Generator().manual_seed(5)
        drafts = torch.randint(0, VOCAB, (meta.num_requests, D), generator=gen)
        drafts[:, 0] = out[name]["tokens"][meta.request_row_index[:, 0]]
        for mode in ("strict", "rejection"):
            step_meta = SpecMetadata(8, D).prepare(requests, draft_len=D)
            res = SpecWorker(mode, forced=None).step(logits, drafts, step_meta)
            out[name][mode] = (res.accepted_tokens, res.num_accepted, res.next_input_tokens)
        # Sampled drafting on a sharded draft head (D draft steps, each from its own
        # stream), then rejection against the target with those draft distributions.
        draft_meta = SpecMetadata(8, D).prepare(requests, draft_len=D)
        picks = [select_draft_tokens(sharded(logits_for(f"{name}-draft{j}", meta.num_requests), world, rank, ex),
                                     draft_meta, j, sample=True) for j in range(D)]
        sampled_drafts = torch.stack([p.tokens for p in picks], dim=1)
        # Each rank's own columns of the draft logits (temperature-only batches; else greedy drafts).
        q = torch.stack([p.logits for p in picks], dim=1) if picks[0].logits is not None else None
        res = SpecWorker("rejection", forced=None).step(logits, sampled_drafts, draft_meta, draft_logits=q)
        out[name]["sampled_drafts"] = (sampled_drafts, q is None, res.accepted_tokens, res.num_accepted)
    return out


def check_against(reference: dict, results: list[dict]) -> None:
    for rank_result in results:
        for name in BATCHES:
            for key in ("flags", "tokens", "strict", "rejection", "sampled_drafts"):
                got, want = rank_result[name][key], reference[name][key]
                if isinstance(want, tuple):
                    assert len(got) == len(want), (name, key)
                    assert all(torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w for g, w in zip(got, want)), (name, key)
                else:
                    assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, (name, key)


@pytest.fixture(scope="module")
def tp1() -> dict:
    return tp_worker(0, 1)  # no process group: the exchange spans one rank


def test_tp1_paths_and_semantics(tp1):
    assert tp1["greedy"]["flags"] == (True, True)
    assert tp1["temperature"]["flags"] == (False, True)
    assert tp1["mixed"]["flags"] == (False, False)  # falls back to the gathered logits
    assert torch.equal(tp1["greedy"]["tokens"], tp1["greedy"]["argmax"])
    # Greedy requests of sampled batches take the argmax.
    for name in ("temperature", "mixed"):
        rows = tp1[name]["row_index"][[0, 4]].unique()
        assert torch.equal(tp1[name]["tokens"][rows], tp1[name]["argmax"][rows])
    # A row drawn on the shards (temperature-only path) and on the gathered logits (forced
    # fallback) gets the same token from the same stream.
    meta = SpecMetadata(8, D).prepare(BATCHES["temperature"], draft_len=D)
    full = logits_for("temperature", meta.num_rows)
    rs = meta.row_sampling()
    # A neutral filter (min_p = 0) sends the rows to the gathered path.
    fallback = dataclasses.replace(rs, min_p=torch.zeros(rs.num_rows))
    on_full = select_tokens(VocabShardedLogits(full, 0, VOCAB, AllGatherKeyExchange()), fallback)
    assert torch.equal(on_full, tp1["temperature"]["tokens"])


def test_row_count_mismatch_raises():
    meta = SpecMetadata(4, 1).prepare([("a", 0, None, True)], draft_len=1)
    logits = VocabShardedLogits(torch.zeros(3, 10), 0, 10, AllGatherKeyExchange())
    with pytest.raises(ValueError, match="rows"):
        select_tokens(logits, meta)
    with pytest.raises(ValueError, match="SpecMetadata"):
        select_tokens(logits, object())


def test_undecided_rows_of_a_deferred_draw_hold_column_zero():
    """The draw without a host sync (what a CUDA graph captures): a flat top-p row outgrows 64
    candidates and is undecided; its token is column 0, a valid id (a graph of chained draft steps
    feeds it to the next step's embedding before the host reads ``decided``). Decided rows equal
    the full draw."""
    from tpspec.keys import SamplingRows
    from tpspec.sampling.select import FilterPlan, draw_filtered, sample_filtered

    logits = torch.zeros(3, 4096)
    logits[1] = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4  # peaked: decided
    logits[2, 17] = 50.0  # one column holds the mass: decided
    rows = SamplingRows(torch.ones(3), torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.int64),
                        top_p=torch.tensor([0.99, 0.5, 0.9]))
    sharded_logits = VocabShardedLogits(logits, 0, 4096, AllGatherKeyExchange())
    tokens, decided = draw_filtered(sharded_logits, rows, FilterPlan(candidates=64))
    assert decided.tolist() == [False, True, True] and int(tokens[0]) == 0
    full = sample_filtered(sharded_logits, rows)
    assert tokens[1:].tolist() == full[1:].tolist() and int(tokens[2]) == 17
