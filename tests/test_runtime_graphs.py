"""The logic around CUDA-graph generation steps, on CPU: the padded step a graph replays,
when graphs are off, and the capture fallback every rank takes alike."""

from __future__ import annotations

import pytest
import torch

from tpspec import LLM, SamplingParams, SpeculativeConfig
from tpspec.model.tiny import make_tiny_checkpoint
from tpspec.runtime.cuda_graphs import capture_or_fall_back

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300], [42] * 12, [7, 8], [9]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.8, seed=3, max_tokens=24),
          SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.0, max_tokens=24),
          SamplingParams(temperature=1.0, seed=4, max_tokens=24)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


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
        engine = llm._executor.ctx.state["engine"]  # noqa: SLF001
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
    engine = SimpleNamespace(device=torch.device("cuda", 0), dp_size=1, eagle3=None, group=D.tp_group())
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


def _capture_protocol(fails_in: str | None, *, peers_vote: int, votes: list[int]):
    """The fallback with plain callables: this rank fails in ``fails_in`` (``"warmup"``,
    ``"capture"`` or nowhere), the other ranks vote ``peers_vote``; this rank's votes are
    appended to ``votes``."""

    def warm_up():
        if fails_in == "warmup":
            raise RuntimeError("out of memory in warm-up")

    def capture():
        if fails_in == "capture":
            raise RuntimeError("out of memory in capture")
        return "graph"

    def min_over_ranks(vote):
        votes.append(vote)
        return min(vote, peers_vote)

    return capture_or_fall_back(warm_up, capture, min_over_ranks)


def test_a_capture_failure_anywhere_sends_every_rank_eager_but_a_warmup_failure_raises():
    """A capture only records, so a rank whose capture failed still meets its peers in the
    vote (and then every rank runs the step eagerly). The warm-up runs collectives: a rank
    failing there must not go on to the vote; its error is raised instead."""
    votes: list[int] = []
    with pytest.raises(RuntimeError, match="warm-up"):
        _capture_protocol("warmup", peers_vote=1, votes=votes)
    assert votes == []  # no vote after a failed warm-up
    captured, error = _capture_protocol("capture", peers_vote=1, votes=votes)
    assert captured is None and "in capture" in str(error) and votes == [0]
    captured, error = _capture_protocol(None, peers_vote=0, votes=votes)  # a peer failed: eager here too
    assert captured is None and error is None and votes == [0, 1]
    captured, error = _capture_protocol(None, peers_vote=1, votes=votes)
    assert captured == "graph" and error is None and votes == [0, 1, 1]


def test_graphs_follow_the_attention_backends_ability(monkeypatch):
    """Whether steps are graphed depends on the target's attention backend (its
    ``supports_graphs``), not on the mode: the deterministic backend's host loop is refused,
    a backend that declares it can be captured is not."""
    from types import SimpleNamespace

    from tpspec.model.attention import DeterministicPagedAttention, TorchPagedAttention
    from tpspec.runtime.cuda_graphs import graphs_unavailable_reason

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the decision past the device check
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.5, dtype=torch.float32, device=torch.device("cpu"))

    def reason(attention):
        model = SimpleNamespace(attention=attention)
        return graphs_unavailable_reason(SimpleNamespace(device=torch.device("cuda", 0), dp_size=1, eagle3=None,
                                                         group=None, model=model))

    assert reason(TorchPagedAttention(**kw)) is None
    det = DeterministicPagedAttention(**kw)  # on CPU: the host loop
    assert "'deterministic' attention" in reason(det)
    monkeypatch.setattr(det, "supports_graphs", True, raising=False)  # a backend whose attend can be captured
    assert reason(det) is None
