"""Checks and resolvers of user-facing values, shared by every layer.

One spelling of each rule, so every entry point accepts and refuses the same things:
an int is any integral number but a bool (numpy integers included), a real number any
real but a bool; a bad value raises ``ValueError`` naming the field.
``resolve_device`` and ``resolve_dtype`` turn ``"auto"`` and aliases into the names the
ranks use; ``torch_dtype`` turns such a name into the torch dtype.
"""

from __future__ import annotations

import math
import numbers

import torch

DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def is_int(value: object) -> bool:
    """An integral number that is not a bool (``int``, numpy integers)."""
    # ``type(...) is int`` first: the engine checks a few ints per request every step, and the
    # abstract-class check is the slow part (a bool's type is bool, not int).
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def is_real(value: object) -> bool:
    """A real number that is not a bool (``int``, ``float``, numpy scalars)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bound(value: int) -> str:
    """``2**32`` reads better than 4294967296 in a message."""
    if value >= 1 << 16 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return str(value)


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None,
              below: int | None = None) -> int:
    """``int(value)`` when ``value`` is an int (:func:`is_int`) with ``low <= value``,
    ``value <= high`` and ``value < below`` (each bound only when given); else
    ``ValueError("{name} must be ..., got {value!r}")``."""
    ok = is_int(value)
    if ok:
        v = int(value)  # type: ignore[call-overload]
        ok = (low is None or v >= low) and (high is None or v <= high) and (below is None or v < below)
    if not ok:
        if low == 1 and high is None and below is None:
            what = "a positive int"
        elif low is not None and (high is not None or below is not None):
            what = f"an int in [{_bound(low)}, " + (f"{_bound(high)}]" if high is not None else f"{_bound(below)})")
        elif low is not None:
            what = f"an int >= {_bound(low)}"
        elif high is not None:
            what = f"an int <= {_bound(high)}"
        elif below is not None:
            what = f"an int < {_bound(below)}"
        else:
            what = "an int"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return v


def check_real(name: str, value: object, *, low: float | None = None) -> float:
    """``float(value)`` when ``value`` is a finite real number (:func:`is_real`) ``>= low``
    (when given); else ``ValueError`` naming ``name``."""
    ok = is_real(value) and math.isfinite(float(value))  # type: ignore[arg-type]
    if ok and low is not None:
        ok = float(value) >= low  # type: ignore[arg-type]
    if not ok:
        what = "a finite number" + (f" >= {low:g}" if low is not None else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_bool(name: str, value: object) -> bool:
    """``value`` when it is a bool; else ``ValueError`` naming ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a CUDA device is visible, else ``"cpu"``; ``"cpu"`` and
    ``"cuda"`` as they are. ``ValueError`` for anything else and for ``"cuda"`` without a
    CUDA device."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in DEVICES:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: str, *, checkpoint_dtype: str | None = None) -> str:
    """The dtype name the ranks use: ``"auto"`` -> ``checkpoint_dtype`` when given (a
    checkpoint's own), else ``"bfloat16"`` on cuda and ``"float32"`` on cpu; aliases
    (``bf16``, ``fp16``, ``half``, ``fp32``, torch dtypes) to their names. ``ValueError``
    for anything else."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
    if dtype == "auto" and checkpoint_dtype is not None:
        if checkpoint_dtype not in DTYPES:
            raise ValueError(f"the checkpoint's torch_dtype {checkpoint_dtype!r} is not supported; pass dtype=")
        return checkpoint_dtype
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """A name :func:`resolve_dtype` returns -> the torch dtype (``ValueError`` otherwise)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
