"""The EAGLE-3 drafter: the sharded head against an EAGLE-3 forward written here in plain, unsharded
torch from the checkpoint layout (over the target's hidden states from transformers), at TP 1 and 2;
the engine's drafts step by step against the same reference; bad checkpoints; conversion from
``pytorch_model.bin``; the ``make-tiny-model --eagle3`` command; and the layout of a public head
(Llama 3.1 8B's, names, shapes and dtypes written here) loading at full size and, shrunk, drafting
like the reference."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tpspec.mapping import Mapping
from tpspec.model import CheckpointError, ForwardBatch, load_model
from tpspec.model.eagle3 import Eagle3Drafter
from tpspec.model.eagle3_convert import convert_eagle3_checkpoint
from tpspec.model.tiny import make_tiny_checkpoint, make_tiny_eagle3_head
from tpspec.testing import run_ranks

K = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7, 8], [42, 43]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_tiny_checkpoint(root / "tiny", seed=0)
    head = make_tiny_eagle3_head(root / "head", target, seed=1)
    return str(target), str(head)


# ------------------------------------------------------------------ the plain reference
class ReferenceEagle3:
    """EAGLE-3 drafting in plain torch from the checkpoint layout: the target's hidden states from
    transformers (``hidden_states[i]`` is the input of layer ``i``), the head's tensors as stored."""

    def __init__(self, target_dir: str, head_dir: str) -> None:
        from transformers import LlamaForCausalLM

        self.target = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
        with open(os.path.join(head_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = {k: (v.to(torch.float32) if v.is_floating_point() else v)
                  for k, v in load_file(os.path.join(head_dir, "model.safetensors")).items()}

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * self.w[name]

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        hd = x.shape[-1]
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = pos.to(torch.float32)[:, None] * inv[None, :]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + rotated * sin

    def _layer(self, tokens: list[int], hidden: torch.Tensor, pos: torch.Tensor, past: list) -> torch.Tensor:
        c, w = self.cfg, self.w
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        emb = self._rms(self.target.model.embed_tokens.weight[torch.tensor(tokens)], "midlayer.input_layernorm.weight")
        x = torch.cat([emb, self._rms(hidden, "midlayer.hidden_norm.weight")], -1)
        q = self._rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, nh, hd), pos)
        k = self._rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, nkv, hd), pos)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        past.append((k, v, pos))
        keys = torch.cat([p[0] for p in past]).repeat_interleave(nh // nkv, dim=1)
        values = torch.cat([p[1] for p in past]).repeat_interleave(nh // nkv, dim=1)
        kpos = torch.cat([p[2] for p in past])
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(hd)
        scores = scores.masked_fill(kpos[None, None, :] > pos[None, :, None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(len(tokens), nh * hd)
        h = hidden + attn @ w["midlayer.self_attn.o_proj.weight"].T
        y = self._rms(h, "midlayer.post_attention_layernorm.weight")
        mlp = (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)) \
            @ w["midlayer.mlp.down_proj.weight"].T
        return h + mlp

    @torch.no_grad()
    def drafts(self, history: list[int], k: int) -> list[int]:
        """The ``k`` greedy chained drafts (target ids) after ``history``."""
        states = self.target(torch.tensor([history]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in self.cfg["eagle_aux_hidden_state_layer_ids"]], -1)
        n, past, out = len(history), [], []
        last = self._layer(history[1:], aux[:-1] @ self.w["fc.weight"].T, torch.arange(n - 1), past)[-1:]
        for j in range(k):
            draft = int((self._rms(last, "norm.weight") @ self.w["lm_head.weight"].T).argmax())
            out.append(draft + int(self.w["d2t"][draft]))
            if j + 1 < k:
                last = self._layer([out[-1]], last, torch.tensor([n - 1 + j]), past)
        return out


@pytest.fixture(scope="module")
def reference(ckpt):
    return ReferenceEagle3(*ckpt)


# ------------------------------------------------------------------ the sharded drafter
def _draft_prompts(rank: int, world: int, target_dir: str, head_dir: str, prompts: list[list[int]], k: int,
                   adp: bool = False):
    """Prefill every prompt through the target, then draft ``k`` tokens per prompt with the head (under
    attention DP every rank runs the same prompts as its own batch, the head split over the stacked rows)."""
    model = load_model(target_dir, Mapping(world, rank, enable_attention_dp=adp, enable_lm_head_tp_in_adp=adp))
    head = Eagle3Drafter(head_dir, model)
    model.allocate_kv_cache(8 * len(prompts), 8)  # the target and the head share the block tables
    head.allocate_kv_cache(8 * len(prompts), 8)
    slots = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    model(ForwardBatch(torch.tensor([t for p in prompts for t in p]),
                      torch.tensor([i for p in prompts for i in range(len(p))]),
                      slots, [0] * len(prompts), [len(p) for p in prompts]))
    aux = model.aux_hidden_states
    keep = torch.cat([torch.arange(len(p) - 1) + sum(len(q) for q in prompts[:i]) for i, p in enumerate(prompts)])
    lens = [len(p) - 1 for p in prompts]
    batch = ForwardBatch(torch.tensor([t for p in prompts for t in p[1:]]),
                         torch.tensor([i for p in prompts for i in range(len(p) - 1)]), slots, [0] * len(prompts), lens)
    cur, out = head.greedy_drafts(batch, aux.index_select(0, keep))
    drafts = [cur]
    for j in range(1, k):
        at = [len(p) - 2 + j for p in prompts]
        cur, out = head.greedy_drafts(ForwardBatch(cur, torch.tensor(at), slots, at, [1] * len(prompts)), out)
        drafts.append(cur)
    return torch.stack(drafts, 1).tolist()


@pytest.mark.parametrize("tp,adp", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-adp-head-tp"])
def test_sharded_drafter_equals_plain_torch_reference(ckpt, reference, tp, adp):
    got = run_ranks(_draft_prompts, tp, *ckpt, PROMPTS, K, adp, timeout_s=120)
    want = [reference.drafts(p, K) for p in PROMPTS]
    assert all(r == want for r in got), f"tp={tp}: sharded {got[0]} != reference {want}"
    # The drafts are target ids from the draft vocabulary (the map was applied).
    t2d = load_file(os.path.join(ckpt[1], "model.safetensors"))["t2d"]
    assert all(bool(t2d[t]) for row in want for t in row)


def test_draft_vocabulary_in_one_target_shard(ckpt, tmp_path):
    """A draft vocabulary of target ids 0..130 only: at TP 2 rank 1 holds no head row at all."""
    tensors = load_file(os.path.join(ckpt[1], "model.safetensors"))
    vd = 131
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[:vd] = True
    head = _broken_head(ckpt[1], tmp_path / "low", config={"draft_vocab_size": vd}, replace={
        "d2t": torch.zeros(vd, dtype=torch.int64), "t2d": t2d,
        "lm_head.weight": tensors["lm_head.weight"][:vd].contiguous()})
    want = [ReferenceEagle3(ckpt[0], head).drafts(p, K) for p in PROMPTS]
    got = run_ranks(_draft_prompts, 2, ckpt[0], head, PROMPTS, K, timeout_s=120)
    assert got == [want, want] and all(t < vd for row in want for t in row)


def _engine_drafts(rank: int, world: int, target_dir: str, head_dir: str, adp: bool):
    """Generate with the engine, forced to accept 1.5 drafts a step; record each drafting's inputs."""
    from tpspec.runtime.config import EngineConfig, Request, SpeculativeConfig
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    spec = SpeculativeConfig("eagle3", num_speculative_tokens=3, model=head_dir)
    cfg = EngineConfig(model_path=target_dir, tp_size=world, device="cpu", dtype="float32", attention_dp=adp,
                       speculative=spec, draft_model_path=head_dir, max_batch_size=2, max_seq_len=64,
                       max_num_tokens=16, forced_acceptance_rate=1.5)
    engine = Engine(cfg, Mapping(world, rank, enable_attention_dp=adp))
    trace = []
    inner = engine._draft_with_eagle3

    def spy(gen):  # record (history, drafts) of every request drafted for
        drafts = inner(gen)
        trace.extend((list(s.tokens), d) for s, d in zip(gen, drafts))
        return drafts

    engine._draft_with_eagle3 = spy
    reqs = [Request(i, tuple(p), SamplingParams(temperature=0.0), 10) for i, p in enumerate(PROMPTS)]
    results = engine.generate(reqs)
    return trace, [r.token_ids for r in results], [r.stats.accepted_drafts_per_step for r in results]


@pytest.mark.parametrize("tp,adp", [(1, False), (2, True)], ids=["tp1", "tp2-adp"])
def test_engine_drafts_equal_reference_at_every_step(ckpt, reference, tp, adp):
    """Chunked context (16-token budget), slot reuse (3 prompts, 2 slots), 0-3 forced acceptances:
    the head's catch-up of the target's hidden states keeps its drafts equal to drafting afresh."""
    results = run_ranks(_engine_drafts, tp, *ckpt, adp, timeout_s=180)
    trace = [step for r in results for step in r[0]]  # under attention DP each rank drafts its own requests
    assert len(trace) >= 12
    assert any(a >= 2 for r in results for per_req in r[2] for a in per_req), "forcing never kept 2 drafts"
    for history, drafts in trace:
        assert drafts == reference.drafts(history, 3), f"drafts after {history}"


# ------------------------------------------------------------------ bad checkpoints
def _broken_head(src: str, dst, *, drop: str | None = None, replace: dict | None = None, config: dict | None = None):
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if drop:
        del tensors[drop]
    tensors.update(replace or {})
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(dict(cfg, **(config or {})), f)
    return str(dst)


def test_bad_heads_raise_checkpoint_error_naming_the_problem(ckpt, tmp_path):
    target_dir, head_dir = ckpt
    model = load_model(target_dir)
    d2t = load_file(os.path.join(head_dir, "model.safetensors"))["d2t"]
    fc = load_file(os.path.join(head_dir, "model.safetensors"))["fc.weight"]
    not_increasing = d2t.clone()
    not_increasing[5] = d2t[4] - 1  # draft id 5 maps to target id d2t[4] + 4, as draft id 4 does
    out_of_range = d2t.clone()
    out_of_range[-1] = 10_000
    cases = [
        (dict(drop="midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight"),
        (dict(drop="d2t"), "'d2t'"),
        (dict(replace={"fc.weight": fc[:, :-1].contiguous()}), "fc.weight"),
        (dict(replace={"d2t": not_increasing}), "strictly increasing"),
        (dict(replace={"d2t": out_of_range}), "outside the target's vocabulary"),
        (dict(replace={"d2t": d2t.to(torch.float32)}), "integer"),
        (dict(replace={"t2d": torch.zeros(512, dtype=torch.bool)}), "'t2d'"),
        (dict(config={"hidden_size": 64}), "hidden_size=64"),
        (dict(config={"num_hidden_layers": 2}), "num_hidden_layers"),
        (dict(config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), "eagle_aux_hidden_state_layer_ids"),
        (dict(config={"eagle_aux_hidden_state_layer_ids": None}), "eagle_aux_hidden_state_layer_ids"),
    ]
    for i, (kw, needle) in enumerate(cases):
        bad = _broken_head(head_dir, tmp_path / f"bad{i}", **kw)
        with pytest.raises(CheckpointError, match=needle.replace("[", r"\[")):
            Eagle3Drafter(bad, model)
    assert model.aux_layer_ids == ()  # a failed head leaves the target as it was


def test_llm_refuses_a_bad_vocabulary_map_in_the_driver_and_names_a_missing_weight(ckpt, tmp_path, monkeypatch):
    """Through ``LLM``: a config that does not fit, a corrupt file or a bad ``d2t`` / ``t2d`` raise
    ``CheckpointError`` in the driver, before any worker starts; a missing weight is found by the
    ranks as they load it, and the driver's ``WorkerError`` names it."""
    from tpspec import LLM
    from tpspec.runtime import WorkerError
    from tpspec.runtime import launchers

    target_dir, head_dir = ckpt
    d2t = load_file(os.path.join(head_dir, "model.safetensors"))["d2t"]
    not_increasing = d2t.clone()
    not_increasing[5] = d2t[4] - 1

    def spec(head: str) -> dict:
        return {"method": "eagle3", "model": head, "num_speculative_tokens": 2}

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    with monkeypatch.context() as m:
        m.setattr(launchers, "make_executor", no_workers)
        m.setattr("tpspec.runtime.llm.make_executor", no_workers)
        for i, (kw, needle) in enumerate([(dict(replace={"d2t": not_increasing}), "strictly increasing"),
                                          (dict(replace={"t2d": torch.zeros(512, dtype=torch.bool)}), "'t2d'"),
                                          (dict(config={"hidden_size": 64}), "hidden_size=64")]):
            bad = _broken_head(head_dir, tmp_path / f"driver{i}", **kw)
            with pytest.raises(CheckpointError, match=needle):
                LLM(target_dir, speculative_config=spec(bad))
        corrupt = _broken_head(head_dir, tmp_path / "corrupt")
        with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) - 100)
        with pytest.raises(CheckpointError, match="model.safetensors"):
            LLM(target_dir, speculative_config=spec(corrupt))
    missing = _broken_head(head_dir, tmp_path / "missing", drop="midlayer.hidden_norm.weight")
    with pytest.raises(WorkerError, match="midlayer.hidden_norm.weight"):
        LLM(target_dir, speculative_config=spec(missing))


def test_tiny_head_layout_and_cli(tmp_path):
    from tpspec.cli import main

    assert main(["make-tiny-model", str(tmp_path / "t"), "--eagle3", str(tmp_path / "h")]) == 0
    tensors = load_file(str(tmp_path / "h" / "model.safetensors"))
    with open(tmp_path / "h" / "config.json") as f:
        cfg = json.load(f)
    h, vd = cfg["hidden_size"], cfg["draft_vocab_size"]
    assert tensors["fc.weight"].shape == (h, 3 * h)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert tensors["lm_head.weight"].shape == (vd, h) and vd < cfg["vocab_size"]
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert cfg["num_hidden_layers"] == 1


def test_convert_from_pytorch_bin(ckpt, tmp_path):
    target_dir, head_dir = ckpt
    tensors = load_file(os.path.join(head_dir, "model.safetensors"))
    src = tmp_path / "bin"
    src.mkdir()
    tensors["tied.view"] = tensors["norm.weight"]  # shared storage in the pickle
    torch.save(tensors, src / "pytorch_model.bin")
    with open(os.path.join(head_dir, "config.json")) as f, open(src / "config.json", "w") as g:
        g.write(f.read())
    from tpspec.cli import main

    assert main(["convert-eagle3", str(src), str(tmp_path / "st")]) == 0
    back = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    model = load_model(target_dir)
    assert Eagle3Drafter(str(tmp_path / "st"), model).draft_to_target.equal(tensors["d2t"])
    # Only plain tensors are read: a pickle carrying an object is refused, not executed.
    torch.save({"fc.weight": tensors["fc.weight"], "obj": Mapping()}, src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="plain tensors"):
        convert_eagle3_checkpoint(src, tmp_path / "st2")


def test_head_is_a_paged_model_the_engine_can_size(ckpt):
    """The KV sizing profiles every paged model with one large step: the head takes it too."""
    from types import SimpleNamespace

    from tpspec.runtime.kv_sizing import _profile_step

    model = load_model(ckpt[0])
    head = Eagle3Drafter(ckpt[1], model)
    assert head.page_bytes(16) * model.config.num_layers == model.page_bytes(16)  # one layer of the same shape
    _profile_step(head, SimpleNamespace(max_num_tokens=40, page_size=16, max_batch_size=2, num_draft_tokens=3))
    assert head.caches and head.num_pages == 3


# ------------------------------------------------------------------ a public head's layout
# The EAGLE-3 head for Llama 3.1 8B Instruct as SafeAILab publishes it (EAGLE3-LLaMA3.1-Instruct-8B):
# its config.json (the fields of SafeAILab/EAGLE's eagle/traineagle3/config.json, under the head's
# architecture name) and the names, shapes and dtypes of its tensors (the state dict of EAGLE's
# EAGLE-3 model in eagle/model/cnets.py: fc, the one decoder layer "midlayer" whose attention reads
# [embedding, hidden] of width 2H, norm, lm_head over 32000 draft ids, the d2t / t2d buffers; no
# token embedding: the target's is used). Written here by hand, never by tpspec's own writer.
PUBLIC_EAGLE3_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "draft_vocab_size": 32000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 1, "num_key_value_heads": 8, "pad_token_id": 0, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
    "vocab_size": 128256,
}
PUBLIC_EAGLE3_TENSORS = {
    "fc.weight": ((4096, 12288), "F16"),
    "midlayer.hidden_norm.weight": ((4096,), "F16"),
    "midlayer.input_layernorm.weight": ((4096,), "F16"),
    "midlayer.post_attention_layernorm.weight": ((4096,), "F16"),
    "midlayer.self_attn.q_proj.weight": ((4096, 8192), "F16"),
    "midlayer.self_attn.k_proj.weight": ((1024, 8192), "F16"),
    "midlayer.self_attn.v_proj.weight": ((1024, 8192), "F16"),
    "midlayer.self_attn.o_proj.weight": ((4096, 4096), "F16"),
    "midlayer.mlp.gate_proj.weight": ((14336, 4096), "F16"),
    "midlayer.mlp.up_proj.weight": ((14336, 4096), "F16"),
    "midlayer.mlp.down_proj.weight": ((4096, 14336), "F16"),
    "norm.weight": ((4096,), "F16"),
    "lm_head.weight": ((32000, 4096), "F16"),
    "d2t": ((32000,), "I64"),
    "t2d": ((128256,), "BOOL"),
}
_SAFETENSORS_DTYPES = {"F16": (torch.float16, 2), "I64": (torch.int64, 8), "BOOL": (torch.bool, 1)}


def _public_d2t_t2d(draft_vocab: int, vocab: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A valid draft vocabulary for the layout: every ``stride``-th target id."""
    ids = torch.arange(draft_vocab, dtype=torch.int64) * stride
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab), t2d


def _write_sparse_safetensors(path: str, tensors: dict, data: dict[str, torch.Tensor]) -> None:
    """A safetensors file declaring ``tensors`` (name -> (shape, dtype name)) whose bytes are zero
    except ``data``'s: the header written by hand, the zeros left as a hole (a sparse file), so a
    full-size checkpoint costs no disk."""
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        size = math.prod(shape) * _SAFETENSORS_DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        start = 8 + len(blob)
        for name, t in data.items():
            f.seek(start + header[name]["data_offsets"][0])
            f.write(t.contiguous().numpy().tobytes())
        f.truncate(start + offset)


def test_public_eagle3_head_layout_loads_at_full_size(tmp_path):
    """The public Llama 3.1 8B head's names, shapes and dtypes, at full size (zeros in a sparse
    file), load into a head for the Llama 3 8B shape (on the meta device: nothing is kept): every
    tensor of the layout is read, under the name and with the shape the loader derives from the
    config, and the default aux layers of a 32-layer target apply."""
    from tpspec.model.llama import TPLlamaForCausalLM
    from tpspec.model.shapes import shape_config

    d2t, t2d = _public_d2t_t2d(32000, 128256, 4)
    _write_sparse_safetensors(str(tmp_path / "model.safetensors"), PUBLIC_EAGLE3_TENSORS, {"d2t": d2t, "t2d": t2d})
    (tmp_path / "config.json").write_text(json.dumps(PUBLIC_EAGLE3_CONFIG))
    target = TPLlamaForCausalLM(shape_config("llama-3-8b"), None, device="meta", dtype=torch.float16)
    head = Eagle3Drafter(tmp_path, target)
    read = {spec.name: spec.full_shape for _, _, specs in head.shard_plan() for spec in specs}
    want = {name: shape for name, (shape, _) in PUBLIC_EAGLE3_TENSORS.items() if name not in ("d2t", "t2d")}
    assert {name: tuple(shape) for name, shape in read.items()} == want
    assert head.load_stats.bytes_read == sum(math.prod(s) * 2 for s in want.values())
    assert head.config.aux_layer_ids == (2, 16, 29) and target.aux_layer_ids == (2, 16, 29)


def test_public_eagle3_head_layout_drafts_like_the_reference(tmp_path):
    """The same layout shrunk (every dimension mapped to a small one, the names, dtypes and the
    relations between dimensions kept: 3H, 2H, heads x head_dim) beside a tiny target of the shrunk
    shape: the head loads from float16 and drafts what the plain-torch reference computes from the
    stored tensors."""
    small = {4096: 64, 12288: 192, 8192: 128, 1024: 16, 14336: 224, 32000: 128, 128256: 512}
    target_dir = make_tiny_checkpoint(tmp_path / "target", seed=3, vocab_size=512, hidden_size=64,
                                      intermediate_size=224, num_layers=8, num_heads=4, num_kv_heads=1)
    gen = torch.Generator().manual_seed(4)
    d2t, t2d = _public_d2t_t2d(128, 512, 4)
    tensors = {}
    for name, (shape, dtype) in PUBLIC_EAGLE3_TENSORS.items():
        shape = tuple(small[d] for d in shape)
        if name == "d2t":
            tensors[name] = d2t
        elif name == "t2d":
            tensors[name] = t2d
        elif name.endswith("norm.weight"):
            tensors[name] = (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(torch.float16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(torch.float16)
        assert tensors[name].dtype == _SAFETENSORS_DTYPES[dtype][0] and tuple(tensors[name].shape) == shape
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    save_file(tensors, str(head_dir / "model.safetensors"))
    config = dict(PUBLIC_EAGLE3_CONFIG, hidden_size=64, intermediate_size=224, num_attention_heads=4,
                  num_key_value_heads=1, draft_vocab_size=128, vocab_size=512)
    (head_dir / "config.json").write_text(json.dumps(config))
    got = _draft_prompts(0, 1, str(target_dir), str(head_dir), PROMPTS, K)
    reference = ReferenceEagle3(str(target_dir), str(head_dir))
    # What the published config leaves out takes its defaults: head_dim H / heads, rope_theta
    # 10000, the aux layers (2, L // 2, L - 3) of the 8-layer target.
    reference.cfg.update(head_dim=16, rope_theta=10000.0, eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    assert got == [reference.drafts(p, K) for p in PROMPTS]
    assert all(bool(t2d[t]) for row in got for t in row)
