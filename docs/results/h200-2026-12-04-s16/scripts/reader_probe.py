"""Probe (session 16): how fast can ONE launch read 32 MiB (256 x 64K bf16) of cold logits on this GPU?
If no reader gets well under ~9.9 us/call, a fused call (read + hand-off + exchange) cannot reach 80 % of the
copy bandwidth at that shape. Variants: gs4 (session 9's grid-stride, 4 x 16 B a thread), gs8 (8 in flight,
L2::256B prefetch hint), span8 (a contiguous span per block, 8 in flight, hint), tma (cp.async.bulk tiles into
shared memory through an mbarrier ring, every thread consumes the tile). us per call, graphs of 16 calls
rotating through 8 copies (256 MiB, > L2)."""
import ctypes
import sys

import cupy as cp
import torch

SRC = r'''
#define PDL_WAIT() if (pdl) { asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;"); }
__device__ __forceinline__ uint4 ld_hint(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned mix(uint4 a) { return max(a.x ^ a.w, a.y ^ a.z); }

extern "C" __global__ void __launch_bounds__(256) gs4(int pdl, const uint4* x, long long n16, unsigned long long* sink) {
    PDL_WAIT();
    unsigned acc = 0u;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = __ldg(x + i), b = __ldg(x + i + stride), c = __ldg(x + i + 2 * stride), d = __ldg(x + i + 3 * stride);
        acc = max(acc, max(max(mix(a), mix(b)), max(mix(c), mix(d))));
    }
    for (; i < n16; i += stride) acc = max(acc, mix(__ldg(x + i)));
    if (acc == 0xdeadbeefu) sink[0] = acc;
}

extern "C" __global__ void __launch_bounds__(256) gs8(int pdl, const uint4* x, long long n16, unsigned long long* sink) {
    PDL_WAIT();
    unsigned acc = 0u;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = ld_hint(x + i + k * stride);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc = max(acc, mix(v[k]));
    }
    for (; i < n16; i += stride) acc = max(acc, mix(ld_hint(x + i)));
    if (acc == 0xdeadbeefu) sink[0] = acc;
}

// A contiguous span per block: block b reads packs [b*n16/G, (b+1)*n16/G), 8 x 16 B a thread in flight.
extern "C" __global__ void __launch_bounds__(256) span8(int pdl, const uint4* x, long long n16, unsigned long long* sink) {
    PDL_WAIT();
    unsigned acc = 0u;
    const long long lo = n16 * blockIdx.x / gridDim.x, hi = n16 * (blockIdx.x + 1) / gridDim.x;
    long long i = lo + threadIdx.x;
    for (; i + 7 * 256 < hi; i += 8 * 256) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = ld_hint(x + i + k * 256);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc = max(acc, mix(v[k]));
    }
    for (; i < hi; i += 256) acc = max(acc, mix(ld_hint(x + i)));
    if (acc == 0xdeadbeefu) sink[0] = acc;
}

// A contiguous chunk per block (rows split into G/256 chunks), 4 x 16 B a thread in flight, plain loads.
__device__ __forceinline__ unsigned span4_body(const uint4* x, long long lo, long long hi) {
    unsigned acc = 0u;
    long long i = lo + threadIdx.x;
    for (; i + 3 * 256 < hi; i += 4 * 256) {
        uint4 a = __ldg(x + i), b = __ldg(x + i + 256), c = __ldg(x + i + 512), d = __ldg(x + i + 768);
        acc = max(acc, max(max(mix(a), mix(b)), max(mix(c), mix(d))));
    }
    for (; i < hi; i += 256) acc = max(acc, mix(__ldg(x + i)));
    return acc;
}
extern "C" __global__ void __launch_bounds__(256) span4(int pdl, const uint4* x, long long n16, unsigned long long* sink) {
    PDL_WAIT();
    const long long lo = n16 * blockIdx.x / gridDim.x, hi = n16 * (blockIdx.x + 1) / gridDim.x;
    unsigned acc = span4_body(x, lo, hi);
    if (acc == 0xdeadbeefu) sink[0] = acc;
}
// span4 plus the fused kernel's minimal tail: the block's maximum (warp redux + shared memory), one 64-bit atomic
// max into its row's key, a fence and a done counter; the last block reads the 256 row keys, writes them out and
// resets the keys and the counter. sink: [0] counter, [8..8+256) row keys, [300..556) out.
extern "C" __global__ void __launch_bounds__(256) span4_tail(int pdl, const uint4* x, long long n16, unsigned long long* sink) {
    __shared__ unsigned s_max[8];
    __shared__ int s_last;
    PDL_WAIT();
    const long long lo = n16 * blockIdx.x / gridDim.x, hi = n16 * (blockIdx.x + 1) / gridDim.x;
    unsigned acc = span4_body(x, lo, hi);
    acc = __reduce_max_sync(0xffffffffu, acc);
    if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned m = s_max[0];
        for (int w = 1; w < 8; ++w) m = max(m, s_max[w]);
        const int row = (int)(lo / (n16 / 256));
        atomicMax(sink + 8 + row, ((unsigned long long)m << 32) | (0xffffffffu - (unsigned)lo));
        __threadfence();
        s_last = atomicAdd(sink, 1ull) == gridDim.x - 1;
    }
    __syncthreads();
    if (s_last) {
        __threadfence();
        volatile unsigned long long* keys = sink + 8;
        sink[300 + threadIdx.x] = keys[threadIdx.x];
        keys[threadIdx.x] = 0ull;
        if (threadIdx.x == 0) sink[0] = 0ull;
    }
}

// Bulk copies (TMA, no tensor map) of TILE-byte tiles into a STAGES-deep ring; thread 0 issues, every thread
// reads the tile from shared memory. Block b takes tiles [b*T/G, (b+1)*T/G).
#define TILE 8192
#define STAGES 6
extern "C" __global__ void __launch_bounds__(256) tma(int pdl, const char* x, long long nbytes, unsigned long long* sink) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) unsigned long long bars[STAGES];
    PDL_WAIT();
    const long long tiles = nbytes / TILE;
    const long long t0 = tiles * blockIdx.x / gridDim.x, t1 = tiles * (blockIdx.x + 1) / gridDim.x;
    const int n = (int)(t1 - t0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            unsigned b = (unsigned)__cvta_generic_to_shared(&bars[s]);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int t) {
        const int s = t % STAGES;
        unsigned b = (unsigned)__cvta_generic_to_shared(&bars[s]);
        unsigned d = (unsigned)__cvta_generic_to_shared(ring + s * TILE);
        const char* src = x + (t0 + t) * TILE;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(TILE) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(d), "l"(src), "r"(TILE), "r"(b) : "memory");
    };
    if (threadIdx.x == 0) for (int t = 0; t < n && t < STAGES; ++t) issue(t);
    unsigned acc = 0u;
    for (int t = 0; t < n; ++t) {
        const int s = t % STAGES;
        const unsigned phase = (unsigned)((t / STAGES) & 1);
        unsigned b = (unsigned)__cvta_generic_to_shared(&bars[s]);
        unsigned done = 0;
        while (!done) {
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(b), "r"(phase) : "memory");
        }
        const uint4* tile = reinterpret_cast<const uint4*>(ring + s * TILE);
#pragma unroll
        for (int k = 0; k < TILE / 16 / 256; ++k) acc = max(acc, mix(tile[threadIdx.x + k * 256]));
        __syncthreads();
        if (threadIdx.x == 0 && t + STAGES < n) issue(t + STAGES);
    }
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
libcuda.cuFuncSetAttribute.restype = ctypes.c_int


def launch_ex(fn_ptr, grid, smem, args, stream, pdl):
    attr = LaunchAttr()
    attr.id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.memmove(ctypes.addressof(attr) + 8, ctypes.byref(ctypes.c_int(1)), 4)
    cfg = LaunchConfig(grid, 1, 1, 256, 1, 1, smem, ctypes.c_void_p(stream), ctypes.pointer(attr), 1 if pdl else 0)
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in args])
    rc = libcuda.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn_ptr), ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx rc={rc}")


def time_graph(fn, calls=16, replays=10, windows=5):
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
    out = []
    for _ in range(windows):
        g.replay(); g.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0 / (calls * replays))
    return sorted(out)[len(out) // 2]


def copy_gbps():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        dst.copy_(src)
    b.record()
    b.synchronize()
    return 2 * src.numel() * 10 / (a.elapsed_time(b) / 1000.0) / 1e9


def main():
    torch.cuda.set_device(0)
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_gbps()
    print(f"copy bandwidth {copy:.0f} GB/s; 80 % of it at 32 MiB = {32 * 2**20 / (0.8 * copy * 1e3):.2f} us", flush=True)
    nbytes = 256 * 65536 * 2
    copies = [torch.randn(256, 65536, device="cuda").to(torch.bfloat16) for _ in range(8)]
    it = {"i": 0}

    def nxt():
        it["i"] = (it["i"] + 1) % len(copies)
        return copies[it["i"]]

    tma_smem = 6 * 8192
    tma_fn = mod.get_function("tma")
    rc = libcuda.cuFuncSetAttribute(ctypes.c_void_p(tma_fn.kernel.ptr), 8, tma_smem)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
    print(f"cuFuncSetAttribute rc={rc}", flush=True)
    sink = torch.zeros(600, dtype=torch.int64, device="cuda")
    cases = []
    for grid in (sms * 4, sms * 8, sms * 16):
        cases.append(("gs4", grid, 0))
    for grid in (256, 512, 1024, 2048):
        cases.append(("span4", grid, 0))
        cases.append(("span4_tail", grid, 0))
    for per_sm in (1, 2, 3, 4):
        cases.append(("tma", sms * per_sm, tma_smem))
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for r in range(rounds):
        for name, grid, smem in cases:
            fn = mod.get_function(name)
            for pdl in (False, True):
                def call(fn=fn, grid=grid, smem=smem, pdl=pdl, name=name):
                    x = nxt()
                    n = ctypes.c_int64(nbytes if name == "tma" else nbytes // 16)
                    launch_ex(fn.kernel.ptr, grid, smem, [ctypes.c_int(int(pdl)), ctypes.c_uint64(x.data_ptr()), n,
                                                          ctypes.c_uint64(sink.data_ptr())],
                              torch.cuda.current_stream().cuda_stream, pdl)
                try:
                    us = time_graph(call)
                    print(f"round {r} {name:10s} grid {grid:5d} pdl={int(pdl)} {us:6.2f} us/call "
                          f"{nbytes / us / 1e3:7.0f} GB/s {100 * nbytes / us / 1e3 / copy:5.1f} % of copy", flush=True)
                except Exception as e:  # a variant that fails to launch is reported, the rest still run
                    print(f"round {r} {name} grid {grid} pdl={int(pdl)} FAILED: {e}", flush=True)
                    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
