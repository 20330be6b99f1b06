"""Diagnostic: what Philox4x32-10 alone costs on this GPU (no memory traffic).

Compiles the LL source plus one kernel that computes `quads` Philox blocks the way the
fused kernel does (key schedule in registers) and folds them into one word, then times
launches with CUDA events. Prints microseconds per launch for several grids and shapes.
"""
import pathlib
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
from tpspec.exchange import cuda_module as C  # noqa: E402

src = pathlib.Path("csrc/ll_exchange/ll_exchange.cu").read_text() + r'''
extern "C" __global__ void __launch_bounds__(256) philox_compute(u32 quads, u32 seed, int ilp, u32* out) {
    const PhiloxKeys keys = philox_keys(seed, 0u);
    u32 acc = 0u;
    const u32 stride = gridDim.x * blockDim.x;
    u32 q = blockIdx.x * blockDim.x + threadIdx.x;
    if (ilp == 2) {
        for (; q + stride < quads; q += 2 * stride) {
            const Words4 a = philox4x32_10(q, 0u, 7u, 0u, keys);
            const Words4 b = philox4x32_10(q + stride, 0u, 7u, 0u, keys);
            const u32 fa = (a.w0 ^ a.w1) + (a.w2 ^ a.w3), fb = (b.w0 ^ b.w1) + (b.w2 ^ b.w3);
            acc = max(acc, max(fa, fb));
        }
    }
    for (; q < quads; q += stride) {
        const Words4 w = philox4x32_10(q, 0u, 7u, 0u, keys);
        acc = max(acc, (w.w0 ^ w.w1) + (w.w2 ^ w.w3));
    }
    acc = warp_max_u32(acc);
    if ((threadIdx.x & 31u) == 0u) atomicMax(out, acc);
}
extern "C" __global__ void empty_kernel(u32* out) {}
'''
mod = cp.RawModule(code=src, options=C.compile_options())
kern = mod.get_function("philox_compute")
empty = mod.get_function("empty_kernel")
out = cp.zeros(1, dtype=cp.uint32)
sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
print(f"SMs {sms}, clockRate {cp.cuda.runtime.getDeviceProperties(0)['clockRate'] / 1e6:.2f} GHz")


def time_launch(fn, iters=200):
    for _ in range(20):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1e3 / iters


base = time_launch(lambda: empty((1,), (32,), (out,)))
print(f"empty launch, back to back: {base:.2f} us")
for rows, width in ((1, 16384), (8, 65536), (64, 65536), (256, 16384), (256, 65536)):
    quads = rows * width // 4
    for per_sm in (4, 8, 16):
        for ilp in (1, 2):
            grid = min(sms * per_sm, max(1, -(-quads // 256)))
            us = time_launch(lambda: kern((grid,), (256,), (np.uint32(quads), np.uint32(5), np.int32(ilp), out)))
            print(f"{rows:4d} x {width:6d}: {quads:8d} Philox blocks, {grid:5d} blocks ({per_sm}/SM), ilp {ilp}: "
                  f"{us:7.2f} us per launch")
