"""Load a Hugging Face safetensors checkpoint into a TP-sharded model.

Each rank reads only the slices its parameters need (safetensors ``get_slice``, which
reads those bytes of the memory-mapped file and nothing else), so a rank reads about
``1/tp`` of the checkpoint plus the small replicated tensors (norms, biases of
row-parallel linears, KV heads shared by several ranks). Single files and sharded
checkpoints (``model.safetensors.index.json``) are both understood. Every problem
(missing tensor, wrong shape, no safetensors, a corrupt file, NaN or infinite weights)
raises an error naming the file and the tensor.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from ..exchange.base import KeyExchange
from ..mapping import Mapping
from .config import ModelConfig, read_json
from .layers import ShardSpec
from .llama import TPLlamaForCausalLM

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: a missing tensor, one of the wrong shape, a corrupt
    file, a tensor holding NaN or infinite values."""


@dataclass
class LoadStats:
    """What a load read: ``bytes_read`` (sum of the slices read) and ``checkpoint_bytes``
    (tensor data of the whole checkpoint, for comparison)."""

    bytes_read: int = 0
    checkpoint_bytes: int = 0


class CheckpointReader:
    """Name -> file map of a safetensors checkpoint directory, and sliced reads from it.

    Use as a context manager (closes the files). Raises ``FileNotFoundError`` when the
    directory has no safetensors files.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.stats = LoadStats()
        self._handles: dict[str, Any] = {}
        index_file = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index_file):
            index = read_json(index_file)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_file} has no 'weight_map'")
            self.files = {name: os.path.join(self.path, fname) for name, fname in weight_map.items()}
            for fname in sorted(set(self.files.values())):
                if not os.path.isfile(fname):
                    raise FileNotFoundError(f"{index_file} names {os.path.basename(fname)!r}, which does not exist")
        else:
            paths = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
            if not paths:
                found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.path, "*.bin")))
                hint = f" (found {found}: PyTorch .bin checkpoints are not supported)" if found else ""
                raise FileNotFoundError(f"no *.safetensors files in {self.path!r}{hint}")
            self.files = {}
            for fname in paths:
                for name in self._open(fname).keys():
                    self.files[name] = fname
        self.stats.checkpoint_bytes = sum(self._data_bytes(f) for f in sorted(set(self.files.values())))

    def _open(self, fname: str) -> Any:
        if fname not in self._handles:
            try:
                self._handles[fname] = safe_open(fname, framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise CheckpointError(f"cannot read safetensors file {fname!r}: {exc}") from exc
        return self._handles[fname]

    @staticmethod
    def _data_bytes(fname: str) -> int:
        """Size of the tensor data of one file (file size minus its JSON header)."""
        with open(fname, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
        return os.path.getsize(fname) - 8 - header

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, spec: ShardSpec) -> torch.Tensor:
        """This spec's slice of its checkpoint tensor (CPU, checkpoint dtype). Raises
        :class:`CheckpointError` naming a missing tensor or a wrong shape."""
        fname = self.files.get(spec.name)
        if fname is None:
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor {spec.name!r}")
        sl = self._open(fname).get_slice(spec.name)
        shape = tuple(sl.get_shape())
        if shape != tuple(spec.full_shape):
            raise CheckpointError(
                f"tensor {spec.name!r} in {os.path.basename(fname)} has shape {list(shape)}, "
                f"the config implies {list(spec.full_shape)}"
            )
        try:
            if spec.dim is None:
                t = sl[:]
            elif spec.dim == 0:
                t = sl[spec.start : spec.start + spec.length]
            else:
                index = (slice(None),) * spec.dim + (slice(spec.start, spec.start + spec.length),)
                t = sl[index]
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"cannot read tensor {spec.name!r} from {fname!r}: {exc}") from exc
        # A NaN or inf weight makes every logit NaN: the model would emit one token forever.
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"tensor {spec.name!r} in {fname!r} holds NaN or infinite values")
        self.stats.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Open the header of every safetensors file of the checkpoint at ``path`` (cheap: no
    tensor data is read). Raises :class:`CheckpointError` naming a corrupt or truncated
    file, ``FileNotFoundError`` when files are missing."""
    with CheckpointReader(path) as reader:
        for fname in sorted(set(reader.files.values())):
            reader._open(fname)  # noqa: SLF001


@torch.no_grad()
def load_weights(model: TPLlamaForCausalLM, path: str | os.PathLike) -> LoadStats:
    """Fill every parameter of ``model`` with its slices of the checkpoint at ``path``.

    Local to the rank (no communication). Returns what was read. Raises
    :class:`CheckpointError` (a ``ValueError``) naming a missing tensor or a wrong shape.
    """
    from tqdm import tqdm

    plan = model.shard_plan()
    # A bar on rank 0 only, and only on a terminal (tqdm's disable=None): logs stay clean.
    bar = tqdm(plan, desc=f"loading {os.path.basename(os.fspath(path).rstrip(os.sep))}", unit="tensor",
               leave=False, disable=None if model.mapping.rank == 0 else True)
    with CheckpointReader(path) as reader:
        for _, param, specs in bar:
            for spec in specs:
                t = reader.read(spec)
                if spec.dim is None:
                    param.copy_(t)
                else:
                    param.narrow(spec.dim, spec.dest_start, spec.length).copy_(t)
        return reader.stats


def load_model(
    path: str | os.PathLike,
    mapping: Mapping | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    exchange: KeyExchange | None = None,
    attention_backend: str = "auto",
    deterministic: bool = False,
) -> TPLlamaForCausalLM:
    """Build the model of the checkpoint at ``path`` for this rank and load its shard.

    Collective over the TP group when the LM head is sharded and no ``exchange`` is given
    (the exchange is created then). The result has ``load_stats`` (a :class:`LoadStats`)
    and ``path``; call ``allocate_kv_cache(num_pages, page_size)`` before the first forward.
    A ``"shape:NAME[,num_layers=N,vocab_size=V]"`` path builds a real model shape with random weights instead
    (:mod:`tpspec.model.shapes`; ``load_stats`` is None).
    ``deterministic``: see :class:`TPLlamaForCausalLM` (fixed reduction orders: batch- and
    TP-invariant logits).
    """
    from .shapes import config_from_path, is_shape_path, random_model

    if is_shape_path(path):
        model = random_model(config_from_path(path), mapping, device=device, dtype=dtype, exchange=exchange,
                             attention_backend=attention_backend, deterministic=deterministic)
        model.path = path
        return model
    config = ModelConfig.from_pretrained(path)
    model = TPLlamaForCausalLM(config, mapping, device=device, dtype=dtype, exchange=exchange,
                               attention_backend=attention_backend, deterministic=deterministic)
    model.load_stats = load_weights(model, path)
    model.path = os.fspath(path)
    return model


def check_draft_vocab_map(reader: CheckpointReader, draft_vocab_size: int, target_vocab_size: int) -> torch.Tensor:
    """Read and check a reduced draft vocabulary's map (EAGLE-3 heads): ``d2t`` ``[draft_vocab_size]``
    int64 offsets with target id ``= draft id + d2t[draft id]``, and, when present, ``t2d``
    ``[target_vocab_size]`` bool marking the target ids the draft vocabulary holds. Returns ``d2t``
    (int64, CPU). A head whose draft vocabulary is the target's may omit ``d2t`` (all zeros then).

    The target ids must be strictly increasing and lie in ``[0, target_vocab_size)``: drafting on
    vocabulary shards relies on draft ids keeping their order as target ids. Raises
    :class:`CheckpointError` naming the tensor and what is wrong with it.
    """
    if "d2t" not in reader:
        if draft_vocab_size != target_vocab_size:
            raise CheckpointError(f"checkpoint {reader.path!r} has no tensor 'd2t': a draft vocabulary of "
                                  f"{draft_vocab_size} ids (the target has {target_vocab_size}) needs its map")
        d2t = torch.zeros(draft_vocab_size, dtype=torch.int64)
    else:
        d2t = reader.read(ShardSpec("d2t", (draft_vocab_size,)))
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.is_complex():
            raise CheckpointError(f"tensor 'd2t' must hold integer offsets, got {d2t.dtype}")
        d2t = d2t.to(torch.int64)
    ids = torch.arange(draft_vocab_size, dtype=torch.int64) + d2t
    if draft_vocab_size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        bad = int(torch.nonzero(ids[1:] <= ids[:-1])[0]) + 1
        raise CheckpointError(f"tensor 'd2t' must map draft ids to strictly increasing target ids: draft id {bad} "
                              f"maps to {int(ids[bad])}, not above draft id {bad - 1}'s {int(ids[bad - 1])}")
    if int(ids[0]) < 0 or int(ids[-1]) >= target_vocab_size:
        raise CheckpointError(f"tensor 'd2t' maps draft ids to target ids [{int(ids[0])}, {int(ids[-1])}], "
                              f"outside the target's vocabulary [0, {target_vocab_size})")
    if "t2d" in reader:
        t2d = reader.read(ShardSpec("t2d", (target_vocab_size,))).to(torch.bool)
        if int(t2d.sum()) != draft_vocab_size or not bool(t2d[ids].all()):
            raise CheckpointError("tensor 't2d' does not mark exactly the target ids that 'd2t' maps to")
    return d2t
