"""Run-time compilation of the LL exchange kernels (``csrc/ll_exchange``) with NVRTC.

The source is compiled once per process and device through cupy's ``RawModule``
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
SOURCE_FILE = "ll_exchange.cu"
KERNEL_NAMES = ("ll_exchange_keys_1", "ll_exchange_keys_4", "ll_exchange_keys_8",
                "ll_argmax_logits_f32", "ll_argmax_logits_bf16", "ll_argmax_logits_f16",
                "ll_argmax_logits_f32_one_tile", "ll_argmax_logits_bf16_one_tile", "ll_argmax_logits_f16_one_tile",
                "ll_argmax_logits_f32_columns", "ll_argmax_logits_bf16_columns", "ll_argmax_logits_f16_columns",
                "ll_philox_floor_bf16", "ll_read_floor_bf16")  # the last two: benchmark references (bench exchange)
THREADS_PER_BLOCK = 256  # LL_THREADS in the source
MAX_WORLD = 64  # LL_MAX_WORLD: missing-rank masks are 64-bit

_lock = threading.Lock()
_modules: dict[tuple[int, str], Any] = {}


def source_dir() -> Path:
    """Folder holding the ``.cu`` files (``$TPSPEC_LL_SOURCE_DIR`` overrides)."""
    override = os.environ.get(SOURCE_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "csrc" / "ll_exchange"  # <repo>/tpspec/exchange/this file


def source_path() -> Path:
    path = source_dir() / SOURCE_FILE
    if not path.is_file():
        raise RuntimeError(
            f"LL exchange kernel source not found at {path}; install tpspec from its source tree "
            f"or point {SOURCE_ENV} at the csrc/ll_exchange folder"
        )
    return path


def kernel_source() -> str:
    """The CUDA source text (self-contained: no #include)."""
    return source_path().read_text()


def compile_options() -> tuple[str, ...]:
    """Options shared by NVRTC and the CI's nvcc compile (no architecture: see module doc)."""
    return ("--fmad=false", "-std=c++17", "-DTPSPEC_LL_EXCHANGE=1")


def nvcc_command(output: str | os.PathLike, arch: str = "sm_90", kind: str = "cubin") -> list[str]:
    """The ``nvcc`` command that compiles the source to ``output`` (``kind``: cubin or ptx)."""
    if kind not in ("cubin", "ptx"):
        raise ValueError(f"kind must be 'cubin' or 'ptx', got {kind!r}")
    return ["nvcc", f"-arch={arch}", f"--{kind}", *compile_options(), "-o", str(output), str(source_path())]


def cupy_or_none() -> Any:
    """The ``cupy`` module when it imports and sees a CUDA device, else ``None``."""
    try:
        import cupy  # noqa: F401

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # noqa: BLE001 - any failure means "no cupy here"
        return None


def load_module(device_index: int) -> Any:
    """The compiled ``cupy.RawModule`` for CUDA device ``device_index`` (compiled once per
    process and device; every kernel is loaded before this returns, so nothing compiles
    later, e.g. during CUDA-graph capture). Raises ``RuntimeError`` when cupy is missing
    or the compile fails (with NVRTC's log)."""
    source = kernel_source()
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
                for name in KERNEL_NAMES:
                    module.get_function(name)
        except Exception as exc:  # noqa: BLE001 - report what NVRTC said
            raise RuntimeError(f"compiling {source_path()} with NVRTC failed: {exc}") from exc
        _modules[key] = module
        return module
