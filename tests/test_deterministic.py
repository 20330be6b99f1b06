"""Deterministic mode: a request's logits are bit-identical alone, in any batch, verified with
drafts or decoded one at a time, and at TP 1/2/4/8; the default mode differs (so the mode does
the work). Plus the fixed-order primitives and the clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from model_helpers import allocate_slots, make_batch
from tpspec.model import DraftModel, NgramDrafter, load_model
from tpspec.model import deterministic as det
from tpspec.runtime.llm import tiny_model_path
from tpspec.testing import run_ranks

X = [21, 22, 23, 24, 25, 26, 27]  # the request whose logits every scenario compares
GEN = [51, 387, 487, 12, 99]  # the tokens it goes on with (fixed: logits are compared, not picked)
NEIGHBOURS = [[5, 9, 200, 31, 7, 7, 64, 120, 300, 2, 45], [400, 401], [17] * 19, [3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _model(deterministic: bool, path: str | None = None):
    model = load_model(path or tiny_model_path(), deterministic=deterministic)
    allocate_slots(model)
    return model


def _alone(model) -> torch.Tensor:
    """X prefilled alone in a fresh slot, then GEN decoded one token per forward:
    ``[1 + len(GEN), vocab]`` full logits (the prompt's last row, then one per GEN token)."""
    rows = [model(make_batch([(0, 0, X)])).gather()[0]]
    for i, t in enumerate(GEN):
        rows.append(model(make_batch([(0, len(X) + i, [t])])).gather()[0])
    return torch.stack(rows)


def _prefill_neighbours(model, slots) -> list[int]:
    """Prefill the neighbours (one batch); returns their cache lengths."""
    model(make_batch([(s, 0, n) for s, n in zip(slots, NEIGHBOURS)]))
    return [len(n) for n in NEIGHBOURS[: len(slots)]]


def scenario_positions(model) -> torch.Tensor:
    """X last in a batch of prefills, then decoded first of a batch of decodes."""
    seqs = [(1, 0, NEIGHBOURS[0]), (2, 0, NEIGHBOURS[1]), (3, 0, X)]
    out = [model(make_batch(seqs)).gather()[2]]
    lens = [len(NEIGHBOURS[0]), len(NEIGHBOURS[1])]
    for i, t in enumerate(GEN):
        step = [(3, len(X) + i, [t]), (1, lens[0] + i, [8]), (2, lens[1] + i, [9])]
        out.append(model(make_batch(step)).gather()[0])
    return torch.stack(out)


def scenario_twins(model) -> torch.Tensor:
    """X and its twin prefilled and verified in one batch (two slots): both copies must be equal."""
    seq = X + GEN
    rows = list(range(len(X) - 1, len(seq)))
    twin = model(make_batch([(4, 0, seq), (5, 0, seq)], rows + [len(seq) + r for r in rows])).gather()
    first, second = twin[: len(rows)], twin[len(rows) :]
    assert torch.equal(first, second)
    return first


def scenario_late_admission(model) -> torch.Tensor:
    """Slot 0 first holds a longer request (stale K/V beyond X's length stays there), then X
    takes slot 0 while neighbours are mid-decode; X's steps carry 1 + 2 drafts."""
    model(make_batch([(0, 0, NEIGHBOURS[2] + NEIGHBOURS[0])]))
    lens = _prefill_neighbours(model, [1, 2])
    out = [model(make_batch([(1, lens[0], [5]), (0, 0, X), (2, lens[1], [6])])).gather()[1]]
    seq = GEN
    for start in range(0, len(seq), 3):
        piece = seq[start : start + 3]
        batch = [(2, lens[1] + 1 + start, [7]), (0, len(X) + start, piece)]
        rows = [1 + r for r in range(len(piece))]
        out.extend(model(make_batch(batch, rows)).gather())
    return torch.stack(out)[: 1 + len(GEN)]


def scenario_chunked_prefill(model) -> torch.Tensor:
    """X's prompt in chunks of 3, 2, 2 beside other requests' decodes, then one verification of all of GEN."""
    lens = _prefill_neighbours(model, [1, 2, 3])
    done = 0
    out = None
    for i, chunk in enumerate((X[:3], X[3:5], X[5:])):
        batch = [(1, lens[0] + i, [4]), (5, done, chunk), (3, lens[2] + i, [4])]
        logits = model(make_batch(batch, [1 + len(chunk) - 1])).gather()
        done += len(chunk)
        out = logits[0]
    seq = GEN
    verify = model(make_batch([(2, lens[1], [4, 4]), (5, len(X), seq)], [2 + r for r in range(len(seq))])).gather()
    return torch.cat((out[None], verify[: len(GEN)]))


def scenario_verify_drafts(model, drafts: list[list[int]]) -> torch.Tensor:
    """X's generation steps verify ``1 + len(d)`` tokens at once, where ``d`` are the drafts a
    drafter proposed (only the tokens equal to GEN are kept, as strict acceptance does);
    the batch holds a prefilling neighbour."""
    out = [model(make_batch([(0, 0, X), (1, 0, NEIGHBOURS[3])], [len(X) - 1])).gather()[0]]
    pos = 0
    for d in drafts:
        if pos >= len(GEN):
            break
        fed = [GEN[pos]] + d
        logits = model(make_batch([(0, len(X) + pos, fed), (2, 0, NEIGHBOURS[1])],
                                  list(range(len(fed))))).gather()
        keep = 1
        while keep < len(fed) and pos + keep < len(GEN) and fed[keep] == GEN[pos + keep]:
            keep += 1
        out.extend(logits[:keep])
        pos += keep
    return torch.stack(out)[: 1 + len(GEN)]


def _ngram_drafts() -> list[list[int]]:
    drafter = NgramDrafter(num_draft_tokens=3)
    hist = X + GEN
    return [drafter.propose(hist[: len(X) + i]) + GEN[i + 1 : i + 2] for i in range(len(GEN))]


SCENARIOS = ("positions", "twins", "late_admission", "chunked_prefill", "verify_ngram", "verify_all")


def run_scenarios(model) -> dict[str, torch.Tensor]:
    """Every scenario's X logits on a fresh cache (collective under TP: every rank calls it)."""
    out = {}
    for name in SCENARIOS:
        allocate_slots(model)
        if name == "verify_ngram":
            out[name] = scenario_verify_drafts(model, _ngram_drafts())
        elif name == "verify_all":
            out[name] = scenario_verify_drafts(model, [GEN[1:]])
        else:
            out[name] = globals()[f"scenario_{name}"](model)
    allocate_slots(model)
    out["alone"] = _alone(model)
    return out


def _rank_scenarios(rank: int, world: int, modes: tuple[bool, ...], path: str) -> dict | None:
    """Every scenario at TP = ``world`` for each mode in ``modes`` (one spawn for all)."""
    from tpspec.mapping import Mapping

    out = {}
    for mode in modes:
        model = load_model(path, Mapping(world, rank, world), deterministic=mode)
        allocate_slots(model)
        out[mode] = run_scenarios(model)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def tp1() -> dict[bool, dict[str, torch.Tensor]]:
    return {mode: run_scenarios(_model(mode)) for mode in (True, False)}


def _differs(results: dict[str, torch.Tensor], reference: torch.Tensor) -> list[str]:
    return [name for name, rows in results.items() if not torch.equal(rows, reference)]


# --- the model -----------------------------------------------------------------------------

def test_deterministic_logits_equal_alone_in_every_batch(tp1):
    res = tp1[True]
    ref = res["alone"]
    assert ref.shape[0] == 1 + len(GEN)
    assert _differs(res, ref) == []


def test_default_mode_differs_in_some_scenario(tp1):
    """Without the mode, at least one scenario changes some logit bits (so the tests above are
    not trivially true); and both modes compute the same function up to float32 rounding."""
    default = tp1[False]
    assert _differs(default, default["alone"]) != []
    torch.testing.assert_close(tp1[True]["alone"], default["alone"], rtol=1e-4, atol=1e-4)


def test_deterministic_tp2_equals_tp1(tp1):
    """TP = 2 gives the TP = 1 logits bit for bit in every scenario; the default mode does not."""
    res = run_ranks(_rank_scenarios, 2, (True, False), tiny_model_path())[0]
    det2, default2 = res[True], res[False]
    for name in SCENARIOS + ("alone",):
        assert torch.equal(det2[name], tp1[True]["alone"]), name
    assert any(not torch.equal(default2[name], tp1[False][name]) for name in default2)


@pytest.mark.slow
def test_deterministic_tp4_equals_tp1(tp1):
    det4 = run_ranks(_rank_scenarios, 4, (True,), tiny_model_path())[0][True]
    for name in SCENARIOS + ("alone",):
        assert torch.equal(det4[name], tp1[True]["alone"]), name


def _rank_few_scenarios(rank: int, world: int, path: str) -> dict | None:
    """X alone, last among prefills then first among decodes, and verified in one forward, in
    deterministic mode at TP = ``world`` (the smallest set that covers batching and verification)."""
    from tpspec.mapping import Mapping

    model = load_model(path, Mapping(world, rank, world), deterministic=True)
    out = {}
    for name in ("positions", "verify_all", "alone"):
        allocate_slots(model)
        out[name] = {"positions": scenario_positions, "alone": _alone,
                     "verify_all": lambda m: scenario_verify_drafts(m, [GEN[1:]])}[name](model)
    return out if rank == 0 else None


@pytest.mark.slow
def test_deterministic_tp8_equals_tp1(tp1):
    """TP = 8 (eight gloo ranks, one attention head and a 64-column LM-head slice each) gives the
    TP = 1 logits bit for bit: alone, batched and verified."""
    det8 = run_ranks(_rank_few_scenarios, 8, tiny_model_path(), timeout_s=600)[0]
    for name, rows in det8.items():
        assert torch.equal(rows, tp1[True]["alone"]), name


@pytest.mark.slow
def test_draft_model_drafts_verified_alone_and_batched():
    """Drafts from the tiny draft model (deterministic too) verified beside neighbours: X's
    logits equal those decoded alone; the draft's own logits equal alone vs batched."""
    target = _model(True)
    draft = DraftModel(tiny_model_path("draft"), deterministic=True)
    allocate_slots(draft)
    draft_alone = draft(make_batch([(0, 0, X)])).gather()[0]
    draft_batched = draft(make_batch([(1, 0, NEIGHBOURS[0]), (2, 0, X)])).gather()[1]
    assert torch.equal(draft_alone, draft_batched)
    drafts = []
    hist = X + GEN
    for i in range(len(GEN)):
        allocate_slots(draft)
        proposal = draft(make_batch([(0, 0, hist[: len(X) + i + 1])])).argmax().tolist()
        drafts.append(proposal + GEN[i + 1 : i + 3])
    ref = _alone(target)
    allocate_slots(target)
    assert torch.equal(scenario_verify_drafts(target, drafts), ref)


# --- the primitives ------------------------------------------------------------------------

@pytest.mark.parametrize("k", [128, 112, 96, 7, 1])
def test_contraction_tree_is_batch_and_split_invariant(k):
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(9, k, generator=gen), torch.randn(13, k, generator=gen)
    c = det.Contraction.of(k)
    full = det.FixedOrderMatmul(c, 1).partial(x, w)
    torch.testing.assert_close(full, x @ w.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(det.FixedOrderMatmul(c, 1).partial(x[4:5], w)[0], full[4])
    assert torch.equal(det.FixedOrderMatmul(c, 1).partial(x, w[3:7]), full[:, 3:7])
    for tp in (2, 4, 8):
        if c.segments % tp:
            with pytest.raises(ValueError, match="segment"):
                det.check_contraction_split("k", k, tp)
            continue
        step = k // tp
        parts = torch.stack([det.FixedOrderMatmul(c, tp).partial(x[:, r * step : (r + 1) * step],
                                                                   w[:, r * step : (r + 1) * step])
                             for r in range(tp)])
        while parts.shape[0] > 1:
            parts = parts[0::2] + parts[1::2]
        assert torch.equal(parts[0], full), tp


def test_rounded_is_the_partial_cast_for_a_whole_contraction():
    """``rounded`` gives ``partial(...).to(x.dtype)`` (here on CPU; on CUDA the tree kernel rounds, checked
    bit for bit by ``det_layer_kernels_cases.check_tree_sum``); a rank's share of a split contraction
    is summed over the ranks first, so without their group it has no rounded form."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 96, generator=gen).half(), torch.randn(11, 96, generator=gen).half()
    mm = det.FixedOrderMatmul(det.Contraction.of(96), 1)
    got = mm.rounded(x, w)
    assert got.dtype == torch.float16 and torch.equal(got, mm.partial(x, w).to(torch.float16))
    with pytest.raises(ValueError, match="whole"):
        det.FixedOrderMatmul(det.Contraction.of(96), 2).rounded(x[:, :48], w[:, :48])


def test_tp_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        det.check_contraction_split("k", 96, 3)


def test_tp_size_must_divide_the_wide_segments():
    """At most 8 wide segments (the CUDA segment GEMM's): TP 16 is refused on every device even
    where the CPU tree alone would split, so a layout valid on one device is valid on the other;
    CPU contractions never take the CUDA path."""
    assert [det.Contraction.of(k).wide_segments for k in (4096, 96, 12, 7)] == [8, 8, 4, 1]
    det.check_contraction_split("k", 4096, 8)
    with pytest.raises(ValueError, match="8 wide segment"):
        det.check_contraction_split("k", 4096, 16)
    with pytest.raises(ValueError, match="4 wide segment"):
        det.check_contraction_split("k", 12, 8)
    assert det.segment_gemm(torch.device("cpu")) is None


def test_portable_exp_is_accurate_and_position_free():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=gen) * 20
    got = det.portable_exp(x)
    ref = torch.exp(x.double())
    finite = ref < 3e38
    rel = ((got.double() - ref).abs() / ref)[finite]
    assert float(rel.max()) < 2e-7
    # the same values at other offsets of other-sized tensors: the same bits
    assert torch.equal(det.portable_exp(x[3:1003]), got[3:1003])
    assert torch.equal(det.portable_exp(x[17:18]), got[17:18])
    special = det.portable_exp(torch.tensor([-math.inf, math.inf, 0.0, -200.0, float("nan")]))
    assert special[:4].tolist() == [0.0, math.inf, 1.0, 0.0] and math.isnan(special[4])


def test_attention_rows_ignore_later_positions_and_batching():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(5, 8, 16, generator=gen), torch.randn(12, 2, 16, generator=gen), torch.randn(12, 2, 16, generator=gen)
    out = det.attend_sequence(q, k, v, cache_len=4, scale=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1), v.repeat_interleave(4, 1).transpose(0, 1),
        attn_mask=torch.arange(12)[None, :] <= 4 + torch.arange(5)[:, None], scale=0.25).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    garbage = k.clone()
    garbage[9:] = 1e30  # positions no row sees
    for i in range(5):
        one = det.attend_sequence(q[i : i + 1], garbage[: 5 + i + 3], v[: 5 + i + 3], cache_len=4 + i, scale=0.25)
        assert torch.equal(one[0], out[i]), i


def test_deterministic_mode_errors():
    from tpspec.mapping import Mapping
    from tpspec.model import ModelConfig, check_split

    cfg = ModelConfig.from_pretrained(tiny_model_path())
    with pytest.raises(ValueError, match="attention DP"):
        check_split(cfg, Mapping(2, 0, 2, True), deterministic=True)
    check_split(cfg, Mapping(4, 1, 4), deterministic=True)  # the tiny model splits at TP 4


# --- through the runtime: tokens and logprobs ------------------------------------------------
#
# Under rejection acceptance a sampled request's tokens depend on the drafts by design, so
# sampled runs are compared within one configuration and greedy runs (with logprobs: the
# log-softmax of the raw logits) across all of them. (Strict acceptance keeps seeded tokens
# across speculative configurations: tests/test_runtime_seeded_spec.py.)

GREEDY = dict(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
SEEDED = dict(temperature=0.8, seed=243696, max_tokens=8, logprobs=3, ignore_eos=True)


def _neighbour_params():
    from tpspec import SamplingParams

    return [SamplingParams(temperature=0.9, top_k=5, seed=7, max_tokens=6, ignore_eos=True),  # a filter
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)]  # unseeded


def _runtime_outputs(tp: int, spec: dict | None) -> dict[str, tuple[list[int], list]]:
    """X through ``LLM(deterministic=True)``, greedy and seeded: alone, then last in a batch with
    neighbours (a top-k one, a greedy one, an unseeded one) in slots used before.
    ``{"greedy alone": (token_ids, logprobs), "greedy batched": ..., "seeded alone": ..., ...}``."""
    from tpspec import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in NEIGHBOURS[:3]] + [{"prompt_token_ids": X}]
    out = {}
    with LLM("tiny", tensor_parallel_size=tp, speculative_config=spec, deterministic=True, max_num_seqs=3,
             max_model_len=64) as llm:
        for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            alone = llm.generate([{"prompt_token_ids": X}], SamplingParams(**params))[0].outputs[0]
            batch = llm.generate(prompts, _neighbour_params() + [SamplingParams(**params)])[3].outputs[0]
            out[f"{kind} alone"] = (list(alone.token_ids), alone.logprobs)
            out[f"{kind} batched"] = (list(batch.token_ids), batch.logprobs)
    return out


@pytest.fixture(scope="module")
def runtime_reference() -> dict[str, tuple[list[int], list]]:
    """X at TP = 1 without speculation."""
    return _runtime_outputs(1, None)


def _check_runtime(got: dict, greedy_ref: tuple, seeded_ref: tuple | None) -> None:
    for kind in ("alone", "batched"):
        assert got[f"greedy {kind}"] == greedy_ref, kind
        assert got[f"seeded {kind}"] == (seeded_ref or got["seeded alone"]), kind


def test_runtime_alone_equals_batched_with_speculation():
    """One LLM (TP 1, n-gram drafts): X alone and X beside neighbours in reused slots give the
    same tokens and logprobs, greedy and seeded."""
    got = _runtime_outputs(1, {"method": "ngram", "num_speculative_tokens": 3})
    tokens, logprobs = got["greedy alone"]
    assert len(tokens) == GREEDY["max_tokens"] and len(logprobs) == len(tokens)
    _check_runtime(got, got["greedy alone"], None)


@pytest.mark.slow
def test_runtime_speculation_keeps_greedy_logprobs(runtime_reference):
    ref = runtime_reference
    _check_runtime(ref, ref["greedy alone"], None)
    _check_runtime(_runtime_outputs(1, {"method": "ngram", "num_speculative_tokens": 3}), ref["greedy alone"], None)


@pytest.mark.slow
@pytest.mark.parametrize("tp,spec", [
    (2, None),
    (4, None),
    (2, {"method": "ngram", "num_speculative_tokens": 3}),
    (2, {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2, "acceptance": "rejection"}),
])
def test_runtime_tp_and_speculation_equal(runtime_reference, tp, spec):
    """At TP 2/4 the greedy runs equal TP 1 without speculation; the seeded runs equal TP 1 with
    the same speculative configuration."""
    seeded_ref = runtime_reference["seeded alone"] if spec is None else _runtime_outputs(1, spec)["seeded alone"]
    _check_runtime(_runtime_outputs(tp, spec), runtime_reference["greedy alone"], seeded_ref)


def test_runtime_rejects_what_deterministic_mode_cannot_do():
    from tpspec import LLM

    with pytest.raises(ValueError, match="attention DP"):
        LLM("tiny", tensor_parallel_size=2, attention_dp=True, deterministic=True)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM("tiny", attention_backend="torch", deterministic=True)
    with pytest.raises(ValueError, match="deterministic"):
        LLM("tiny", deterministic="yes")


def test_embedding_turns_negative_zero_positive_at_every_tp():
    """The vocab-parallel embedding adds +0.0 from the other ranks to the owner's value; a -0.0
    entry would come out +0.0 at TP > 1, so deterministic mode makes it +0.0 at TP = 1 too."""
    from tpspec.model.layers import VocabParallelEmbedding

    emb = VocabParallelEmbedding("e", 8, 4, 1, 0, None, dtype=torch.float32, device="cpu", deterministic=True)
    emb.weight.copy_(torch.tensor([[-0.0, 1.5, -2.0, 0.0]] * 8))
    out = emb(torch.tensor([3, 9]))  # 9 is out of range: zeros
    assert out[0].tolist() == [0.0, 1.5, -2.0, 0.0] and not torch.signbit(out[0, 0])
    assert torch.equal(out[1], torch.zeros(4)) and not torch.signbit(out[1]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_on_cuda(dtype):
    """On CUDA (the segment GEMM where triton imports, else the element tree): every
    scenario's logits equal the request's alone, in float32 and bfloat16."""
    model = load_model(tiny_model_path(), device="cuda", dtype=dtype, deterministic=True)
    allocate_slots(model)
    res = run_scenarios(model)
    assert _differs(res, res["alone"]) == []


def test_blocking_never_changes_a_sum(monkeypatch):
    """Products are formed in blocks of rows, columns and KV positions; any block size gives the
    same bits (every block is a whole subtree or a set of whole output elements)."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(11, 96, generator=gen), torch.randn(37, 96, generator=gen)
    q, k, v = (torch.randn(7, 8, 16, generator=gen), torch.randn(45, 2, 16, generator=gen),
               torch.randn(45, 2, 16, generator=gen))
    mm = det.FixedOrderMatmul(det.Contraction.of(96), 1)
    ref_mm, ref_att = mm.partial(x, w), det.attend_sequence(q, k, v, cache_len=38, scale=0.25)
    for block in (1, 64, 500, 3000):
        monkeypatch.setattr(det, "BLOCK_ELEMENTS", block)
        assert torch.equal(mm.partial(x, w), ref_mm), block
        assert torch.equal(det.attend_sequence(q, k, v, cache_len=38, scale=0.25), ref_att), block


def test_cli_deterministic_flag_reaches_the_checks(capsys):
    from tpspec.cli import main

    assert main(["generate", "--deterministic", "--attention-dp"]) == 2  # refused before any worker starts
    assert "attention DP" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_deterministic_tp1_equals_tp2(capsys, monkeypatch):
    """`tpspec generate --deterministic --json` at TP 1 and TP 2: the same tokens for seeded sampling."""
    import json

    from tpspec.cli import main

    monkeypatch.setenv("TPSPEC_NUM_THREADS", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    outs = []
    for tp in (1, 2):
        capsys.readouterr()
        assert main(["generate", "--deterministic", "-tp", str(tp), "--json", "--num-prompts", "3", "--max-tokens", "8",
                     "--temperature", "0.8", "--seed", "5"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert f"tp={tp} " in report["config"] and report["config"].endswith(" deterministic"), report["config"]
        outs.append([c["token_ids"] for o in report["outputs"] for c in o["outputs"]])
    assert outs[0] == outs[1] and len(outs[0]) == 3
