"""Run-time compilation of the LL exchange kernels (``csrc/ll_exchange``) with NVRTC.

``ll_exchange.cu`` holds the kernels the exchange launches, ``ll_floors.cu`` the benchmark
references (compiled only by ``tpspec bench exchange``); both ``#include`` the headers beside
them, which :func:`kernel_source` inlines (each once, in include order) so NVRTC gets one
self-contained text and cupy's cache key covers every header. ``ll_constants.h`` holds the
constants the host shares with the kernels: :func:`shared_constants` reads it.

A source is compiled once per process and device through cupy's ``RawModule``
(cupy also caches the binary on disk, ``CUPY_CACHE_DIR``). cupy supplies the target
architecture from the current device (``-arch``), and appends ``-ftz=true`` after our
options: the kernels do all float arithmetic in inline PTX without ``.ftz``, so that flag
cannot change a result. The CI compiles the same text with ``nvcc -arch=sm_90`` and
:func:`compile_options` (see :func:`nvcc_command`).

Where the source lives: ``$TPSPEC_LL_SOURCE_DIR`` when set, else ``csrc/ll_exchange``
next to the ``tpspec`` package.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

SOURCE_ENV = "TPSPEC_LL_SOURCE_DIR"
SOURCE_FILE = "ll_exchange.cu"  # the exchange's kernels
FLOORS_FILE = "ll_floors.cu"  # benchmark references, compiled only by the bench
CONSTANTS_FILE = "ll_constants.h"  # constants shared by host and kernels
KERNEL_NAMES = ("ll_exchange_keys_1", "ll_exchange_keys_4", "ll_exchange_keys_8",
                "ll_gather_rows_1", "ll_gather_rows_4", "ll_gather_rows_8",
                "ll_argmax_logits_f32", "ll_argmax_logits_bf16", "ll_argmax_logits_f16",
                "ll_argmax_logits_f32_one_tile", "ll_argmax_logits_bf16_one_tile", "ll_argmax_logits_f16_one_tile",
                "ll_argmax_logits_f32_columns", "ll_argmax_logits_bf16_columns", "ll_argmax_logits_f16_columns")
FLOOR_KERNEL_NAMES = ("ll_philox_floor_bf16", "ll_read_floor_bf16")
_KERNELS_OF = {SOURCE_FILE: KERNEL_NAMES, FLOORS_FILE: FLOOR_KERNEL_NAMES}

_lock = threading.Lock()
_modules: dict[tuple[int, str], Any] = {}


def source_dir() -> Path:
    """Folder holding the ``.cu`` files (``$TPSPEC_LL_SOURCE_DIR`` overrides)."""
    override = os.environ.get(SOURCE_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "csrc" / "ll_exchange"  # <repo>/tpspec/exchange/this file


def source_path(name: str = SOURCE_FILE) -> Path:
    """Path of the source file ``name`` (raises ``RuntimeError`` when it is missing)."""
    path = source_dir() / name
    if not path.is_file():
        raise RuntimeError(
            f"LL exchange kernel source not found at {path}; install tpspec from its source tree "
            f"or point {SOURCE_ENV} at the csrc/ll_exchange folder"
        )
    return path


_INCLUDE = '#include "'


def kernel_source(name: str = SOURCE_FILE) -> str:
    """The CUDA text of ``name`` with its local headers inlined (self-contained: no
    ``#include`` left). Every ``#include "header"`` line names a file of the source folder;
    a header already inlined is skipped (their include guards would skip it too)."""
    seen: set[str] = set()

    def expand(file: str) -> list[str]:
        seen.add(file)
        out: list[str] = []
        for line in source_path(file).read_text().splitlines(keepends=True):
            if line.startswith(_INCLUDE):
                header = line[len(_INCLUDE):].split('"', 1)[0]
                if header not in seen:
                    out.extend(expand(header))
                continue
            out.append(line)
        return out

    return "".join(expand(name))


def parse_constants(text: str) -> dict[str, int | float]:
    """``{NAME: value}`` of the ``#define NAME VALUE`` lines of a constants header (see
    ``ll_constants.h`` for the format: integers, hex with an optional ``u``, floats with an
    ``f``; a value-less define, such as an include guard, is skipped). Raises ``ValueError``
    on a define whose value has another form."""
    constants: dict[str, int | float] = {}
    for line in text.splitlines():
        fields = line.split("//", 1)[0].split()
        if len(fields) < 3 or fields[0] != "#define":
            continue
        if len(fields) != 3:
            raise ValueError(f"{CONSTANTS_FILE}: expected '#define NAME VALUE', got {line!r}")
        name, value = fields[1], fields[2]
        try:
            if value.lower().startswith("0x"):
                constants[name] = int(value.rstrip("uU"), 16)
            elif value.endswith("f"):
                constants[name] = float(value[:-1])
            else:
                constants[name] = int(value.rstrip("uU"))
        except ValueError:
            raise ValueError(f"{CONSTANTS_FILE}: {name} has a value of an unknown form: {value!r}") from None
    return constants


def shared_constants() -> dict[str, int | float]:
    """The constants of ``ll_constants.h`` (read once per process)."""
    global _constants
    if _constants is None:
        _constants = parse_constants(source_path(CONSTANTS_FILE).read_text())
    return _constants


_constants: dict[str, int | float] | None = None


def compile_options() -> tuple[str, ...]:
    """Options shared by NVRTC and the CI's nvcc compile (no architecture: see module doc)."""
    return ("--fmad=false", "-std=c++17", "-DTPSPEC_LL_EXCHANGE=1")


def nvcc_command(output: str | os.PathLike, arch: str = "sm_90", kind: str = "cubin",
                 name: str = SOURCE_FILE) -> list[str]:
    """The ``nvcc`` command that compiles source ``name`` to ``output`` (``kind``: cubin or ptx)."""
    if kind not in ("cubin", "ptx"):
        raise ValueError(f"kind must be 'cubin' or 'ptx', got {kind!r}")
    return ["nvcc", f"-arch={arch}", f"--{kind}", *compile_options(), "-o", str(output), str(source_path(name))]


def cupy_or_none() -> Any:
    """The ``cupy`` module when it imports and sees a CUDA device, else ``None``."""
    try:
        import cupy  # noqa: F401

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # noqa: BLE001 - any failure means "no cupy here"
        return None


def load_module(device_index: int, name: str = SOURCE_FILE) -> Any:
    """The compiled ``cupy.RawModule`` of source ``name`` (``SOURCE_FILE`` or ``FLOORS_FILE``)
    for CUDA device ``device_index`` (compiled once per process and device; every kernel is
    loaded before this returns, so nothing compiles later, e.g. during CUDA-graph capture).
    Raises ``RuntimeError`` when cupy is missing or the compile fails (with NVRTC's log)."""
    if name not in _KERNELS_OF:
        raise ValueError(f"name must be one of {sorted(_KERNELS_OF)}, got {name!r}")
    source = kernel_source(name)
    key = (int(device_index), source)
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        try:
            import cupy
        except ImportError as exc:
            raise RuntimeError("the LL exchange needs cupy (pip install 'tpspec[cuda]')") from exc
        try:
            with cupy.cuda.Device(int(device_index)):
                module = cupy.RawModule(code=source, options=compile_options())
                for kernel in _KERNELS_OF[name]:
                    module.get_function(kernel)
        except Exception as exc:  # noqa: BLE001 - report what NVRTC said
            raise RuntimeError(f"compiling {source_path(name)} with NVRTC failed: {exc}") from exc
        _modules[key] = module
        return module
