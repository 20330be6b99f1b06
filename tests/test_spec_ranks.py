"""All multi-rank checks of sampling and speculative decoding, in ONE spawn of 4 gloo
ranks (each spawn costs seconds on CI's 2 cores):

* sharded selection and ``SpecWorker`` steps at TP = 4 (world group) and TP = 2 (two
  pair groups) give the tokens of TP = 1, on every rank;
* top-k / top-p / min-p draws and logprobs at TP = 2, 3 (odd split) and 4 equal the
  full-row reference and TP = 1 (``test_sampling_sharded.filters_worker``);
* all-greedy sync under attention DP: one greedy and one sampling rank of a pair take the
  same path (the one that runs the same collectives), and unseeded streams of the two
  ranks are disjoint; a bad batch on one rank makes both raise (no hang), advancing nothing;
* forced acceptance (``TPSPEC_FORCE_NUM_ACCEPTED_TOKENS``) gives the same counts on every
  rank, equal to the pool formula, and eager warm-up steps neither force nor advance it.
"""

import pytest
import torch
import torch.distributed as dist

from tpspec import Mapping, SamplingParams, VocabShardedLogits
from tpspec.exchange import AllGatherKeyExchange
from tpspec.sampling import select_tokens
from tpspec.speculative import ForcedAcceptance, SpecMetadata, SpecWorker
from tpspec.testing import run_ranks

from test_sampling_select import check_against, logits_for, sharded, tp_worker
from test_sampling_sharded import check_filters_against_reference, filters_worker

FORCED_RATE = 1.5
FORCED_STEPS = 30
ADP_D = 2


class SpyLogits(VocabShardedLogits):
    """Records which selection primitive ran (each one is a different collective)."""

    calls: list

    def argmax(self, **kw):
        self.calls.append("argmax")
        return super().argmax(**kw)

    def sample(self, *a, **kw):
        self.calls.append("sample")
        return super().sample(*a, **kw)

    def gather(self):
        self.calls.append("gather")
        return super().gather()


def adp_check(rank: int, pair) -> dict:
    tp_rank = rank % 2
    mapping = Mapping(2, tp_rank, enable_attention_dp=True)
    meta = SpecMetadata(4, ADP_D, mapping=mapping, group=pair)
    if tp_rank == 0:  # a greedy rank
        requests = [("a", 0, None, False), ("u", 1, SamplingParams(temperature=0.0), True)]
    else:  # a sampling rank that needs the full logits
        requests = [("x", 0, SamplingParams(temperature=1.0, top_k=5, seed=3), False), ("u", 1, None, True)]
    meta.prepare(requests, draft_len=ADP_D)
    out = {"local": (meta.local_is_all_greedy, meta.local_temperature_only), "synced": (meta.is_all_greedy, meta.temperature_only)}
    # The rows are split over the pair's vocab like an LM-head-TP head: a path mismatch
    # would pair an all-gather of keys with an all-gather of logits and fail.
    full = logits_for("adp", meta.num_rows)
    offset_logits = sharded(full, 2, tp_rank, AllGatherKeyExchange(pair))
    spy = SpyLogits(offset_logits.local, offset_logits.vocab_offset, offset_logits.vocab_size, offset_logits.exchange)
    spy.calls = []
    tokens = select_tokens(spy, meta)
    drafts = torch.zeros(2, ADP_D, dtype=torch.int64)
    SpecWorker("rejection", forced=None).step(spy, drafts, meta)
    out.update(calls=list(spy.calls), tokens=tokens, argmax=full.argmax(dim=1))
    # Unseeded streams of the two ranks never overlap.
    meta.prepare([("n", 2, SamplingParams(temperature=1.0), True)], draft_len=ADP_D)
    out["unseeded_stream"] = int(meta.request_seeds[0])
    # A bad batch on one rank of the pair: every rank raises (no rank is left in the
    # flag all-reduce), no stream is numbered, and the next good step works on both.
    bad_slot = 99 if tp_rank == 1 else 2
    try:
        meta.prepare([("m", bad_slot, SamplingParams(temperature=1.0), True)], draft_len=ADP_D)
        out["bad_step"] = "no error"
    except (ValueError, RuntimeError) as exc:
        out["bad_step"] = f"{type(exc).__name__}: {exc}"
    meta.prepare([("k", 2, SamplingParams(temperature=1.0), True)], draft_len=ADP_D)
    out["streams_around_bad_step"] = [out["unseeded_stream"], int(meta.request_seeds[0])]
    return out


def forced_check(rank: int, world: int) -> dict:
    meta = SpecMetadata(8, 3)
    requests = [("c", 7, None, True)] + [(f"g{i}", i, SamplingParams(temperature=0.7, seed=i), False) for i in range(6)]
    worker = SpecWorker("strict")  # reads TPSPEC_FORCE_NUM_ACCEPTED_TOKENS
    ex = AllGatherKeyExchange()
    nums = []
    for step in range(FORCED_STEPS + 1):
        meta.prepare(requests, draft_len=3)
        logits = sharded(logits_for(f"forced{step}", meta.num_rows), world, rank, ex)
        drafts = torch.full((7, 3), 5, dtype=torch.int64)
        out = worker.step(logits, drafts, meta, is_warmup=(step == 0))
        nums.append(out.num_accepted)
    return {"nums": torch.stack(nums), "counter": int(worker.forced_acceptance(torch.device("cpu")).counter)}


def rank_main(rank: int, world: int) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    triple = dist.new_group([0, 1, 2])
    pair = pairs[rank // 2]
    return {
        "tp4": tp_worker(rank, world),
        "tp2": tp_worker(rank % 2, 2, group=pair),
        "filters4": filters_worker(rank, world),
        "filters2": filters_worker(rank % 2, 2, group=pair),
        "filters3": filters_worker(rank, 3, group=triple) if rank < 3 else None,
        "adp": adp_check(rank, pair),
        "forced": forced_check(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(rank_main, 4, env={"TPSPEC_FORCE_NUM_ACCEPTED_TOKENS": str(FORCED_RATE)}, timeout_s=300)


def test_tp2_and_tp4_match_tp1_on_every_rank(results):
    reference = tp_worker(0, 1)
    check_against(reference, [r["tp4"] for r in results])
    check_against(reference, [r["tp2"] for r in results])


def test_filters_and_logprobs_at_tp2_tp3_tp4_equal_the_full_row_reference(results):
    for key in ("filters2", "filters3", "filters4"):
        check_filters_against_reference([r[key] for r in results if r[key] is not None])


def test_all_greedy_sync_under_attention_dp(results):
    for pair in ((0, 1), (2, 3)):
        greedy, sampling = (results[i]["adp"] for i in pair)
        assert greedy["local"] == (True, True) and sampling["local"] == (False, False)
        assert greedy["synced"] == sampling["synced"] == (False, False)
        assert greedy["calls"] == sampling["calls"] == ["gather", "gather"]
        # The greedy rank's rows still get the argmax through the full-logit path.
        assert torch.equal(greedy["tokens"], greedy["argmax"])
        # The same request id on the two ranks: streams in disjoint ranges (the partition bits).
        assert (greedy["unseeded_stream"] ^ sampling["unseeded_stream"]) >> 55 != 0
        assert greedy["bad_step"].startswith("RuntimeError: SpecMetadata.prepare failed on another rank")
        assert sampling["bad_step"].startswith("ValueError: slot_id=99")
        for r in (greedy, sampling):
            first, after = r["streams_around_bad_step"]
            assert after == first + 1  # the failed step numbered no stream


def test_forced_acceptance_identical_on_every_rank(results):
    nums = [r["forced"]["nums"] for r in results]
    assert all(torch.equal(n, nums[0]) for n in nums)
    assert all(r["forced"]["counter"] == FORCED_STEPS for r in results)  # warm-up did not advance it
    fa = ForcedAcceptance(FORCED_RATE)
    slots, lens = torch.tensor([7, 0, 1, 2, 3, 4, 5]), torch.tensor([0, 3, 3, 3, 3, 3, 3])
    want = torch.stack([fa.num_drafts_accepted(slots, lens) + 1 for _ in range(FORCED_STEPS)])
    assert torch.equal(nums[0][1:], want)
    assert set(nums[0][1:, 1:].unique().tolist()) == {2, 3}  # 1 or 2 drafts (rate 1.5), + the target token
