"""The LL exchange's CUDA source compiles with NVRTC, as the runtime compiles it (no GPU needed).

nvcc and NVRTC have different front ends: a construct nvcc accepts (``__builtin_offsetof``, a host
header) can fail NVRTC and so every GPU run. NVRTC is a plain library, so this compiles the exact
text ``cuda_module.load_module`` hands to cupy, with the same options, on a machine without a GPU.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os

import pytest

from tpspec.exchange import cuda_module


def _libnvrtc() -> ctypes.CDLL | None:
    """NVRTC from the ``nvidia-cuda-nvrtc`` wheel (the ``nvrtc`` extra) or the system, else ``None``."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
    candidates += ["libnvrtc.so"]
    for path in candidates:
        if "builtins" in os.path.basename(path) or ".alt." in os.path.basename(path):
            continue
        try:
            # NVRTC opens its builtins library by name at compile time: load the wheel's copy first.
            for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*")):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _nvrtc_compile(lib: ctypes.CDLL, source: str, options: list[str]) -> tuple[int, str]:
    """(NVRTC's result code, its log) for compiling ``source`` with ``options``."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"ll_exchange.cu", 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram returned {rc}"
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return rc, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


NVRTC = _libnvrtc()


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install -e '.[nvrtc]' brings it)")
@pytest.mark.parametrize("name", [cuda_module.SOURCE_FILE, cuda_module.FLOORS_FILE])
def test_kernel_source_compiles_with_nvrtc(name):
    options = [*cuda_module.compile_options(), "--gpu-architecture=sm_90"]
    rc, log = _nvrtc_compile(NVRTC, cuda_module.kernel_source(name), options)
    assert rc == 0, f"NVRTC could not compile {name}:\n{log}"


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install -e '.[nvrtc]' brings it)")
def test_nvrtc_check_fails_on_what_nvrtc_rejects():
    # The check above can fail: a construct nvcc takes and NVRTC does not.
    source = "struct S { int a; int b; };\nstatic_assert(__builtin_offsetof(S, b) == 4, \"layout\");\n"
    rc, log = _nvrtc_compile(NVRTC, source, ["--gpu-architecture=sm_90"])
    assert rc != 0 and "offsetof" in log
