"""The paged KV cache on a GPU (marker ``gpu``): FlashInfer's paged kernels against the torch
path on a real model shape, and an engine sized by ``gpu_memory_utilization`` whose graphed
steps (page-bucketed attention) give the CPU engine's tokens."""

from __future__ import annotations

import pytest
import torch

from model_helpers import assert_shape_logits_match_torch_backend
from tpspec.mapping import Mapping
from tpspec.model.tiny import make_tiny_checkpoint
from tpspec.runtime.config import EngineConfig, Request, SpeculativeConfig
from tpspec.runtime.engine import Engine
from tpspec.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7], [42] * 12, list(range(3, 43)), [7]]


def test_flashinfer_paged_attention_matches_torch_path():
    pytest.importorskip("flashinfer")
    assert_shape_logits_match_torch_backend("flashinfer")


def test_engine_sized_by_gpu_memory_utilization_matches_cpu(tmp_path):
    ckpt = str(make_tiny_checkpoint(tmp_path / "tiny", seed=0))
    requests = [Request(i, tuple(p), SamplingParams(temperature=0.0), 16) for i, p in enumerate(PROMPTS)]
    spec = SpeculativeConfig("ngram", 3)
    cpu = Engine(EngineConfig(ckpt, 1, "cpu", "float32", speculative=spec, max_batch_size=4), Mapping())
    want = [r.token_ids for r in cpu.generate(requests)]
    gpu = Engine(EngineConfig(ckpt, 1, "cuda", "float32", speculative=spec, max_batch_size=4,
                              gpu_memory_utilization=0.2), Mapping(), "cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    assert gpu.kv.num_pages > 0 and gpu.kv.total_bytes < 0.2 * total
    assert [r.token_ids for r in gpu.generate(requests)] == want
    assert gpu.graphs is not None and gpu.graphs.graphs  # graphed steps ran, keyed by page bucket
    assert gpu.pages.num_free == gpu.pages.num_pages
    gpu.close()
