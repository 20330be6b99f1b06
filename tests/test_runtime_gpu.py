"""GPU only: CUDA-graph generation steps give the tokens of eager steps (SPEC §8.6)."""

from __future__ import annotations

import pytest
import torch

from tpspec import LLM, SamplingParams, SpeculativeConfig
from tpspec.model.tiny import make_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300], [42] * 12, [7, 8], [9]]
PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(), SamplingParams(),
          SamplingParams(temperature=1.0, seed=4)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 4)], ids=["plain", "ngram"])
def test_cuda_graphs_match_eager(tmp_path, spec):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    results = {}
    for graphs in (False, True):
        # In-process (a single plain process is rank 0 of a TP group of 1): the engine is inspectable.
        with LLM(path, launcher="torchrun", tp_size=1, device="cuda", dtype="float32", speculative=spec,
                 max_batch_size=4, use_cuda_graphs=graphs) as llm:
            greedy = [o.token_ids for o in llm.generate(PROMPTS, max_new_tokens=24)]
            mixed = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, max_new_tokens=24)]
            engine = llm._executor.engine  # noqa: SLF001
            if graphs:
                assert engine.graphs is not None and engine.graphs.graphs, "no generation step was graphed"
                assert not engine.graphs.failed, f"captures failed: {engine.graphs.failed}"
            results[graphs] = (greedy, mixed)
    assert results[True] == results[False]


def test_graph_step_inputs_on_cpu(tmp_path):
    """What a graph replays, run eagerly on CPU: batches padded to the bucket size with free
    slots and padding requests, attention over the whole cache, the strict selection path.
    It must give the tokens of the ordinary eager step."""
    from tpspec.runtime.cuda_graphs import GenerationGraphs

    path = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    spec = SpeculativeConfig("ngram", 4)
    with LLM(path, launcher="torchrun", tp_size=1, device="cpu", speculative=spec, max_batch_size=8) as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, max_new_tokens=24)]
        engine = llm._executor.engine  # noqa: SLF001
        graphs = GenerationGraphs.__new__(GenerationGraphs)  # no CUDA here: never capture, run the padded step
        graphs.engine, graphs.buckets, graphs.graphs, graphs.failed = engine, [8], {}, set()
        graphs._capture = lambda key, host: None
        eager, calls = graphs._eager, []
        graphs._eager = lambda host: calls.append(1) or eager(host)
        engine.graphs = graphs
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, max_new_tokens=24)]
        engine.graphs = None
    assert calls, "no step took the padded graph path"
    assert got == ref


def _graph_reason_worker(rank, world):
    from types import SimpleNamespace

    from tpspec import distributed as D
    from tpspec.runtime.cuda_graphs import graphs_unavailable_reason

    torch.cuda.is_available = lambda: True  # this process only: the decision past the device check
    engine = SimpleNamespace(device=torch.device("cuda", 0), dp_size=1, group=D.tp_group())
    plain = graphs_unavailable_reason(engine)
    engine.dp_size = world
    return plain, graphs_unavailable_reason(engine)


def test_graphs_are_off_when_tp_collectives_cannot_be_captured():
    """A TP group on gloo (ranks sharing a GPU) cannot be captured: every rank decides so
    up front, instead of failing captures at run time."""
    from tpspec.testing import run_ranks

    for plain, dp in run_ranks(_graph_reason_worker, 2, timeout_s=60):
        assert plain is not None and "gloo" in plain
        assert dp is not None and "attention DP" in dp
