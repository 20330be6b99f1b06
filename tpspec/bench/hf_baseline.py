"""The Hugging Face transformers baseline of ``tpspec bench generate --baseline hf``.

The same model shape as tpspec's run, on the same device, in the same dtype, for the same prompt
token ids and ``max_new_tokens``, greedy, EOS ignored: a checkpoint directory is loaded with
``AutoModelForCausalLM.from_pretrained`` (the same weights as tpspec's, so the tokens can be
compared); a ``shape:`` model is built with ``AutoModelForCausalLM.from_config`` from the shape's
``config.json`` fields (random weights of transformers' own initialisation). ``generate`` runs with
``cache_implementation="static"``; on CUDA transformers then compiles the decoding forward with
``torch.compile`` by itself (its documented way to combine a static cache with ``torch.compile``;
its ``CompileConfig`` defaults: ``mode="reduce-overhead"``); ``compile=False`` sets
``disable_compile``. transformers compiles only on accelerators, so on CPU the baseline is eager.
Each batch runs once untimed (compilation, CUDA-graph recording, the static cache's allocation),
then once timed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..validation import torch_dtype

# ``dtype=`` in ``from_config`` / ``from_pretrained`` and generate's own torch.compile of a static cache.
MIN_TRANSFORMERS = (4, 56)


def transformers_problem() -> str | None:
    """Why the installed transformers cannot run the baseline (None when it can)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("transformers")
    except PackageNotFoundError:
        return "transformers is not installed"
    parts = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if parts < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        return f"transformers {installed} is installed; the baseline needs transformers >= {need}"
    return None


def hf_config(model_path: str) -> Any:
    """The transformers config of a ``shape:`` model path (its ``config.json`` fields, layers and
    vocabulary as the path says; special token ids a shrunk vocabulary lacks are dropped)."""
    import transformers

    from ..model.shapes import config_from_path

    config = config_from_path(model_path)
    fields = dict(config.extra)
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(fields.get(key), int) and fields[key] >= config.vocab_size:
            fields[key] = None
    return getattr(transformers, config.architecture).config_class.from_dict(fields)


def build_hf_model(model_path: str, device: str, dtype: str) -> tuple[Any, bool]:
    """``(model, same_weights)``: the transformers causal LM of ``model_path`` on ``device`` in
    ``dtype``; ``same_weights`` when it holds the checkpoint's weights (a directory), False for a
    ``shape:`` path (random weights)."""
    from transformers import AutoModelForCausalLM

    from ..model.shapes import is_shape_path

    dt = torch_dtype(dtype)
    if is_shape_path(model_path):
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config(model_path), dtype=dt)
        same_weights = False
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dt).to(device)
        same_weights = True
    return model.eval(), same_weights


def generation_config(max_new_tokens: int, compile: bool) -> Any:
    """Greedy, exactly ``max_new_tokens`` tokens (no EOS), static cache; ``compile=False``: no
    ``torch.compile``."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, cache_implementation="static",
                              eos_token_id=None, pad_token_id=0)
    config.disable_compile = not compile
    return config


def hf_generate(model: Any, prompts: list[list[int]], config: Any) -> tuple[float, list[list[int]]]:
    """``(wall seconds, generated ids per prompt)`` of one ``model.generate`` over ``prompts``
    (equal lengths: no padding). ``generate`` runs under ``torch.no_grad`` by itself, as users call it."""
    ids = torch.tensor(prompts, dtype=torch.int64, device=model.device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    sync()
    wall = time.perf_counter() - start
    return wall, out[:, ids.shape[1]:].tolist()


def hf_worker(rank: int, world_size: int, cfg: dict) -> dict:
    """One process: the baseline for every batch of ``cfg["prompts"]`` (``{batch: prompts}``).
    ``cfg``: model, device, dtype, max_new_tokens, compile. Returns the transformers version,
    whether the weights are the checkpoint's, whether ``generate`` compiled the forward, and per
    batch ``tokens``, ``wall_s``, ``tokens_per_s`` and the generated ids."""
    import transformers

    if cfg["device"] == "cuda":
        torch.cuda.set_device(0)
    model, same_weights = build_hf_model(cfg["model"], cfg["device"], cfg["dtype"])
    config = generation_config(cfg["max_new_tokens"], cfg["compile"])
    model.generation_config = config  # nothing of the model's own generation defaults (its EOS) applies
    results = []
    for batch, prompts in cfg["prompts"].items():
        hf_generate(model, prompts, config)  # compile, record graphs, allocate the cache
        wall, ids = hf_generate(model, prompts, config)
        tokens = sum(len(row) for row in ids)
        if tokens != batch * cfg["max_new_tokens"]:
            raise RuntimeError(f"transformers generated {tokens} tokens for {batch} x {cfg['max_new_tokens']}")
        results.append({"batch": batch, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                        "token_ids": ids})
    return {"transformers": transformers.__version__, "same_weights": same_weights,
            # transformers keeps its torch.compile'd forward here once generate compiled it.
            "compiled": getattr(model, "_compiled_call", None) is not None, "results": results}
