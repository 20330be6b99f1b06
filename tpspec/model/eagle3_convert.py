"""``tpspec convert-eagle3 IN OUT``: an EAGLE-3 head published as ``pytorch_model.bin`` turned into
the safetensors layout :mod:`tpspec.model.eagle3` loads. torch is imported only to convert, so
the command's ``--help`` stays light."""

from __future__ import annotations

import argparse
import os
import shutil


def convert_eagle3_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """Write the ``pytorch_model.bin`` EAGLE-3 head in ``src`` (a directory holding it and ``config.json``,
    or the ``.bin`` file itself with ``config.json`` beside it) into ``dst`` as ``model.safetensors`` plus
    ``config.json``; return ``dst``. The pickle is read with ``torch.load(weights_only=True)``: tensors
    and plain containers only, never arbitrary objects. Raises :class:`CheckpointError` when there is no
    ``.bin``/``config.json``, when it holds something other than a flat dict of tensors, or when a tensor
    of the layout is missing."""
    import torch
    from safetensors.torch import save_file

    from .loader import CheckpointError

    src = os.fspath(src)
    bin_file = os.path.join(src, "pytorch_model.bin") if os.path.isdir(src) else src
    src_dir = os.path.dirname(bin_file)
    config_file = os.path.join(src_dir, "config.json")
    for needed in (bin_file, config_file):
        if not os.path.isfile(needed):
            raise CheckpointError(f"no {os.path.basename(needed)} at {needed!r}")
    try:
        state = torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a malformed or unsafe pickle: weights_only refuses it
        raise CheckpointError(f"cannot read {bin_file!r} as plain tensors: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{bin_file!r} is not a flat dict of named tensors")
    for name in ("fc.weight", "lm_head.weight", "norm.weight", "midlayer.self_attn.q_proj.weight"):
        if name not in state:
            raise CheckpointError(f"{bin_file!r} has no tensor {name!r}: not an EAGLE-3 head")
    dst = os.fspath(dst)
    os.makedirs(dst, exist_ok=True)
    # Tensors may share storage in a pickle; safetensors wants each one whole and contiguous.
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copyfile(config_file, os.path.join(dst, "config.json"))
    return dst


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="IN", help="directory with pytorch_model.bin and config.json (or the .bin)")
    parser.add_argument("dst", metavar="OUT", help="directory to write model.safetensors and config.json into")


def run(args: argparse.Namespace) -> int:
    from .loader import CheckpointError

    try:
        out = convert_eagle3_checkpoint(args.src, args.dst)
    except CheckpointError as exc:
        print(f"error: {exc}")
        return 2
    print(f"EAGLE-3 head written to {out}")
    return 0
