"""CUDA-graph generation steps give the tokens of eager steps: GPU tests, and CPU
tests of the logic around the graphs (step inputs, when graphs are off, the capture fallback)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tpspec import LLM, SamplingParams, SpeculativeConfig
from tpspec.model.tiny import make_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300], [42] * 12, [7, 8], [9]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.8, seed=3, max_tokens=24),
          SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.0, max_tokens=24),
          SamplingParams(temperature=1.0, seed=4, max_tokens=24)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 4)], ids=["plain", "ngram"])
def test_cuda_graphs_match_eager(tmp_path, spec):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    results = {}
    for graphs in (False, True):
        # In-process (a single plain process is rank 0 of a TP group of 1): the engine is inspectable.
        with LLM(path, distributed_executor_backend="external_launcher", tensor_parallel_size=1, device="cuda",
                 dtype="float32", speculative_config=spec, max_num_seqs=4, enforce_eager=not graphs) as llm:
            greedy = _tokens(llm.generate(PROMPTS, GREEDY))
            mixed = _tokens(llm.generate(PROMPTS, PARAMS))
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
    with LLM(path, distributed_executor_backend="external_launcher", tensor_parallel_size=1, device="cpu",
             speculative_config=spec, max_num_seqs=8) as llm:
        ref = _tokens(llm.generate(PROMPTS, PARAMS))
        engine = llm._executor.engine  # noqa: SLF001
        graphs = GenerationGraphs.__new__(GenerationGraphs)  # no CUDA here: never capture, run the padded step
        graphs.engine, graphs.buckets, graphs.graphs, graphs.failed = engine, [8], {}, set()
        graphs._capture = lambda key, host: None
        eager, calls = graphs._eager, []
        graphs._eager = lambda host: calls.append(1) or eager(host)
        engine.graphs = graphs
        got = _tokens(llm.generate(PROMPTS, PARAMS))
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


class _FakeCuda:
    """Stand-ins for the torch.cuda calls of GenerationGraphs._capture (a unit test of its
    fallback logic on CPU; the GPU test above runs the real ones)."""

    class Stream:
        def wait_stream(self, other):
            pass

    class CUDAGraph:
        pass

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream():
        return _FakeCuda.Stream()

    @staticmethod
    def graph(g, pool=None):
        return contextlib.nullcontext()


@pytest.mark.parametrize("fails_in", ["warmup", "capture", None])
def test_capture_failure_goes_eager_on_every_rank_but_a_warmup_failure_raises(monkeypatch, fails_in):
    """A capture only records, so a rank whose capture failed can still meet its peers in the
    flag's all-reduce (every rank then runs the key eagerly). The warm-up runs collectives:
    a rank failing there must not go on to that all-reduce; its error is raised instead."""
    from types import SimpleNamespace

    from tpspec.runtime import cuda_graphs as G

    for name in ("Stream", "CUDAGraph", "stream", "current_stream", "graph"):
        monkeypatch.setattr(G.torch.cuda, name, getattr(_FakeCuda, name))
    monkeypatch.setattr(G.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(G.torch.cuda, "graph_pool_handle", lambda: "fresh pool")
    monkeypatch.setattr(G, "_on_device", lambda batch, dev: batch)
    reduced = []
    monkeypatch.setattr(G.D, "all_reduce_", lambda t, op, group: reduced.append((int(t.item()), op)))
    graphs = G.GenerationGraphs.__new__(G.GenerationGraphs)
    graphs.engine = SimpleNamespace(device=torch.device("cpu"), group=None)
    graphs.graphs, graphs.failed, graphs.pool = {}, set(), "pool"
    graphs._attn_meta = lambda batch: "meta"
    graphs._plan_attention = lambda meta: None

    def forward_and_select(batch, meta, drafts, is_warmup):
        if (fails_in == "warmup" and is_warmup) or (fails_in == "capture" and not is_warmup):
            raise RuntimeError("out of memory")
        return torch.zeros(2), torch.ones(2)

    graphs._forward_and_select = forward_and_select
    batch = SimpleNamespace(token_ids="ids", positions="pos")
    key = (2, True, False, False)
    if fails_in == "warmup":
        with pytest.raises(RuntimeError, match="out of memory"):
            graphs._capture(key, (batch, None))
        assert reduced == [] and not graphs.failed and not graphs.graphs
    elif fails_in == "capture":
        with pytest.warns(RuntimeWarning, match="running it eagerly"):
            assert graphs._capture(key, (batch, None)) is None
        assert reduced == [(0, "min")] and graphs.failed == {key} and graphs.pool == "fresh pool"
    else:
        g = graphs._capture(key, (batch, None))
        assert reduced == [(1, "min")] and graphs.graphs == {key: g} and g.tokens == "ids"
