"""The paged KV cache in the runtime: page pressure (requests start in order, the newest is
preempted when pages run out and resumes first, every request equal to its run alone), page
accounting (no leak after any generate), KV memory equal to the pages asked for, and bad sizes
raising clearly before any worker starts. The allocator's own rules: tests/test_runtime_prefix_cache.py."""

from __future__ import annotations

import logging

import pytest
import torch

from tpspec import LLM, SpeculativeConfig
from tpspec.mapping import Mapping
from tpspec.model.tiny import make_tiny_checkpoint
from tpspec.runtime.config import EngineConfig, Request
from tpspec.runtime.engine import Engine
from tpspec.sampling.params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7], [42] * 12, list(range(3, 43)), [7],
           [300, 301, 302, 303, 300, 301]]
MAX_NEW = 20
PAGE = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged_models")
    return str(make_tiny_checkpoint(root / "tiny", seed=0)), str(make_tiny_checkpoint(root / "draft", seed=0,
                                                                                       draft=True))


def _requests(prompts, first_id=0):
    return [Request(first_id + i, tuple(p), SamplingParams(temperature=0.0), MAX_NEW) for i, p in enumerate(prompts)]


def _engine(ckpt, *, kv_pages=None, spec=None, max_batch_size=6, max_seq_len=96):
    """A TP = 1 engine in this process; ``kv_pages``: request pages the cache is sized for."""
    cfg = EngineConfig(ckpt[0], 1, "cpu", "float32", speculative=spec,
                       draft_model_path=ckpt[1] if spec is not None and spec.method == "draft_model" else None,
                       max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_num_tokens=64, page_size=PAGE)
    if kv_pages is not None:
        probe = Engine(cfg, Mapping())
        per_page, scratch = probe.kv.page_bytes, probe.kv.num_scratch_pages
        probe.close()
        cfg = EngineConfig(**{**cfg.__dict__, "kv_cache_bytes": (kv_pages + scratch) * per_page})
    return Engine(cfg, Mapping())


def _run(engine, prompts, first_id=0):
    return [r.token_ids for r in engine.generate(_requests(prompts, first_id))]


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 3), SpeculativeConfig("draft_model", 2,
                                                                                          model="x")],
                         ids=["plain", "ngram", "draft_model"])
def test_page_pressure_preempts_the_newest_resumes_in_order_never_leaks(ckpt, spec):
    roomy = _engine(ckpt, spec=spec)
    alone = [_run(roomy, [p], i)[0] for i, p in enumerate(PROMPTS)]
    # Prompts of 1..40 tokens and 20 new tokens each against 24 pages of 4 (96 tokens): they start
    # together and run out of pages as they grow.
    tight = _engine(ckpt, kv_pages=24, spec=spec, max_seq_len=64)
    assert tight.pages.num_pages == 24 and tight.kv.num_scratch_pages >= 1
    starts: list[int] = []  # seq index of every (re)start, in order
    preempted: list[int] = []
    place, preempt = tight._place, tight._preempt

    def spy_place(seq, slot, *, cached):
        starts.append(seq.index)
        place(seq, slot, cached=cached)

    def spy_preempt(seq):
        assert seq is max(tight._running, key=tight._running.index)  # the newest running request
        preempted.append(seq.index)
        preempt(seq)
        assert tight._waiting[0] is seq  # it resumes before anything newer

    tight._place, tight._preempt = spy_place, spy_preempt
    for call in range(2):  # twice: nothing leaks from one call into the next
        starts.clear()
        preempted.clear()
        before = tight.num_preemptions
        results = tight.generate(_requests(PROMPTS, 100 * call))
        assert [r.token_ids for r in results] == alone
        assert tight.num_preemptions - before == len(preempted) == sum(r.stats.num_preemptions for r in results) > 0
        tight.pages.check()
        assert tight.pages.num_free == 24  # every page free again (cached ones included)
        first = {}
        for idx in starts:
            first.setdefault(idx, len(first))
        assert sorted(first, key=first.get) == sorted(first)  # first started in FIFO order
        assert len(starts) == len(PROMPTS) + len(preempted)  # every preempted request started again


def test_kv_memory_is_the_pages_asked_for(ckpt):
    engine = _engine(ckpt, kv_pages=30)
    total = 30 + engine.kv.num_scratch_pages
    per_layer = total * PAGE * engine.model.num_kv_heads_per_rank * engine.model.config.head_dim * 4 * 2
    assert sum(c.nbytes for c in engine.model.caches) == engine.model.config.num_layers * per_layer
    assert sum(c.nbytes for c in engine.model.caches) == engine.kv.total_bytes == engine.config.kv_cache_bytes
    assert "KV cache holds 120 tokens per rank (30 pages x 4 tokens" in engine.summary()


def test_bad_sizes_raise_before_workers(ckpt, caplog):
    cases = [
        (dict(page_size=0), "page_size must be a positive int"),
        (dict(kv_cache_bytes=-5), "kv_cache_bytes must be a positive int"),
        (dict(kv_cache_bytes=1000), "kv_cache_bytes=1000 holds 0 KV pages"),
        (dict(kv_cache_bytes=64 * 1024, max_model_len=4096), "4096 needs 256"),
        (dict(attention_backend="magic"), "attention_backend must be"),
        (dict(attention_backend="flashinfer"), "attention_backend='flashinfer' needs CUDA"),
    ]
    for kwargs, message in cases[:-1]:
        with pytest.raises(ValueError, match=message):
            LLM(ckpt[0], tensor_parallel_size=2, device="cpu", **kwargs)  # raises in the driver: no worker starts
    # vLLM scripts pass gpu_memory_utilization everywhere: without a GPU it sizes nothing, and says so.
    logger = logging.getLogger("tpspec")
    logger.addHandler(caplog.handler)
    try:
        with pytest.raises(ValueError, match="holds 0 KV pages"):
            LLM(ckpt[0], tensor_parallel_size=2, device="cpu", kv_cache_bytes=1000, gpu_memory_utilization=0.5)
    finally:
        logger.removeHandler(caplog.handler)
    assert "gpu_memory_utilization=0.5 has no effect" in caplog.text
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in \\(0, 1\\]"):
        EngineConfig(ckpt[0], 1, "cuda", "float32", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=cases[-1][1]):
        Engine(EngineConfig(ckpt[0], 1, "cpu", "float32", attention_backend="flashinfer"), Mapping())


@pytest.mark.parametrize("attention_dp", [False, True], ids=["tp2", "tp2-adp"])
def test_page_pressure_tp2_equals_tp1(ckpt, attention_dp, monkeypatch):
    monkeypatch.setenv("TPSPEC_NUM_THREADS", "1")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with LLM(ckpt[0], tensor_parallel_size=1, max_num_seqs=6, page_size=PAGE) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    # 40 pages of 4 tokens over both attention-DP ranks' own pools, or one plain-TP pool.
    per_page = 2 * 2 * PAGE * (1 if not attention_dp else 2) * 16 * 4
    with LLM(ckpt[0], tensor_parallel_size=2, attention_dp=attention_dp, max_num_seqs=6, max_model_len=96,
             page_size=PAGE, speculative_config=SpeculativeConfig("ngram", 3), kv_cache_bytes=40 * per_page) as llm:
        for _ in range(2):
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == ref


def test_qwen2_paged_tp2_and_attention_dp_equal_transformers(tmp_path, monkeypatch):
    """Greedy tokens of a Qwen2 checkpoint (q/k/v biases, grouped-query heads) through the paged
    runtime — TP = 2 and attention DP, pages of 4 tokens, fewer pages than the batch wants — equal
    Hugging Face transformers' own greedy decoding."""
    pytest.importorskip("transformers")
    from test_model_hf import PROMPTS as HF_PROMPTS, _hf_checkpoint, _hf_greedy

    monkeypatch.setenv("TPSPEC_NUM_THREADS", "1")
    hf, path = _hf_checkpoint(tmp_path, "qwen2")
    want = [_hf_greedy(hf, p, 12) for p in HF_PROMPTS]
    per_page = 2 * 2 * PAGE * 1 * 16 * 4  # 2 layers, K and V, 1 KV head a rank (2 under attention DP), fp32
    # Worst cases of 5, 4 and 6 pages against 10 pages a pool (attention DP: rank 0 runs prompts 0 and 2).
    for attention_dp in (False, True):
        with LLM(path, tensor_parallel_size=2, attention_dp=attention_dp, max_num_seqs=3, max_model_len=32,
                 page_size=PAGE, kv_cache_bytes=(10 + 1) * per_page * (2 if attention_dp else 1)) as llm:
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            got = [o.outputs[0].token_ids for o in llm.generate(HF_PROMPTS, params)]
        assert got == want, attention_dp


def test_startup_summary_is_logged_at_the_level_asked(ckpt):
    """Rank 0 logs the start-up summary through ``logging`` at INFO; ``TPSPEC_LOG_LEVEL=WARNING`` hides it."""
    import os
    import subprocess
    import sys

    code = ("from tpspec.mapping import Mapping; from tpspec.runtime.config import EngineConfig; "
            "from tpspec.runtime.engine import Engine; "
            f"Engine(EngineConfig({ckpt[0]!r}, 1, 'cpu', 'float32', max_seq_len=64, page_size=8), Mapping())")
    for level, shown in (("INFO", True), ("WARNING", False)):
        env = dict(os.environ, TPSPEC_LOG_LEVEL=level, TPSPEC_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert ("INFO tpspec.runtime.engine: engine ready" in proc.stderr) == shown, proc.stderr[-2000:]
        if shown:
            # The CPU default: 8 requests of max_seq_len (63 tokens: 8 pages of 8 each).
            assert "KV cache holds 512 tokens per rank (64 pages x 8 tokens" in proc.stderr
            assert "max_num_seqs=256, max_num_batched_tokens=2048" in proc.stderr
            assert "attention torch" in proc.stderr and "weights loaded in" in proc.stderr


def test_default_batch_serves_many_requests_and_llm_reports_the_cache(ckpt):
    """``max_num_seqs`` defaults to vLLM's 256 with a step budget of at least 2048 tokens; on CPU
    the default cache holds 8 requests of ``max_model_len`` (the same memory as before), and short
    requests beyond 8 still run together. ``LLM`` reports the tokens its cache holds."""
    from tpspec.model.batch import pages_needed

    with LLM(ckpt[0], distributed_executor_backend="external_launcher", tensor_parallel_size=1, device="cpu",
             max_model_len=256) as llm:
        engine = llm._executor.ctx.state["engine"]  # noqa: SLF001
        assert (llm.config.max_batch_size, llm.config.max_num_tokens) == (256, 2048)
        assert llm.num_kv_pages == engine.kv.num_pages == 8 * pages_needed(255, 16)
        assert llm.kv_cache_tokens == llm.num_kv_pages * 16 == engine.kv.num_tokens
        running = []
        schedule = engine._schedule

        def spy():
            plan = schedule()
            running.append(len(engine._running))
            return plan

        engine._schedule = spy
        outs = llm.generate([[i + 1, i + 2, i + 3] for i in range(40)], SamplingParams(temperature=0.0, max_tokens=4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert max(running) == 40  # every request ran at once


def test_the_profiled_step_runs_on_every_paged_model(ckpt):
    """The step ``gpu_memory_utilization`` sizing profiles on CUDA (a forward of
    ``max_num_tokens`` tokens, then the heaviest selection: penalties, every filter, the most
    logprobs), run here on CPU through the target and a draft model."""
    from tpspec.runtime.kv_sizing import _profile_step

    spec = SpeculativeConfig("draft_model", 3, model="x")
    cfg = EngineConfig(ckpt[0], 1, "cpu", "float32", speculative=spec, draft_model_path=ckpt[1], max_seq_len=96,
                       max_batch_size=4, max_num_tokens=64)
    engine = Engine(cfg, Mapping())
    for model in engine.paged_models:
        _profile_step(model, cfg)
        assert model.num_pages == 4  # the profiling pages: 64 tokens of 16
    engine.close()


def test_cpu_default_cache_is_min_of_max_num_seqs_and_8_requests_within_its_byte_cap(monkeypatch):
    """Without ``kv_cache_bytes`` on CPU: ``min(max_num_seqs, 8)`` requests of ``max_model_len``,
    at most ``CPU_DEFAULT_KV_BYTES`` (scratch pages included)."""
    from types import SimpleNamespace

    from tpspec.model.batch import pages_needed
    from tpspec.runtime import kv_sizing

    class Paged:  # a paged model of 1 KiB a page
        def page_bytes(self, page_size: int) -> int:
            return 1024

    def plan(max_num_seqs: int) -> kv_sizing.KVPlan:
        config = SimpleNamespace(page_size=16, num_draft_tokens=0, kv_cache_bytes=None, max_batch_size=max_num_seqs,
                                 max_seq_len=256, gpu_memory_utilization=None)
        return kv_sizing.plan_kv_cache(config, [Paged()], None, torch.device("cpu"))

    assert plan(3).num_pages == 3 * pages_needed(255, 16)
    assert plan(256).num_pages == 8 * pages_needed(255, 16)
    monkeypatch.setattr(kv_sizing, "CPU_DEFAULT_KV_BYTES", 40 * 1024)
    capped = plan(256)
    assert capped.total_bytes == 40 * 1024 and capped.num_pages == 40 - capped.num_scratch_pages
    assert "the CPU default of" in capped.source
