"""The model on a CUDA device: fp32 equals the CPU, bf16 stays close, TP = 2 over gloo on one
GPU equals TP = 1, and a CUDA-graph replay of a decode step equals eager execution."""

from __future__ import annotations

import pytest
import torch

from model_helpers import (PAGES_PER_SLOT, allocate_slots, greedy_generate, make_batch, mixed_reference,
                           mixed_scenario)
from tpspec.mapping import Mapping
from tpspec.model import load_model, make_tiny_checkpoint
from tpspec.testing import run_ranks

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 5, 17, 300, 42, 3], [1, 8, 9, 10, 8, 9, 10, 8], [1, 250, 251]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gpu") / "t", seed=11, tokenizer=False)


def _load(path, mapping=None, dtype=torch.float32):
    m = load_model(path, mapping, device="cuda", dtype=dtype)
    allocate_slots(m, 8)
    return m


def test_fp32_gpu_equals_cpu_and_bf16_is_close(tiny):
    cpu = load_model(tiny)
    allocate_slots(cpu, 8)
    gpu = _load(tiny)
    assert greedy_generate(gpu, PROMPTS, 16) == greedy_generate(cpu, PROMPTS, 16)
    for got, want in zip(mixed_scenario(gpu), mixed_reference(cpu, slot=3)):
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    bf16 = _load(tiny, dtype=torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    prompt = PROMPTS[1]
    ours = bf16(make_batch([(0, 0, prompt)], list(range(len(prompt))))).gather().float().cpu()
    ref = cpu(make_batch([(7, 0, prompt)], list(range(len(prompt))))).gather()
    assert (ours - ref).abs().max() < 0.25 and (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def gpu_tp_worker(rank: int, world: int, path: str) -> list[list[int]]:
    torch.cuda.set_device(0)
    m = _load(path, Mapping(world, rank))
    plain = greedy_generate(m, PROMPTS, 12)
    adp = _load(path, Mapping(world, rank, enable_attention_dp=True, enable_lm_head_tp_in_adp=True))
    mine = list(range(rank, len(PROMPTS), world))
    return [plain, greedy_generate(adp, [PROMPTS[i] for i in mine], 12)]


def test_tp2_over_gloo_on_one_gpu(tiny):
    ref = greedy_generate(_load(tiny), PROMPTS, 12)
    results = run_ranks(gpu_tp_worker, 2, tiny, backend="gloo", timeout_s=300)
    for rank, (plain, adp) in enumerate(results):
        assert plain == ref
        assert adp == [ref[i] for i in range(rank, len(PROMPTS), 2)]


def test_cuda_graph_replay_equals_eager(tiny):
    model = _load(tiny)
    prompts = PROMPTS
    model(make_batch([(s, 0, p) for s, p in enumerate(prompts)]))
    lens = [len(p) for p in prompts]

    def decode_batch(tokens):
        b = make_batch([(s, n, [t]) for s, (n, t) in enumerate(zip(lens, tokens))], list(range(len(prompts))))
        b.token_ids, b.positions, b.logits_rows = b.token_ids.cuda(), b.positions.cuda(), b.logits_rows.cuda()
        return b, model.build_metadata(b, kv_pages=PAGES_PER_SLOT)

    static_batch, static_meta = decode_batch([5, 6, 7])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        model(static_batch, static_meta)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = model(static_batch, static_meta).local
    tokens = [11, 12, 13]
    for _ in range(6):
        new_batch, new_meta = decode_batch(tokens)
        static_batch.token_ids.copy_(new_batch.token_ids)
        static_batch.positions.copy_(new_batch.positions)
        static_meta.copy_(new_meta)
        graph.replay()
        replayed = static_logits.clone()
        eager = model(new_batch, new_meta).local  # rewrites the same cache entries with the same values
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
        tokens = eager.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
