"""Probe (session 17, fifth version: pipe and the 1 x 16K shape added; this run times none, last, pipe, ded): what does a single launch's hand-off cost on top of its reads? One launch reads 256 x 64K
bf16 (32 MiB, span4: a contiguous span per block, four 16-byte loads a thread in flight; session 16's fastest
plain reader) and ends in one of these tails:
  none      each block stores its max to out[block] (no hand-off: the floor);
  last      session 16's fused kernel's: every block but the last writes a {lo, epoch, hi, epoch} line, the last
            block (the collector, which also reads its span) polls them, reduces each row, writes out[row];
  ded       the same with one more block, a dedicated collector that reads nothing and polls from the start;
  ticket    every block: atomicMax into its row's key, then atom.add.acq_rel.gpu on a counter; the block that
            takes the last ticket reads the row keys, writes them out and resets them (no fence instruction);
  own       every block writes out[item] itself, then takes a relaxed ticket; the last advances the epoch and
            resets the counter (the cost of knowing that every block is done, with no data hand-off);
  own_rel   the same with a release ticket (atom.add.release.gpu);
  rowown    per-row epochs, no grid-wide step: a row's chunks read its epoch word; every chunk but the row's
            last writes a line; the row's last block (the owner) polls its row's lines, writes out[row] and
            advances the row's epoch (safe: a line carrying the epoch proves its writer read it);
  ep_*      none plus a load of an epoch word folded into the stored key: ep_vol a volatile load at the start,
            ep_rlx an ld.relaxed.gpu at the start, ep_late a volatile load after the reads;
  pipe      last, but a line not there yet is polled by three loads in flight, issued 100 ns apart, each
            re-issued as soon as it comes back empty (a poll every third of a round trip, not every round trip).
Shapes: 256 x 64K bf16 (32 MiB) at 256 / 512 / 1024 blocks, and 1 x 16K (32 KiB) at 16 blocks.
us per call, graphs of 16 calls rotating through 8 copies (256 MiB, > L2), 3 rounds."""
import sys

import cupy as cp
import torch

SRC = r'''
typedef unsigned long long u64;
typedef unsigned int u32;
__device__ __forceinline__ unsigned mix(uint4 a) { return max(a.x ^ a.w, a.y ^ a.z); }
__device__ __forceinline__ void store_line(u64* p, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ uint4 load_line(const u64* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
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
__device__ __forceinline__ u64 block_key(unsigned acc, long long lo) {
    __shared__ unsigned s_max[8];
    acc = __reduce_max_sync(0xffffffffu, acc);
    if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = acc;
    __syncthreads();
    unsigned m = s_max[0];
    for (int w = 1; w < 8; ++w) m = max(m, s_max[w]);
    return ((u64)m << 32) | (0xffffffffu - (unsigned)lo);
}
// state: [0] epoch, [1] ticket counter, [8..8+256) row keys, [512..768) out, [1024..) lines (2 words each).
extern "C" __global__ void __launch_bounds__(256) tail_none(const uint4* x, long long n16, int items, u64* state) {
    const long long lo = n16 * blockIdx.x / items, hi = n16 * (blockIdx.x + 1) / items;
    const u64 key = block_key(span4_body(x, lo, hi), lo);
    if (threadIdx.x == 0) state[1024 + blockIdx.x] = key;
}
__device__ __forceinline__ bool line_ok(uint4 v, u32 epoch) { return v.y == epoch && v.w == epoch; }
// mode 0 (last): grid = items, item 0 in the last block, item w in block w - 1. mode 1 (ded): grid = items + 1,
// item w in block w, the last block only collects.
extern "C" __global__ void __launch_bounds__(256) tail_lines(const uint4* x, long long n16, int items, u64* state, int mode,
                                                               int rows) {
    __shared__ u64 s_parts[1024];
    const bool collector = blockIdx.x + 1 == gridDim.x;
    const int work = mode == 1 ? (collector ? -1 : (int)blockIdx.x) : (collector ? 0 : (int)blockIdx.x + 1);
    const u32 epoch = *(volatile u32*)state;
    u64 key = 0ull;
    if (work >= 0) {
        const long long lo = n16 * work / items, hi = n16 * (work + 1) / items;
        key = block_key(span4_body(x, lo, hi), lo);
    }
    if (!collector) {
        if (threadIdx.x == 0) store_line(state + 1024 + 2 * work, (u32)key, epoch, (u32)(key >> 32), epoch);
        return;
    }
    const int first = mode == 1 ? 0 : 1;
    if (threadIdx.x == 0) s_parts[0] = key;
    if (mode == 2) {  // pipe
        for (int b = first + threadIdx.x; b < items; b += 256) {
            const u64* p = state + 1024 + 2 * b;
            uint4 a = load_line(p);
            if (!line_ok(a, epoch)) {
                uint4 q0 = load_line(p);
                __nanosleep(100);
                uint4 q1 = load_line(p);
                __nanosleep(100);
                uint4 q2 = load_line(p);
                for (;;) {
                    if (line_ok(q0, epoch)) { a = q0; break; }
                    q0 = load_line(p);
                    if (line_ok(q1, epoch)) { a = q1; break; }
                    q1 = load_line(p);
                    if (line_ok(q2, epoch)) { a = q2; break; }
                    q2 = load_line(p);
                }
            }
            s_parts[b] = ((u64)a.z << 32) | a.x;
        }
    }
    for (int b0 = threadIdx.x; b0 < items && mode != 2; b0 += 4 * 256) {
        u32 pending = 0u;
        for (int j = 0; j < 4; ++j) { const int b = b0 + j * 256; if (b >= first && b < items) pending |= 1u << j; }
        while (pending) {
            uint4 v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) if ((pending >> j) & 1u) v[j] = load_line(state + 1024 + 2 * (b0 + j * 256));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (((pending >> j) & 1u) && v[j].y == epoch && v[j].w == epoch) {
                    s_parts[b0 + j * 256] = ((u64)v[j].z << 32) | v[j].x;
                    pending &= ~(1u << j);
                }
            }
        }
    }
    __syncthreads();
    const int chunks = items / rows;
    u64 m = 0ull;
    if ((int)threadIdx.x < rows) {
        for (int c = 0; c < chunks; ++c) m = max(m, s_parts[threadIdx.x * chunks + c]);
        state[512 + threadIdx.x] = m;
    }
    if (threadIdx.x == 0) *(volatile u32*)state = epoch + 1u;
}
extern "C" __global__ void __launch_bounds__(256) tail_ticket(const uint4* x, long long n16, int items, u64* state) {
    __shared__ int s_last;
    const long long lo = n16 * blockIdx.x / items, hi = n16 * (blockIdx.x + 1) / items;
    const u64 key = block_key(span4_body(x, lo, hi), lo);
    if (threadIdx.x == 0) {
        atomicMax(state + 8 + (int)(blockIdx.x / (items / 256)), key);
        u64 old;
        asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(state + 1) : "memory");
        s_last = old == (u64)(items - 1);
    }
    __syncthreads();
    if (s_last) {
        volatile u64* keys = state + 8;
        state[512 + threadIdx.x] = keys[threadIdx.x];
        keys[threadIdx.x] = 0ull;
        if (threadIdx.x == 0) state[1] = 0ull;
    }
}
// mode 0: relaxed ticket, 1: release ticket.
extern "C" __global__ void __launch_bounds__(256) tail_own(const uint4* x, long long n16, int items, u64* state, int mode) {
    const u32 epoch = *(volatile u32*)state;
    const long long lo = n16 * blockIdx.x / items, hi = n16 * (blockIdx.x + 1) / items;
    const u64 key = block_key(span4_body(x, lo, hi), lo);
    if (threadIdx.x == 0) {
        state[1024 + blockIdx.x] = key ^ epoch;
        u64 old;
        if (mode == 0) asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(state + 1) : "memory");
        else asm volatile("atom.release.gpu.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(state + 1) : "memory");
        if (old == (u64)(items - 1)) {
            state[1] = 0ull;
            *(volatile u32*)state = epoch + 1u;
        }
    }
}
// state[6144 + row]: row epochs (as u64 words); lines at [4096 + 2 * item].
extern "C" __global__ void __launch_bounds__(256) tail_rowown(const uint4* x, long long n16, int items, u64* state) {
    const int chunks = items / 256;
    const int row = blockIdx.x / chunks, c = blockIdx.x - row * chunks;
    const u32 epoch = (u32)*(volatile u64*)(state + 6144 + row);
    const long long lo = n16 * blockIdx.x / items, hi = n16 * (blockIdx.x + 1) / items;
    const u64 key = block_key(span4_body(x, lo, hi), lo);
    if (c + 1 < chunks) {
        if (threadIdx.x == 0) store_line(state + 4096 + 2 * blockIdx.x, (u32)key, epoch, (u32)(key >> 32), epoch);
        return;
    }
    if (threadIdx.x < 32) {
        u64 best = threadIdx.x == 0 ? key : 0ull;
        if ((int)threadIdx.x < chunks - 1) {
            const u64* line = state + 4096 + 2 * (row * chunks + threadIdx.x);
            for (;;) {
                const uint4 v = load_line(line);
                if (v.y == epoch && v.w == epoch) { best = max(best, ((u64)v.z << 32) | v.x); break; }
            }
        }
        for (int off = 16; off > 0; off >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, off));
        if (threadIdx.x == 0) {
            state[512 + row] = best;
            *(volatile u64*)(state + 6144 + row) = (u64)(epoch + 1u);
        }
    }
}
// mode 0: volatile load first, 1: ld.relaxed.gpu first, 2: volatile load after the reads.
extern "C" __global__ void __launch_bounds__(256) tail_ep(const uint4* x, long long n16, int items, u64* state, int mode) {
    u32 epoch = 0u;
    if (mode == 0) epoch = *(volatile u32*)state;
    if (mode == 1) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(epoch) : "l"(state) : "memory");
    const long long lo = n16 * blockIdx.x / items, hi = n16 * (blockIdx.x + 1) / items;
    const u64 key = block_key(span4_body(x, lo, hi), lo);
    if (mode == 2) epoch = *(volatile u32*)state;
    if (threadIdx.x == 0) state[1024 + blockIdx.x] = key ^ epoch;
}
'''


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


def main():
    torch.cuda.set_device(0)
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    big = [torch.randn(256, 65536, device="cuda").to(torch.bfloat16) for _ in range(8)]
    small = [torch.randn(1, 16384, device="cuda").to(torch.bfloat16) for _ in range(8)]
    state = torch.zeros(4096 + 2 * 2048, dtype=torch.int64, device="cuda")
    it = {"i": 0}
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for r in range(rounds):
        for items in (16, 256, 512, 1024):
            copies, rows = (small, 1) if items == 16 else (big, 256)
            nbytes = copies[0].numel() * 2
            for tail in ("none", "last", "pipe", "ded"):
                fn = mod.get_function({"last": "tail_lines", "ded": "tail_lines", "pipe": "tail_lines", "own_rel": "tail_own"}.get(tail, "tail_ep" if tail.startswith("ep_") else f"tail_{tail}"))
                grid = items + (1 if tail == "ded" else 0)

                def call(fn=fn, grid=grid, items=items, tail=tail, copies=copies, nbytes=nbytes, rows=rows):
                    it["i"] = (it["i"] + 1) % len(copies)
                    x = copies[it["i"]]
                    args = [cp.uint64(x.data_ptr()), cp.int64(nbytes // 16), cp.int32(items), cp.uint64(state.data_ptr())]
                    if tail in ("last", "ded", "pipe", "own", "own_rel"):
                        args.append(cp.int32({"ded": 1, "own_rel": 1, "pipe": 2}.get(tail, 0)))
                    if tail in ("last", "ded", "pipe"):
                        args.append(cp.int32(rows))
                    if tail.startswith("ep_"):
                        args.append(cp.int32(("ep_vol", "ep_rlx", "ep_late").index(tail)))
                    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                        fn((grid,), (256,), tuple(args))
                us = time_graph(call)
                print(f"round {r} items {items:5d} tail {tail:7s} {us:6.2f} us/call {nbytes / us / 1e3:7.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
