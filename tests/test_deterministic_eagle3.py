"""Deterministic mode with the EAGLE-3 head: the head's draft logits of a request are
bit-identical alone (prefilled at once or one token a step), beside neighbours, in a slot a
longer request used and at TP 1/2/4, and a head built without the mode differs (so the head's
own flag does the work, not only the target's); through the runtime, EAGLE-3 speculation keeps
a greedy request's tokens and logprobs equal to those without speculation, alone and batched,
at TP 1 and 2; the mode's checks apply to the head before any worker starts."""

from __future__ import annotations

import pytest
import torch

from model_helpers import allocate_slots, make_batch
from test_deterministic import GEN, GREEDY, NEIGHBOURS, X, _check_runtime, _runtime_outputs
from tpspec.model import load_model
from tpspec.model.eagle3 import Eagle3Drafter
from tpspec.runtime.llm import tiny_model_path
from tpspec.testing import run_ranks

SEQ = X + GEN  # the request's tokens: the head drafts after every one of them
CHAINED = [51, 387]  # tokens fed to the chained steps after SEQ (fixed: logits are compared, not picked)
EAGLE3 = {"method": "eagle3", "model": "tiny", "num_speculative_tokens": 3, "acceptance": "rejection"}


def _step(target, head, seqs: list[tuple[int, list[int], int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One target forward and one head forward of ``seqs`` (slot, full tokens, start, end): the
    target reads ``full[start:end]``, the head pairs its hidden states at each of those positions
    with the next token (``full[start + 1 : end + 1]``). Returns each sequence's gathered head
    logits ``[end - start, vocab]`` and layer outputs ``[end - start, H]``."""
    target(make_batch([(s, a, full[a:b]) for s, full, a, b in seqs]))
    logits, out = head(make_batch([(s, a, full[a + 1 : b + 1]) for s, full, a, b in seqs],
                                  list(range(sum(b - a for _, _, a, b in seqs)))), target.aux_hidden_states)
    rows, at = [], 0
    full_logits = logits.gather()
    for _, _, a, b in seqs:
        rows.append((full_logits[at : at + b - a], out[at : at + b - a]))
        at += b - a
    return rows


def _chain(head, seqs: list[tuple[int, int, list[int], torch.Tensor]]) -> list[torch.Tensor]:
    """Chained head steps of ``seqs`` (slot, first position, tokens, ``[1, H]`` last layer output),
    one token each a step; returns the gathered logits ``[steps, vocab]`` of the last sequence."""
    rows = []
    hidden = torch.cat([h for _, _, _, h in seqs])
    for j in range(len(seqs[-1][2])):
        logits, hidden = head(make_batch([(s, p + j, [t[j]]) for s, p, t, _ in seqs]), hidden)
        rows.append(logits.gather()[-1])
    return torch.stack(rows)


END = len(SEQ) - 1  # the head reads positions 0 .. END - 1 (each with a known next token)


def scenario_alone(target, head) -> torch.Tensor:
    """SEQ prefilled at once, then chained."""
    [(logits, out)] = _step(target, head, [(0, SEQ, 0, END)])
    return torch.cat((logits, _chain(head, [(0, END, CHAINED, out[-1:])])))


def scenario_stepwise(target, head) -> torch.Tensor:
    """SEQ one token a forward through the target and the head, then chained."""
    rows = []
    for i in range(END):
        [(logits, out)] = _step(target, head, [(0, SEQ, i, i + 1)])
        rows.append(logits)
    return torch.cat(rows + [_chain(head, [(0, END, CHAINED, out[-1:])])])


def scenario_batched(target, head) -> torch.Tensor:
    """SEQ prefilled in chunks of 4, 2 and 5 beside neighbours (other positions, prefills and a
    decode), then chained beside a neighbour's chained steps (placed first)."""
    n0, n1, n2 = NEIGHBOURS[0], NEIGHBOURS[3], NEIGHBOURS[2]
    first = _step(target, head, [(1, n0, 0, len(n0) - 1), (0, SEQ, 0, 4)])
    second = _step(target, head, [(0, SEQ, 4, 6), (2, n1, 0, 6), (1, n0 + [5], len(n0) - 1, len(n0))])
    third = _step(target, head, [(3, n2, 0, 10), (0, SEQ, 6, END)])
    chained = _chain(head, [(3, 10, n2[11:13], third[0][1][-1:]), (0, END, CHAINED, third[1][1][-1:])])
    return torch.cat((first[1][0], second[0][0], third[1][0], chained))


def scenario_reused_slot(target, head) -> torch.Tensor:
    """Slot 0 first holds a longer request (its stale K/V beyond SEQ's length stay in the target's
    and the head's pages), then SEQ takes slot 0 in one prefill beside a decoding neighbour."""
    longer = NEIGHBOURS[2] + NEIGHBOURS[0]
    _step(target, head, [(0, longer, 0, len(longer) - 1), (1, NEIGHBOURS[1], 0, 1)])
    [_, (logits, out)] = _step(target, head, [(1, NEIGHBOURS[1] + [7], 1, 2), (0, SEQ, 0, END)])
    return torch.cat((logits, _chain(head, [(0, END, CHAINED, out[-1:])])))


SCENARIOS = ("alone", "stepwise", "batched", "reused_slot")


def _head_scenarios(rank: int, world: int, head_modes: tuple[bool, ...]) -> dict | None:
    """Every scenario's head logits at TP = ``world``, a deterministic target, the head in each of
    ``head_modes`` (collective: every rank runs it)."""
    from tpspec.mapping import Mapping

    target = load_model(tiny_model_path(), Mapping(world, rank, world), deterministic=True)
    out = {}
    for mode in head_modes:
        head = Eagle3Drafter(tiny_model_path("eagle3"), target, deterministic=mode)
        res = {}
        for name in SCENARIOS:
            allocate_slots(target)
            allocate_slots(head)
            res[name] = globals()[f"scenario_{name}"](target, head)
        out[mode] = res
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def head_tp1() -> dict[bool, dict[str, torch.Tensor]]:
    return _head_scenarios(0, 1, (True, False))


def test_head_logits_equal_alone_stepwise_and_batched(head_tp1):
    res = head_tp1[True]
    ref = res["alone"]
    assert ref.shape[0] == END + len(CHAINED) and torch.isfinite(ref).any(dim=1).all()
    assert [name for name in SCENARIOS if not torch.equal(res[name], ref)] == []


def test_head_without_the_mode_differs(head_tp1):
    """A head built without the mode (the target still deterministic) changes some logit bits in
    some scenario, so the test above is not trivially true; both compute the same function."""
    default = head_tp1[False]
    assert any(not torch.equal(default[name], default["alone"]) for name in SCENARIOS)
    finite = torch.isfinite(head_tp1[True]["alone"])
    assert torch.equal(finite, torch.isfinite(default["alone"]))
    torch.testing.assert_close(head_tp1[True]["alone"][finite], default["alone"][finite], rtol=1e-4, atol=1e-4)


def test_head_tp2_equals_tp1(head_tp1):
    res = run_ranks(_head_scenarios, 2, (True,))[0][True]
    for name in SCENARIOS:
        assert torch.equal(res[name], head_tp1[True]["alone"]), name


@pytest.mark.slow
def test_head_tp4_equals_tp1(head_tp1):
    res = run_ranks(_head_scenarios, 4, (True,))[0][True]
    for name in SCENARIOS:
        assert torch.equal(res[name], head_tp1[True]["alone"]), name


# --- through the runtime ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def eagle3_tp1() -> dict[str, tuple[list[int], list]]:
    return _runtime_outputs(1, EAGLE3)


def test_runtime_eagle3_alone_equals_batched(eagle3_tp1):
    """TP 1, EAGLE-3 drafts with rejection acceptance: X alone and beside neighbours in reused
    slots gives the same tokens and logprobs, greedy and seeded."""
    tokens, logprobs = eagle3_tp1["greedy alone"]
    assert len(tokens) == GREEDY["max_tokens"] and len(logprobs) == len(tokens)
    _check_runtime(eagle3_tp1, eagle3_tp1["greedy alone"], None)


@pytest.mark.slow
def test_runtime_eagle3_keeps_greedy_logprobs(eagle3_tp1):
    """With EAGLE-3 speculation a greedy request gets the tokens and logprobs it gets without."""
    assert eagle3_tp1["greedy alone"] == _runtime_outputs(1, None)["greedy alone"]


@pytest.mark.slow
def test_runtime_eagle3_tp2_equals_tp1(eagle3_tp1):
    """TP 2 with EAGLE-3: the TP 1 greedy and seeded tokens and logprobs, alone and batched."""
    _check_runtime(_runtime_outputs(2, EAGLE3), eagle3_tp1["greedy alone"], eagle3_tp1["seeded alone"])


def test_head_split_checks(tmp_path):
    """The mode's checks cover the head (attention DP refused, the tiny head fits TP 1/2/4), and
    the LLM checks the head's split before any worker starts: a head whose intermediate size does
    not divide over the ranks is refused with a ValueError naming the head and the field."""
    import json
    import shutil

    from tpspec import LLM
    from tpspec.mapping import Mapping
    from tpspec.model import ModelConfig
    from tpspec.model.eagle3 import Eagle3Config

    target_cfg = ModelConfig.from_pretrained(tiny_model_path())
    head_cfg = Eagle3Config.from_pretrained(tiny_model_path("eagle3"), target_cfg)
    for tp in (1, 2, 4):
        for rank in range(tp):
            head_cfg.check_split(Mapping(tp, rank, tp), deterministic=True)
    head_cfg.check_split(Mapping(2, 0, 2, True))
    with pytest.raises(ValueError, match="attention DP"):
        head_cfg.check_split(Mapping(2, 0, 2, True), deterministic=True)

    head = tmp_path / "head"
    shutil.copytree(tiny_model_path("eagle3"), head)
    cfg = json.loads((head / "config.json").read_text())
    cfg["intermediate_size"] = 6
    (head / "config.json").write_text(json.dumps(cfg))
    spec = dict(EAGLE3, model=str(head))
    for deterministic in (True, False):
        with pytest.raises(ValueError, match=r"head.*tensor_parallel_size=4.*intermediate_size=6"):
            LLM("tiny", tensor_parallel_size=4, speculative_config=spec, deterministic=deterministic)


def test_engine_builds_a_deterministic_head():
    """The engine hands the mode to the head (in process: the engine is inspectable)."""
    from tpspec import LLM

    with LLM("tiny", distributed_executor_backend="external_launcher", speculative_config=EAGLE3,
             deterministic=True, max_num_seqs=2, max_model_len=64) as llm:
        head = llm._executor.ctx.state["engine"].eagle3  # noqa: SLF001
        assert head.deterministic and head.attention.name == "deterministic"
        assert head.fc.fixed_order is not None and head.lm_head.fixed_order is not None
