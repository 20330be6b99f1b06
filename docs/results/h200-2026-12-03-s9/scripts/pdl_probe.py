"""Probe: what a kernel boundary costs under a CUDA graph, and what programmatic dependent
launch (PDL: cuLaunchKernelEx with PROGRAMMATIC_STREAM_SERIALIZATION, griddepcontrol in the
kernel) hides of it. Kernels: an empty one (1 block, and a full grid) and a reader of 32 MiB
(256 x 64K bf16, cold copies). µs per call, 20 calls per graph."""
import ctypes

import cupy as cp
import torch

SRC = r'''
extern "C" __global__ void empty_k(int pdl, unsigned long long* sink) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
    if (threadIdx.x == 0 && blockIdx.x == 0 && sink[1] == 12345ull) sink[0] = 1ull;
}
extern "C" __global__ void __launch_bounds__(256) read_k(int pdl, const uint4* x, long long n16, unsigned long long* sink) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
    unsigned int acc = 0u;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = __ldg(x + i), b = __ldg(x + i + stride), c = __ldg(x + i + 2 * stride), d = __ldg(x + i + 3 * stride);
        acc = max(acc, max(max(a.x ^ a.w, b.y ^ b.z), max(c.x ^ c.y, d.z ^ d.w)));
    }
    for (; i < n16; i += stride) { uint4 a = __ldg(x + i); acc = max(acc, a.x ^ a.w); }
    if (acc == 0xdeadbeefu) sink[0] = acc;
}
'''


class LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttr)), ("nattrs", ctypes.c_uint)]


libcuda = ctypes.CDLL("libcuda.so.1")
libcuda.cuLaunchKernelEx.restype = ctypes.c_int


def launch_ex(fn_ptr, grid, block, args, stream, pdl_attr):
    attr = LaunchAttr()
    attr.id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.memmove(ctypes.addressof(attr) + 8, ctypes.byref(ctypes.c_int(1)), 4)
    cfg = LaunchConfig(grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream), ctypes.pointer(attr), 1 if pdl_attr else 0)
    holders = [a for a in args]
    ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
    rc = libcuda.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn_ptr), ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx rc={rc}")


def time_graph(fn, calls=20, replays=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000.0 / (calls * replays)


def main():
    torch.cuda.set_device(0)
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    empty, read = mod.get_function("empty_k"), mod.get_function("read_k")
    sink = torch.zeros(2, dtype=torch.int64, device="cuda")
    nbytes = 256 * 65536 * 2
    copies = [torch.randn(256, 65536, device="cuda").to(torch.bfloat16) for _ in range(8)]
    it = {"i": 0}

    def nxt():
        it["i"] = (it["i"] + 1) % len(copies)
        return copies[it["i"]]

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, grid in (("empty 1 block", 1), (f"empty {sms * 8} blocks", sms * 8)):
        for mode in ("cupy", "ex", "ex+pdl"):
            def call(grid=grid, mode=mode):
                stream = torch.cuda.current_stream().cuda_stream
                if mode == "cupy":
                    empty((grid,), (256,), (cp.int32(0), cp.uint64(sink.data_ptr())),
                          stream=cp.cuda.ExternalStream(stream))
                else:
                    launch_ex(empty.kernel.ptr, grid, 256, [ctypes.c_int(1 if mode == "ex+pdl" else 0),
                                                     ctypes.c_uint64(sink.data_ptr())], stream, mode == "ex+pdl")
            print(f"{name:22s} {mode:7s} {time_graph(call):6.2f} us/call", flush=True)
    for grid in (sms * 4, sms * 8):
        for mode in ("ex", "ex+pdl"):
            def call(grid=grid, mode=mode):
                x = nxt()
                launch_ex(read.kernel.ptr, grid, 256, [ctypes.c_int(1 if mode == "ex+pdl" else 0), ctypes.c_uint64(x.data_ptr()),
                                                ctypes.c_int64(nbytes // 16), ctypes.c_uint64(sink.data_ptr())],
                          torch.cuda.current_stream().cuda_stream, mode == "ex+pdl")
            us = time_graph(call, calls=16, replays=50)
            print(f"read 32 MiB grid {grid:5d} {mode:7s} {us:6.2f} us/call = {nbytes / us / 1e6:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
