"""CUDA-graph generation steps give the tokens of eager steps, for every graphed step shape
(GPU; the logic around the graphs is tested on CPU in test_runtime_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from graph_cases import (PROMPTS, QWEN, SPECS, assert_logprobs_close, every_step_shape, first_outputs, make_models,
                         spec_config)
from tpspec import LLM, SamplingParams
from tpspec.runtime import cuda_graphs
from tpspec.runtime.cuda_graphs import GRAPHED_DRAFT_CHAIN

PARAMS = every_step_shape((16, 24, 8, 12, 14, 10))
MIXED = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.8, seed=3, max_tokens=24),
         SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.0, max_tokens=24),
         SamplingParams(temperature=1.0, seed=4, max_tokens=24), SamplingParams(temperature=0.7, seed=5, max_tokens=24)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("gpu_graph_models"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", SPECS)
def test_cuda_graphs_match_eager(models, name, monkeypatch):
    """Every step shape replayed from CUDA graphs (and the drafters' chained draft steps) gives the
    eager steps' tokens (logprobs within 1e-4: padding a batch to its bucket may move the logits'
    last bits); steps launched ahead of their predecessor's tokens too: decode steps, and greedy
    verification of n-gram drafts (``STEP_AHEAD_WITH_DRAFTS``, its inputs moved on by the Triton kernel:
    ``ADVANCE_KERNEL``; both set on here whatever the defaults)."""
    monkeypatch.setattr(cuda_graphs, "STEP_AHEAD_WITH_DRAFTS", True)
    monkeypatch.setattr(cuda_graphs, "ADVANCE_KERNEL", True)
    results = {}
    for use_graphs in (False, True):
        # In-process (a single plain process is rank 0 of a TP group of 1): the engine is inspectable.
        # Every fact about the graphs is read while the LLM is open (closing it drops them).
        with LLM(models["target"], distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                 device="cuda", dtype="float32", speculative_config=spec_config(name, models), max_num_seqs=8,
                 enforce_eager=not use_graphs) as llm:
            results[use_graphs] = [first_outputs(llm.generate(PROMPTS, params)) for params in (GREEDY, MIXED, PARAMS)]
            if use_graphs:
                graphs = llm._executor.ctx.state["engine"].graphs  # noqa: SLF001
                assert graphs is not None and graphs.graphs, "no generation step was graphed"
                keys, chained = list(graphs.graphs), bool(graphs.draft_graphs)
                replayed, repeated, failed = graphs.num_replayed, graphs.num_repeated, set(graphs.failed)
                ahead = graphs.num_ahead
                del graphs
    assert replayed > 0, "no target step came from a graph replay"
    assert (ahead > 0) == (name in ("plain", "ngram", "ngram-rejection"))  # no drafter to run on the host
    assert not failed, f"captures failed: {failed}"
    for got, ref in zip(results[True], results[False]):
        assert got[0] == ref[0]
        assert_logprobs_close(got[1], ref[1], abs_tol=1e-4, same_ranks=False)
    filtered = [k for k in keys if k.sampling == "filtered"]
    assert filtered and all(k.penalties and k.top_logprobs == 8 for k in filtered)
    assert all(k.hidden_states == name.startswith("eagle3") for k in keys)
    assert any(k.draft_logits for k in filtered) == (name in ("draft_model-rejection", "eagle3-rejection"))
    assert chained == (GRAPHED_DRAFT_CHAIN and name.startswith(("draft_model", "eagle3")))
    assert repeated > 0  # the flat top-p row's undecided steps, repeated eagerly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
def test_qwen_defaults_and_logprobs_at_batch_64_stay_in_the_graph(models, fused, monkeypatch):
    """64 requests on Qwen2.5's defaults (T 0.7, top-p 0.8, top-k 20, repetition penalty 1.05)
    with logprobs=5 run from the graph of bucket 64, never repeated eagerly (top-k decides every
    row from the candidates), and give the eager tokens. The eager steps run with the penalties
    applied apart, the filters' flags in torch and the tokens counted by torch ops; ``fused``: the
    graphed steps with the penalties inside the keys kernel (``select.PENALIZED_KEYS_KERNEL``), the
    filters read in the draw kernel (``select.FILTERS_IN_DRAW_KERNEL``) and the tokens counted by
    one kernel (``penalties.COUNT_KERNEL``)."""
    from tpspec.sampling import penalties, select

    prompts = [[(7 * i + j) % 500 + 1 for j in range(4 + i % 5)] for i in range(64)]
    params = [SamplingParams(**QWEN, seed=i, max_tokens=12, ignore_eos=True, logprobs=5) for i in range(64)]
    results = {}
    for use_graphs in (False, True):
        monkeypatch.setattr(select, "PENALIZED_KEYS_KERNEL", fused and use_graphs)
        monkeypatch.setattr(select, "FILTERS_IN_DRAW_KERNEL", fused and use_graphs)
        monkeypatch.setattr(penalties, "COUNT_KERNEL", fused and use_graphs)
        with LLM(models["target"], distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                 device="cuda", dtype="float32", max_num_seqs=64, enforce_eager=not use_graphs) as llm:
            results[use_graphs] = first_outputs(llm.generate(prompts, params))[0]
            if use_graphs:
                graphs = llm._executor.ctx.state["engine"].graphs  # noqa: SLF001
                keys, repeated, failed = list(graphs.graphs), graphs.num_repeated, set(graphs.failed)
                del graphs
    assert not failed, f"captures failed: {failed}"
    assert any(k.batch == 64 and k.sampling == "filtered" for k in keys) and repeated == 0
    assert results[True] == results[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_advance_kernel_equals_the_torch_ops():
    """The Triton kernel of a verification step launched ahead, compiled for the GPU: the torch ops'
    history, inputs and drafts (``tests/advance_cases.py``); the strict-acceptance kernel the
    torch function's values."""
    import advance_cases

    advance_cases.check("cuda")
    advance_cases.check_accept("cuda")
