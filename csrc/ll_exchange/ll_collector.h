#ifndef TPSPEC_LL_COLLECTOR_H
#define TPSPEC_LL_COLLECTOR_H

#include "ll_line_protocol.h"

// The fused kernel's collector. Inside one rank, the fused kernel's blocks hand their row maxima to one block, the
// collector, the same way: each other block writes one {key_lo, epoch, key_hi, epoch} line
// of the channel's block lines; the collector, after its own columns, polls them (bounded
// by the same timeout) and runs the exchange. No fence, no ticket atomic, no re-read of a
// scratch max: a block's result reaches the collector in one store and one poll. The
// collector is the grid's last block, so every block it waits for has started before it
// (see argmax_logits_impl). Block lines are rewritten only by the next kernel on the
// channel, so clearing all of them in the call of epoch 0xFFFFFFFF (after the collector
// has read this call's) keeps a stale one from matching after the wrap.

// The fused kernel's collector, for batches gather_row_maxima (below) does not take: every
// other work item's line of this call into s_parts[item] (the collector's own key, item 0,
// is put there by the caller), for reduce_chunk_parts. A thread keeps up to 4 lines in flight
// until each carries this call's epoch. Returns false in a thread whose wait ran past
// timeout_ns.
__device__ bool gather_block_lines(u64 lines, int blocks, u32 epoch, u64 timeout_ns, u64* s_parts) {
    const int BATCH = 4;
    for (int first = (int)threadIdx.x; first < blocks; first += BATCH * (int)blockDim.x) {
        u32 pending = 0u;
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int b = first + j * (int)blockDim.x;
            if (b > 0 && b < blocks) pending |= 1u << j;
        }
        WaitClock clock;
        while (pending) {
            uint4 v[BATCH];
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                if ((pending >> j) & 1u) v[j] = load_line(lines + 16ull * (u64)(first + j * (int)blockDim.x));
            }
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                if (((pending >> j) & 1u) && v[j].y == epoch && v[j].w == epoch) {
                    const int b = first + j * (int)blockDim.x;
                    s_parts[b] = ((u64)v[j].z << 32) | (u64)v[j].x;
                    pending &= ~(1u << j);
                }
            }
            if (!pending) break;
            if (clock.expired(timeout_ns)) return false;
        }
    }
    return true;
}


// The fused kernel's collector when rows <= warps and chunks <= 32 * LINES (small batches:
// ROW_GATHER_MAX_CHUNKS, or COLUMNS_GATHER_MAX_CHUNKS in the _columns kernels, whose rows
// span more blocks): warp `row` polls its row's block lines, up to LINES per lane in flight,
// and reduces them with warp_max_u64 straight into s_keys[row]: no shared-memory round
// trip and no barrier between the gather and the reduction. `own` is the collector's key (valid
// in thread 0). Returns false in a thread whose wait ran past timeout_ns.
template <int LINES>
__device__ bool gather_row_maxima(u64 lines, int rows, int chunks, u32 epoch, u64 timeout_ns, u64 own,
                                  u64* s_keys) {
    const int row = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    if (row >= rows) return true;  // uniform over the warp
    u32 pending = 0u;
#pragma unroll
    for (int j = 0; j < LINES; ++j) {
        const int c = lane + 32 * j;
        if (c < chunks && row * chunks + c > 0) pending |= 1u << j;
    }
    u64 best = threadIdx.x == 0 ? own : 0ull;
    bool complete = true;
    WaitClock clock;
    while (pending) {
        uint4 v[LINES];
#pragma unroll
        for (int j = 0; j < LINES; ++j) {
            if ((pending >> j) & 1u) v[j] = load_line(lines + 16ull * (u64)(row * chunks + lane + 32 * j));
        }
#pragma unroll
        for (int j = 0; j < LINES; ++j) {
            if (((pending >> j) & 1u) && v[j].y == epoch && v[j].w == epoch) {
                const u64 key = ((u64)v[j].z << 32) | (u64)v[j].x;
                best = key > best ? key : best;
                pending &= ~(1u << j);
            }
        }
        if (!pending) break;
        if (clock.expired(timeout_ns)) {
            complete = false;
            break;
        }
    }
    best = warp_max_u64(best);
    if (lane == 0) s_keys[row] = best;
    return complete;
}

// s_keys[row] = max over the row's chunks of s_parts[row * chunks + chunk] (chunks > 1):
// g = 2^lg lanes per row (the smallest power of two >= chunks, at most a warp), striding
// its chunks, then a shuffle max. Shifts only: this runs once per call, in the collector, on
// the path from the last block's key to the exchange.
__device__ void reduce_chunk_parts(const u64* s_parts, int rows, int chunks, u64* s_keys) {
    const int lg = chunks >= 32 ? 5 : 32 - __clz(chunks - 1);
    const int g = 1 << lg;
    const int rows_per_pass = (int)blockDim.x >> lg;
    const int member = (int)threadIdx.x & (g - 1);
    for (int base = 0; base < rows; base += rows_per_pass) {  // uniform over the block
        const int row = base + ((int)threadIdx.x >> lg);
        u64 m = 0ull;
        if (row < rows) {
            for (int c = member; c < chunks; c += g) {
                const u64 v = s_parts[row * chunks + c];
                m = v > m ? v : m;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            if (off < g) {  // uniform
                const u64 o = __shfl_xor_sync(0xffffffffu, m, off);
                m = o > m ? o : m;
            }
        }
        if (row < rows && member == 0) s_keys[row] = m;
    }
}

#endif  // TPSPEC_LL_COLLECTOR_H
