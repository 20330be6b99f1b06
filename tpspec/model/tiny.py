"""Tiny Llama checkpoints in Hugging Face format (no download, ever), and the
``tpspec make-tiny-model DIR`` command that writes one.

:func:`make_trained_tiny_checkpoint` is the embedded default model (``LLM("tiny")``): the
shape below, trained briefly (120 small AdamW steps) on the few kilobytes of English text shipped in
``tpspec/model/data/tiny_corpus.txt``, with a BPE tokenizer learned from the same text in
which every id decodes to printable text. It continues the text it has seen and little
else — readable output and realistic n-gram draft acceptance, not a language model.
:func:`make_tiny_checkpoint` writes a *random* one (the tests' model, any shape).

The default model (vocab 512, hidden 128, 2 layers, 8 heads, 2 KV heads) splits over
TP = 1, 2, 4 and 8, runs in milliseconds on a CPU and loads in ``transformers``. Its
weights are scaled so logits spread widely (greedy choices are far from ties, hence
stable across TP sizes) and the special tokens' LM-head rows are zero (a random model
rarely stops by itself). ``draft=True`` writes the matching draft model: the first
``draft_num_layers`` layers of the same random target, with the same embeddings, final
norm and head — a cheap drafter whose guesses the target often accepts.
:func:`make_tiny_eagle3_head` writes a random EAGLE-3 head for a target, in the public
heads' layout (``tpspec make-tiny-model DIR --eagle3 HEAD_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch and safetensors are imported where they are used: `tpspec make-tiny-model --help` stays light.

TINY_DESCRIPTION = ("the embedded tiny Llama (vocab 512, hidden 128, 2 layers, 0.4M parameters), trained briefly on "
                    "4 KB of text shipped with tpspec: it continues text it has seen, nothing more")
CORPUS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_corpus.txt")
TRAIN_STEPS = 120

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
"""The tiny tokenizer's chat template: one ``Role: content`` line per message."""
NUM_SPECIAL = 3


def tiny_config_dict(
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` contents of a tiny Llama (transformers 4.x spelling, read by 5.x too)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": dtype,
        "initializer_range": 0.02,
    }


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights of the full (target) model, in HF names."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(h, std=0.1)

    # Residual branches are damped (0.5) so each layer nudges rather than replaces the
    # stream: a model truncated to its first layers (the draft) stays a decent guesser.
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm_weight()
        w[f"{p}.self_attn.q_proj.weight"] = normal(nh * hd, h, std=h**-0.5)
        w[f"{p}.self_attn.k_proj.weight"] = normal(nkv * hd, h, std=h**-0.5)
        w[f"{p}.self_attn.v_proj.weight"] = normal(nkv * hd, h, std=h**-0.5)
        w[f"{p}.self_attn.o_proj.weight"] = normal(h, nh * hd, std=0.5 * (nh * hd) ** -0.5)
        w[f"{p}.post_attention_layernorm.weight"] = norm_weight()
        w[f"{p}.mlp.gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[f"{p}.mlp.up_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[f"{p}.mlp.down_proj.weight"] = normal(h, inter, std=0.5 * inter**-0.5)
    w["model.norm.weight"] = norm_weight()
    head = normal(v, h, std=3.0 * h**-0.5)  # logits of std ~3: far from ties
    head[:NUM_SPECIAL] = 0.0  # pad/bos/eos get logit 0, well below the usual winners
    if cfg["tie_word_embeddings"]:
        w["model.embed_tokens.weight"] = head
    else:
        w["lm_head.weight"] = head
    return w


def make_tiny_checkpoint(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    draft: bool = False,
    draft_num_layers: int = 1,
    tokenizer: bool = True,
    **shape: Any,
) -> str:
    """Write a random Llama checkpoint (``config.json``, ``generation_config.json``,
    ``model.safetensors``, and ``tokenizer.json`` when the ``tokenizers`` package is
    installed and ``vocab_size >= 259``) into ``path``; return ``path``. ``dtype``: float32
    (default), bfloat16 or float16.

    ``shape``: keyword arguments of :func:`tiny_config_dict` (``vocab_size``, ``hidden_size``,
    ``intermediate_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``max_position_embeddings``, ``rope_theta``, ``tie_word_embeddings``), its defaults for the
    ones left out. Deterministic: the same arguments give the same bytes. With ``draft=True`` the
    checkpoint is the draft of the target written with the same other arguments: its
    first ``draft_num_layers`` layers, same vocab, embeddings, final norm and LM head.
    Raises ``ValueError`` for sizes that do not form a valid model.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)
    if dtype_name is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    cfg = tiny_config_dict(**shape, dtype=dtype_name)
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if hidden % heads != 0:
        raise ValueError(f"hidden_size={hidden} must be a multiple of num_heads={heads}")
    if heads % kv_heads != 0:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads}")
    if cfg["vocab_size"] <= NUM_SPECIAL:
        raise ValueError(f"vocab_size={cfg['vocab_size']} must exceed the {NUM_SPECIAL} special tokens")
    if draft and not 1 <= draft_num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"draft_num_layers={draft_num_layers} must lie in [1, num_layers={cfg['num_hidden_layers']}]")
    weights = _random_weights(cfg, seed)
    if draft:
        cfg, weights = _first_layers(cfg, weights, draft_num_layers)
    path = _write_checkpoint(path, cfg, weights, dtype)
    if tokenizer:
        write_tiny_tokenizer(path, cfg["vocab_size"])
    return path


def _first_layers(cfg: dict[str, Any], weights: dict[str, torch.Tensor], n: int) -> tuple[dict, dict]:
    """The draft of a model: its first ``n`` layers with the same embeddings, norm and head."""
    keep = {f"model.layers.{i}." for i in range(n)}
    weights = {k: t for k, t in weights.items() if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)}
    return dict(cfg, num_hidden_layers=n), weights


def _write_checkpoint(path: str | os.PathLike, cfg: dict[str, Any], weights: dict[str, torch.Tensor],
                      dtype: torch.dtype | None = None) -> str:
    """``model.safetensors``, ``config.json`` and ``generation_config.json`` into ``path`` (the
    weights in ``dtype``, default float32)."""
    import torch
    from safetensors.torch import save_file

    dtype = torch.float32 if dtype is None else dtype
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_file({k: t.to(dtype).contiguous() for k, t in weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, f, indent=2)
    return path


def make_tiny_eagle3_head(
    path: str | os.PathLike,
    target: str | os.PathLike,
    *,
    seed: int = 1,
    draft_vocab_size: int | None = None,
) -> str:
    """Write a random EAGLE-3 head for the target checkpoint at ``target`` into ``path``; return ``path``.

    The layout is the public heads' one (see :mod:`tpspec.model.eagle3`): ``config.json`` (one layer,
    the target's hidden size, heads and rotary settings, ``draft_vocab_size``, and
    ``eagle_aux_hidden_state_layer_ids``: ``(2, L // 2, L - 3)`` for a target of ``L >= 5`` layers,
    ``(0, L // 2, L - 1)`` for a shallower one) and ``model.safetensors`` with ``fc``, ``midlayer.*``,
    ``norm``, ``lm_head`` over the draft vocabulary and the ``d2t``/``t2d`` maps. The draft vocabulary
    (default: half the target's) is the special tokens plus a seeded random subset of the others,
    in increasing order. Deterministic; the dtype is the target's. Raises ``ValueError`` for a
    ``draft_vocab_size`` outside ``[NUM_SPECIAL + 1, vocab_size]``.
    """
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(os.fspath(target), "config.json")) as f:
        tcfg = json.load(f)
    h, v, layers = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_hidden_layers"]
    nh, nkv = tcfg["num_attention_heads"], tcfg.get("num_key_value_heads") or tcfg["num_attention_heads"]
    hd = tcfg.get("head_dim") or h // nh
    inter = tcfg["intermediate_size"]
    vd = v // 2 if draft_vocab_size is None else draft_vocab_size
    if not NUM_SPECIAL < vd <= v:
        raise ValueError(f"draft_vocab_size={vd} must lie in [{NUM_SPECIAL + 1}, {v}]")
    aux = [2, layers // 2, layers - 3] if layers >= 5 else [0, layers // 2, layers - 1]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    others = torch.randperm(v - NUM_SPECIAL, generator=gen)[: vd - NUM_SPECIAL] + NUM_SPECIAL
    draft_ids = torch.cat([torch.arange(NUM_SPECIAL), others.sort().values])
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    head = normal(vd, h, std=3.0 * h**-0.5)  # logits of std ~3: far from ties
    head[:NUM_SPECIAL] = 0.0
    w = {
        "fc.weight": normal(h, 3 * h, std=(3 * h) ** -0.5),
        "midlayer.input_layernorm.weight": 1.0 + normal(h, std=0.1),
        "midlayer.hidden_norm.weight": 1.0 + normal(h, std=0.1),
        "midlayer.self_attn.q_proj.weight": normal(nh * hd, 2 * h, std=(2 * h) ** -0.5),
        "midlayer.self_attn.k_proj.weight": normal(nkv * hd, 2 * h, std=(2 * h) ** -0.5),
        "midlayer.self_attn.v_proj.weight": normal(nkv * hd, 2 * h, std=(2 * h) ** -0.5),
        "midlayer.self_attn.o_proj.weight": normal(h, nh * hd, std=0.5 * (nh * hd) ** -0.5),
        "midlayer.post_attention_layernorm.weight": 1.0 + normal(h, std=0.1),
        "midlayer.mlp.gate_proj.weight": normal(inter, h, std=h**-0.5),
        "midlayer.mlp.up_proj.weight": normal(inter, h, std=h**-0.5),
        "midlayer.mlp.down_proj.weight": normal(h, inter, std=0.5 * inter**-0.5),
        "norm.weight": 1.0 + normal(h, std=0.1),
        "lm_head.weight": head,
    }
    dtype = getattr(torch, tcfg.get("torch_dtype") or "float32")
    tensors = {k: t.to(dtype).contiguous() for k, t in w.items()}
    tensors["d2t"] = (draft_ids - torch.arange(vd)).to(torch.int64)
    tensors["t2d"] = t2d
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "hidden_act": "silu",
        "max_position_embeddings": tcfg.get("max_position_embeddings", 2048),
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_theta": tcfg.get("rope_theta", 10000.0),
        "rope_scaling": tcfg.get("rope_scaling"),
        "tie_word_embeddings": False,
        "vocab_size": v,
        "draft_vocab_size": vd,
        "eagle_aux_hidden_state_layer_ids": aux,
        "torch_dtype": tcfg.get("torch_dtype") or "float32",
    }
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return path


def make_trained_tiny_checkpoint(path: str | os.PathLike, *, draft_path: str | os.PathLike | None = None,
                                 steps: int = TRAIN_STEPS, seed: int = 0, progress: bool = False) -> str:
    """Write the embedded default model into ``path``: a BPE tokenizer learned from the shipped
    corpus (vocab 512: ``<pad> <s> </s> <unk>``, printable ASCII and merges; every id decodes
    to printable text) and the tiny Llama trained ``steps`` AdamW steps on that corpus (batches
    of 16 windows of 64 tokens). With ``draft_path``, also write its draft there (the first
    layer of the trained model). ``progress``: a progress bar of the steps on stderr. Seeded:
    the same machine writes the same weights. Returns ``path``.
    """
    import sys

    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(CORPUS_PATH) as f:
        corpus = f.read()
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tok = write_corpus_tokenizer(path, corpus)
    cfg = tiny_config_dict(vocab_size=tok.get_vocab_size())
    data = torch.tensor(tok.encode(corpus).ids, dtype=torch.int64)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    # Ten warm-up steps, then a linear decay to half.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * (1 - 0.5 * s / steps))
    gen = torch.Generator().manual_seed(seed)
    window, batch = 64, 16
    model.train()
    for _ in tqdm(range(steps), desc="training the tiny model", unit="step", file=sys.stderr, disable=not progress,
                  leave=False, mininterval=0):  # every step drawn: short runs still show 100 %
        starts = torch.randint(0, len(data) - window, (batch,), generator=gen)
        x = torch.stack([data[s:s + window] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    _write_checkpoint(path, cfg, weights)
    if draft_path is not None:
        draft_cfg, draft_weights = _first_layers(cfg, weights, 1)
        _write_checkpoint(draft_path, draft_cfg, draft_weights)
        write_corpus_tokenizer(os.fspath(draft_path), corpus)
    return path


def trained_tiny_key() -> str:
    """A short digest of everything the trained model depends on (the corpus, the code that
    trains and writes it, the recipe constants): the cache directory's name, so a changed
    recipe never reuses a stale model."""
    import hashlib
    import inspect

    digest = hashlib.sha256()
    with open(CORPUS_PATH, "rb") as f:
        digest.update(f.read())
    for fn in (tiny_config_dict, make_trained_tiny_checkpoint, write_corpus_tokenizer, _write_checkpoint,
               _first_layers):
        digest.update(inspect.getsource(fn).encode())
    digest.update(repr((TRAIN_STEPS, CHAT_TEMPLATE, PAD_ID, BOS_ID, EOS_ID)).encode())
    return digest.hexdigest()[:12]


def write_corpus_tokenizer(path: str, corpus: str, vocab_size: int = 512) -> Any:
    """Learn the default model's byte-level BPE tokenizer from ``corpus`` and save it (with a
    ``tokenizer_config.json`` holding the chat template) into ``path``; return it.

    The alphabet is printable ASCII and newline only (anything else encodes to ``<unk>``), so
    every id decodes to printable text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    table = _byte_to_char()
    alphabet = [table[b] for b in [*range(32, 127), 10]]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator([corpus], trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 4096,
                   "chat_template": CHAT_TEMPLATE}, f, indent=2)
    return tok


def _byte_to_char() -> dict[int, str]:
    """Byte-level BPE's reversible byte -> printable character map (GPT-2 convention):
    printable Latin-1 bytes map to themselves, the others to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_tiny_tokenizer(path: str, vocab_size: int) -> bool:
    """Write a byte-level tokenizer (ids 0-2 = ``<pad> <s> </s>``, id ``3 + b`` = byte ``b``) if the
    ``tokenizers`` package is installed and the vocab has room; return whether it was written."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return False
    if vocab_size < NUM_SPECIAL + 256:
        return False
    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    for b, ch in _byte_to_char().items():
        vocab[ch] = NUM_SPECIAL + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}, f, indent=2)
    return True


# ------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = tiny_config_dict()
    parser.add_argument("dir", help="directory to write the checkpoint into (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    for flag, field in (("--vocab-size", "vocab_size"), ("--hidden-size", "hidden_size"),
                        ("--intermediate-size", "intermediate_size"), ("--num-layers", "num_hidden_layers"),
                        ("--num-heads", "num_attention_heads"), ("--num-kv-heads", "num_key_value_heads")):
        parser.add_argument(flag, type=int, default=defaults[field])
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--draft", metavar="DRAFT_DIR", default=None,
                        help="also write the matching draft model (the target's first layers) into DRAFT_DIR")
    parser.add_argument("--draft-num-layers", type=int, default=1)
    parser.add_argument("--eagle3", metavar="HEAD_DIR", default=None,
                        help="also write a random EAGLE-3 head for the target into HEAD_DIR")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer.json")


def run(args: argparse.Namespace) -> int:
    import torch

    common = dict(seed=args.seed, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                  intermediate_size=args.intermediate_size, num_layers=args.num_layers, num_heads=args.num_heads,
                  num_kv_heads=args.num_kv_heads, dtype=getattr(torch, args.dtype), tokenizer=not args.no_tokenizer)
    try:
        print(f"target model: {make_tiny_checkpoint(args.dir, **common)}")
        if args.draft:
            out = make_tiny_checkpoint(args.draft, draft=True, draft_num_layers=args.draft_num_layers, **common)
            print(f"draft model:  {out}")
        if args.eagle3:
            print(f"EAGLE-3 head: {make_tiny_eagle3_head(args.eagle3, args.dir, seed=args.seed + 1)}")
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    return 0
