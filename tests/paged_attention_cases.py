"""Checks of the Triton paged attention (``tpspec.model.paged_attention_triton``), run on CUDA
tensors (GPU tests) or on CPU tensors under Triton's interpreter (``python
tests/paged_attention_cases.py kernels|llm DTYPE...`` with ``TRITON_INTERPRET=1`` set before
Triton is imported; each check prints ``<name> <dtype>: ok``).

Every check builds the real :class:`~tpspec.model.batch.AttentionMetadata` and compares with a
float64 reference computed per query row from the cache's own pages.
"""

from __future__ import annotations

import torch

from interpreted import interpreted_main
from tpspec.model import paged_attention_triton as kernels
from tpspec.model.attention import TorchPagedAttention, TritonPagedAttention
from tpspec.model.batch import AttentionMetadata, ForwardBatch, pages_needed
from tpspec.model.kv_cache import KVPages

# (query heads, KV heads, head_dim, page_size): GQA groups 1, 4, 8 and 3 (not a power of two,
# with a head size that is not one either), head sizes 16 (the tiny model), 64 and 128, pages of 16 and 32.
CONFIGS = [(4, 4, 16, 16), (8, 2, 64, 32), (8, 1, 128, 16), (6, 2, 40, 32)]


def scenario(page: int) -> tuple[list[int], list[int]]:
    """(cache_lens, query_lens) of one ragged batch: decode in the middle of a page, decode whose
    sequence ends exactly on a page boundary, verification (4 rows), a prefill chunk over a
    cached prefix, a first chunk of exactly one page, and a long decode that spreads over splits."""
    return [37, 2 * page - 1, 50, 20, 0, 5 * page + 3], [1, 1, 4, 23, page, 1]


def decode_scenario(page: int) -> tuple[list[int], list[int]]:
    """(cache_lens, query_lens) of a step with decode and verification rows only (the launch's
    short-query tiles): a decode ending on a page boundary, decodes and verifications over
    several KV tiles, one ending mid-tile."""
    return [2 * page - 1, 37, 300, 5 * page + 3, 129], [1, 4, 1, 4, 1]


def long_scenario(page: int) -> tuple[list[int], list[int]]:
    """(cache_lens, query_lens) of decode and verification rows over long caches (the launch's
    pipelined tile loop where a split spans ``PIPELINED_SPLIT_LEN`` positions or more), with a
    short decode ending on a page boundary beside them."""
    return [2100, 2 * page - 1, 1030], [1, 1, 4]


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


class Case:
    """Random pages, shuffled block tables and queries for one config and scenario."""

    def __init__(self, config: tuple[int, int, int, int], device: str, dtype: torch.dtype, seed: int = 0,
                 lens: tuple[list[int], list[int]] | None = None) -> None:
        self.heads, self.kv_heads, self.head_dim, self.page = config
        self.cache_lens, self.query_lens = lens or scenario(self.page)
        gen = torch.Generator().manual_seed(seed)
        used = [pages_needed(c + q, self.page) for c, q in zip(self.cache_lens, self.query_lens)]
        num_pages = sum(used) + 3
        perm = torch.randperm(num_pages, generator=gen).tolist()
        self.tables, at = [], 0
        for u in used:
            self.tables.append(perm[at : at + u])
            at += u
        shape = (num_pages, self.page, self.kv_heads, self.head_dim)
        self.k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        self.v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        n = sum(self.query_lens)
        self.q = torch.randn(n, self.heads, self.head_dim, generator=gen).to(device=device, dtype=dtype)
        self.scale = self.head_dim**-0.5
        self.device, self.dtype = device, dtype

    def meta(self, extra_pages: int = 0) -> AttentionMetadata:
        """The step's metadata; ``extra_pages`` widens the page table past the longest sequence (a graph's bucket)."""
        n = sum(self.query_lens)
        batch = ForwardBatch(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), self.tables,
                             self.cache_lens, self.query_lens)
        widest = max(len(t) for t in self.tables)
        return AttentionMetadata.build(batch, self.device, self.page, widest + extra_pages)

    def run(self, num_splits: int | None = None, extra_pages: int = 0) -> torch.Tensor:
        meta = self.meta(extra_pages)
        starts = kernels.sequence_starts(meta.tok_seq, meta.num_seqs)
        return kernels.paged_attention(self.q, self.k, self.v, meta.page_table, starts, meta.tok_visible, self.scale,
                                       q_max=meta.q_max, num_splits=num_splits)

    def reference(self) -> torch.Tensor:
        """Float64: row ``i`` of sequence ``b`` against positions ``[0, cache_len + i]`` of its pages."""
        group = self.heads // self.kv_heads
        flat_k = self.k.view(-1, self.kv_heads, self.head_dim).double()
        flat_v = self.v.view(-1, self.kv_heads, self.head_dim).double()
        out, t = [], 0
        for table, c, n in zip(self.tables, self.cache_lens, self.query_lens):
            rows = torch.tensor([table[p // self.page] * self.page + p % self.page for p in range(c + n)],
                                device=self.device)
            keys = flat_k[rows].repeat_interleave(group, 1)  # [L, H, hd]
            values = flat_v[rows].repeat_interleave(group, 1)
            for i in range(n):
                scores = torch.einsum("hd,lhd->hl", self.q[t].double(), keys[: c + i + 1]) * self.scale
                out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values[: c + i + 1]))
                t += 1
        return torch.stack(out)


def check_kernels(device: str, dtype: torch.dtype) -> None:
    """Every config's ragged batch, a step of decode and verification rows only (the launch's
    short-query tiles), and one over long caches (their pipelined tile loop, in one split and in
    two), against the float64 reference: the automatic launch (one split on CPU), one split (on
    CUDA, where the automatic launch splits this small batch), and several splits (two and
    five) over a page table wider than the batch reads."""
    variants = [(None, 0), (2, 3), (5, 1)] + ([(1, 0)] if device != "cpu" else [])
    for config in CONFIGS:
        page = config[3]
        long_launch = kernels.plan_launch(num_tokens=6, num_seqs=3, q_max=4, kv_pages=2100 // page + 4,
                                          page_size=page, num_heads=config[0], kv_heads=config[1],
                                          head_dim=config[2], device="cpu", num_splits=2)
        assert long_launch.num_stages > 1 or long_launch.block_m > kernels.SMALL_BLOCK_M
        for lens, tried in ((None, variants), (decode_scenario(page), variants[:2]),
                            (long_scenario(page), [(1, 0), (2, 3)] + ([(None, 0)] if device != "cpu" else []))):
            case = Case(config, device, dtype, lens=lens)
            want = case.reference()
            for splits, extra in tried:
                got = case.run(splits, extra)
                assert got.dtype == dtype and got.shape == case.q.shape
                err = (got.double() - want).abs().max().item()
                assert err < _tolerance(dtype), f"config {config}, lens {lens}, splits {splits}: max error {err}"


def check_rotary_in_the_kernel(device: str, dtype: torch.dtype) -> None:
    """``paged_attention_qkv`` (rotary and the K/V write inside the attention kernel) against
    ``rotary_and_write_kv`` followed by ``paged_attention``, bit for bit, the output and both pages
    (every row, not only the written ones): every config, a step of decode and verification rows
    (one of them across a KV tile, and with three splits across two splits) and one over long caches,
    one split and several over a page table wider than the batch reads; a step whose rows do not fit
    one query block is refused, pointing to the two kernels."""
    from tpspec.model import fused_triton

    for index, config in enumerate(CONFIGS):
        heads, kv_heads, head_dim, page = config
        # Verification rows at positions 126..129 cross a 128-position tile, and with 3 splits a split.
        crossing = ([2 * page - 1, 37, 126, 5 * page + 3], [1, 4, 4, 1])
        for lens, tried in ((crossing, [(1, 0), (3, 2), (None, 1)]), (long_scenario(page), [(2, 0)])):
            case = Case(config, device, dtype, seed=index, lens=lens)
            n = sum(case.query_lens)
            gen = torch.Generator().manual_seed(100 + index)
            qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device=device, dtype=dtype)
            angles = torch.rand(n, head_dim // 2, generator=gen) * 6.3
            cos = torch.cat([angles.cos()] * 2, -1).to(device=device, dtype=dtype)
            sin = torch.cat([angles.sin()] * 2, -1).to(device=device, dtype=dtype)
            for splits, extra in tried:
                meta = case.meta(extra)
                starts = kernels.sequence_starts(meta.tok_seq, meta.num_seqs)
                k_want, v_want = case.k.clone(), case.v.clone()
                q = fused_triton.rotary_and_write_kv(qkv, cos, sin, meta.write_index, k_want, v_want, heads, kv_heads,
                                                     head_dim)
                want = kernels.paged_attention(q, k_want, v_want, meta.page_table, starts, meta.tok_visible, case.scale,
                                               q_max=meta.q_max, num_splits=splits)
                k_got, v_got = case.k.clone(), case.v.clone()
                got = kernels.paged_attention_qkv(qkv, cos, sin, k_got, v_got, meta.page_table, starts,
                                                  meta.tok_visible, case.scale, num_heads=heads, q_max=meta.q_max,
                                                  num_splits=splits)
                what = f"config {config}, lens {lens}, splits {splits}"
                assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want), what
                assert torch.equal(got, want), f"{what}: max difference {(got.double() - want.double()).abs().max()}"
    case = Case(CONFIGS[2], device, dtype)  # group 8: the ragged batch's prefill chunk spans query blocks
    meta = case.meta()
    heads, kv_heads, head_dim, _ = CONFIGS[2]
    n = sum(case.query_lens)
    qkv = torch.zeros(n, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    cos = torch.zeros(n, head_dim, device=device, dtype=dtype)
    assert not kernels.fits_one_query_block(q_max=meta.q_max, num_heads=heads, kv_heads=kv_heads)
    try:
        kernels.paged_attention_qkv(qkv, cos, cos, case.k, case.v, meta.page_table,
                                    kernels.sequence_starts(meta.tok_seq, meta.num_seqs), meta.tok_visible, case.scale,
                                    num_heads=heads, q_max=meta.q_max)
    except ValueError as exc:
        assert "rotary_and_write_kv, then paged_attention" in str(exc), exc
    else:
        raise AssertionError("a prefill chunk past one query block was accepted")


def check_backend(device: str, dtype: torch.dtype) -> None:
    """The ``triton`` backend through ``bind`` / ``attend`` gives the torch backend's result (an
    empty step too), and the launch rule splits a lone long decode but not a full batch."""
    heads, kv_heads, head_dim, page = CONFIGS[1]
    case = Case(CONFIGS[1], device, dtype, seed=1)
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=case.scale, dtype=dtype,
              device=torch.device(device))
    triton_attn, torch_attn = TritonPagedAttention(**kw), TorchPagedAttention(**kw)
    pages = KVPages(1, 1, 1, 1, dtype=dtype, device=device)
    pages.k, pages.v = case.k, case.v
    meta = case.meta(extra_pages=2)
    triton_attn.plan(meta)
    got = triton_attn.bind(meta)(case.q, pages)
    want = torch_attn.bind(meta)(case.q, pages)
    err = (got.double() - want.double()).abs().max().item()
    assert err < 2 * _tolerance(dtype), f"triton vs torch backend: max error {err}"
    empty = ForwardBatch(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), [], [], [])
    q0 = case.q[:0]
    assert triton_attn.bind(AttentionMetadata.build(empty, device, page))(q0, pages).shape == q0.shape
    lone = kernels.plan_launch(num_tokens=1, num_seqs=1, q_max=1, kv_pages=256, page_size=16, num_heads=32,
                               kv_heads=8, head_dim=128, device=device)
    full = kernels.plan_launch(num_tokens=4096, num_seqs=4096, q_max=1, kv_pages=256, page_size=16, num_heads=32,
                               kv_heads=8, head_dim=128, device=device)
    assert full.num_splits == 1 and lone.block_m == 16 and lone.q_blocks == 1
    assert lone.num_splits > 1 or device == "cpu"  # the interpreter has no SMs to fill


def _tiny_greedy_hf(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import transformers

    from tpspec.runtime.llm import resolve_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny")).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt):])
    return outs


def check_llm(device: str, dtype: torch.dtype) -> None:
    """``LLM("tiny", attention_backend="triton")``, greedy: at TP 1 with n-gram drafts (prefill
    and verification steps) and at TP 2 without (prefill and decode steps), the tokens of the
    torch backend and, in float32, of Hugging Face transformers' greedy loop."""
    from tpspec import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7], list(range(3, 43)), [7]]
    steps = 8
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    tokens = {}
    for backend, tp, spec in (("torch", 1, ngram), ("triton", 1, ngram), ("triton", 2, None)):
        with LLM("tiny", tensor_parallel_size=tp, device=device, dtype=name, attention_backend=backend,
                 speculative_config=spec, max_num_seqs=len(prompts)) as llm:
            tokens[backend, tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton", 1] == tokens["torch", 1], tokens
    assert tokens["triton", 2] == tokens["torch", 1], tokens
    if dtype == torch.float32:
        assert tokens["torch", 1] == _tiny_greedy_hf(prompts, steps), tokens


def check_engine_rotary_inside(device: str, dtype: torch.dtype) -> None:
    """The tiny model's engine with its layers' fused kernels and the ``triton`` backend, greedy, with
    n-gram drafts (prefill, then verification steps of four rows) and without (decode steps of one
    row): the tokens with ``FUSED_ROTARY`` on equal those with it off, and with it on the kernel ran
    rotary inside at one and four rows, never for a prefill chunk past one query block."""
    import tempfile

    from tpspec.mapping import Mapping
    from tpspec.model import attention as attention_mod
    from tpspec.model import layers as layers_mod
    from tpspec.model.tiny import make_tiny_checkpoint
    from tpspec.runtime.config import EngineConfig, Request, SpeculativeConfig
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    fused_rows: set[int] = set()
    original = kernels.paged_attention_qkv

    def counting(qkv, *args, **kwargs):
        fused_rows.add(kwargs["q_max"])
        return original(qkv, *args, **kwargs)

    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    greedy = SamplingParams(temperature=0.0)
    requests = [Request(0, (5, 6, 7, 8, 9, 10, 5, 6, 7), greedy, 10), Request(1, tuple(range(3, 43)), greedy, 6),
                Request(2, (7,), greedy, 5)]
    tokens = {}
    saved = layers_mod.FUSED_UNDER_INTERPRETER, attention_mod.FUSED_ROTARY
    layers_mod.FUSED_UNDER_INTERPRETER = True
    kernels.paged_attention_qkv = counting
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = str(make_tiny_checkpoint(f"{tmp}/tiny", seed=0))
            for spec in (SpeculativeConfig("ngram", 3), None):
                for on in (False, True):
                    attention_mod.FUSED_ROTARY = on
                    config = EngineConfig(ckpt, 1, device, name, speculative=spec, max_batch_size=4,
                                          attention_backend="triton", use_cuda_graphs=device == "cuda",
                                          gpu_memory_utilization=0.2 if device == "cuda" else None)
                    before = set(fused_rows)
                    fused_rows.clear()
                    engine = Engine(config, Mapping(), device)
                    try:
                        tokens[spec is not None, on] = [r.token_ids for r in engine.generate(requests)]
                    finally:
                        engine.close()
                    assert on or not fused_rows, fused_rows
                    fused_rows.update(before)
    finally:
        layers_mod.FUSED_UNDER_INTERPRETER, attention_mod.FUSED_ROTARY = saved
        kernels.paged_attention_qkv = original
    assert {1, 4} <= fused_rows and max(fused_rows) <= 4, fused_rows
    for spec in (True, False):
        assert tokens[spec, True] == tokens[spec, False], (spec, tokens)


CHECKS = {"kernels": [check_kernels, check_rotary_in_the_kernel, check_backend],
          "llm": [check_llm, check_engine_rotary_inside]}


if __name__ == "__main__":
    interpreted_main(CHECKS, kernels)
