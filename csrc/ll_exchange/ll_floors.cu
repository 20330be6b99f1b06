// Benchmark references for tpspec bench exchange (no exchange): what the reads and the
// noise of a fused call cost alone. Compiled only by the bench (cuda_module.FLOORS_FILE),
// so the exchange module never carries them.

#include "ll_greedy.h"
#include "ll_philox_gumbel.h"

// The floor of a sampled row under the contract's noise: read a bf16
// [rows, cols] slice (cols a multiple of 8, rows 16-byte aligned) the way the fused kernel
// does (grid = rows * chunks, the same tiles and prefetch) and compute the Philox block of
// every column, folding the words into out[block * warps + warp] so nothing is optimised
// away. No scores, no pruning, no exchange.
extern "C" __global__ void __launch_bounds__(LL_THREADS)
    ll_philox_floor_bf16(const u16* logits, i64 row_stride, int cols, int chunk, int chunks, u32 seed, u32* out) {
    const int VEC = 8, K = SAMPLED_PACKS;
    const int row = blockIdx.x / chunks;
    const int begin = (blockIdx.x - row * chunks) * chunk;
    const int end = min(cols, begin + chunk);
    const u16* row_ptr = logits + (i64)row * row_stride;
    const int stride = (int)blockDim.x * VEC * K;
    const PhiloxKeys keys = philox_keys(seed, 0u);  // as the fused kernel computes them
    u32 acc = 0u;
    uint4 next[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int b = begin + (k * (int)blockDim.x + (int)threadIdx.x) * VEC;
        next[k] = b < end ? load_pack(row_ptr + b) : make_uint4(0u, 0u, 0u, 0u);
    }
    for (int tile = begin; tile < end; tile += stride) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const uint4 pack = next[k];
            const int base = tile + (k * (int)blockDim.x + (int)threadIdx.x) * VEC;
            next[k] = base + stride < end ? load_pack(row_ptr + base + stride) : make_uint4(0u, 0u, 0u, 0u);
            if (base < end) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const Words4 w = philox4x32_10((u32)(base + 4 * q) >> 2, 0u, (u32)row, 0u, keys);
                    const u32 folded = (w.w0 ^ w.w1) + (w.w2 ^ w.w3) + pack_word(pack, 2 * q);
                    acc = folded > acc ? folded : acc;
                }
            }
        }
    }
    // One plain store a warp, each to its own word: atomics of every warp onto one word per
    // row would add a cost to the launch that no fused call pays.
    acc = warp_max_u32(acc);
    if ((threadIdx.x & 31u) == 0u) out[blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)] = acc;
}

// A reference for tpspec bench exchange: one launch with the fused kernel's greedy grid
// that reads a bf16 [rows, cols] slice (cols a multiple of 8, rows 16-byte aligned) with
// the greedy rows' loop and stores each block's maximum key to out[block]. No block lines,
// no exchange: at small shapes, what the launch and the reads of a greedy call cost alone.
extern "C" __global__ void __launch_bounds__(LL_THREADS)
    ll_read_floor_bf16(const u16* logits, i64 row_stride, int cols, int chunk, int chunks, u64* out) {
    const int row = blockIdx.x / chunks;
    const int begin = (blockIdx.x - row * chunks) * chunk;
    const int end = min(cols, begin + chunk);
    const u64 best = block_max(greedy_span<1>(logits + (i64)row * row_stride, begin, max(begin, end), 0u));
    if (threadIdx.x == 0) out[blockIdx.x] = best;
}
