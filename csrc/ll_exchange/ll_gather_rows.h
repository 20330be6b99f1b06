#ifndef TPSPEC_LL_GATHER_ROWS_H
#define TPSPEC_LL_GATHER_ROWS_H

#include "ll_line_protocol.h"

// Per-row gather and exact sum of int64 arrays over the LL line protocol: what the sharded
// filters exchange (KeyExchange.gather_rows / sum_rows in tpspec/exchange/base.py: every
// rank's candidate keys of a row, every rank's mass sum of a row).
//
// One block. This rank's values are `count` int64 elements (a [rows, width] array, row
// major, count = rows * width <= max_rows); element i travels as the line of slot row i,
// {lo, epoch, hi, epoch}, to every other rank, exactly as a key does in exchange_rows, and
// the call advances the channel's epoch like any other call on it. Then, per element, the
// thread that published it waits for every other rank's line of the same slot row:
//   sum_mode 0 (gather): out is [rows, world * width]; rank r's element (row, j) lands at
//                        out[row, r * width + j] (this rank's own element included);
//   sum_mode 1 (sum):    out is [count]; out[i] = the sum over ranks of element i, in
//                        wrapping 64-bit integer addition (exact for sums below 2^63, and
//                        the same whatever the order the lines arrive in).
// A line that never arrives: the wait is bounded, the element reads -1 (gather: rank r's
// slot; sum: the total) and the channel records the error, as in exchange_rows.
template <int WAIT_BATCH>
__device__ void gather_rows_impl(const i64* values, int count, int width, int sum_mode, i64* out, const Exchange& x) {
    const ExchangeStart start = exchange_prologue(x);
    const u32 epoch = start.epoch;
    if (threadIdx.x == 0) *(volatile u32*)&x.ctrl->epoch = next_epoch(epoch);
    __syncthreads();
    const int parity = (int)(epoch & 1u);
    const int world = x.world, peers = world - 1;

    // Publish: a 16-byte line per element and other rank.
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const u64 v = (u64)values[i];
        for (int d = 0; d < peers; ++d) {
            const int dst = peer_rank(d, x.rank);
            store_line(slot_address(s_peer_slots[dst], parity, x.rank, i, world, x.max_rows), (u32)v, epoch,
                       (u32)(v >> 32), epoch);
        }
    }

    // Wait: the thread that published element i collects it from every other rank.
    const u64 own = s_peer_slots[x.rank];
    const bool fail_fast = start.failed_before != 0u;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const int row = i / width, column = i - row * width;
        i64* row_out = out + (i64)row * (i64)world * (i64)width + column;  // gather: + rank * width
        const i64 mine = values[i];
        u64 total = (u64)mine;
        if (!sum_mode) row_out[(i64)x.rank * width] = mine;
        u64 missing = 0ull;
        for (int first = 0; first < peers; first += WAIT_BATCH) {
            u32 pending;
            LL_WAIT_PEER_LINES(pending, i, if (sum_mode) total += value;
                               else row_out[(i64)peer_rank(first + j, x.rank) * width] = (i64)value;)
#pragma unroll
            for (int j = 0; j < WAIT_BATCH; ++j) {
                if ((pending >> j) & 1u) {
                    const int src = peer_rank(first + j, x.rank);
                    missing |= 1ull << src;
                    if (!sum_mode) row_out[(i64)src * width] = -1;
                }
            }
        }
        if (missing) atomicOr(&s_missing_ranks, missing);
        if (sum_mode) out[i] = missing ? -1 : (i64)total;
    }
    __syncthreads();
    // The end of an epoch cycle clears this parity's lines (and the block lines), and a missing
    // line is recorded, as in exchange_rows.
    end_call(x, start, own, parity);
}

#define LL_GATHER_ROWS_KERNEL(NAME, WAIT_BATCH)                                                                  \
    extern "C" __global__ void __launch_bounds__(LL_THREADS)                                                     \
        NAME(const i64* values, int count, int width, int sum_mode, i64* out, u64 ctrl, u64 lines,               \
             int line_count, const u64* peer_slots, u64 host_error, int rank, int world, int max_rows,           \
             u64 timeout_ns) {                                                                                   \
        Exchange x = {(ChannelCtrl*)ctrl, lines, line_count, peer_slots, (HostError*)host_error,                 \
                      rank, world, max_rows, timeout_ns};                                                        \
        gather_rows_impl<WAIT_BATCH>(values, count, width, sum_mode, out, x);                                    \
    }

#endif  // TPSPEC_LL_GATHER_ROWS_H
