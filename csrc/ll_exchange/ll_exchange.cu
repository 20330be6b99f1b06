// LL (low-latency) key exchange of tpspec: cross-rank max of 64-bit keys over CUDA IPC
// peer memory, fused with the row reduction of a rank's logits slice.
//
// Compiled at run time by NVRTC (tpspec/exchange/cuda_module.py) with --fmad=false and
// -std=c++17; the CI compiles it with nvcc -arch=sm_90 using the same flags. The headers
// beside it hold one concern each (ll_constants.h: what the host shares; ll_common.h;
// ll_philox_gumbel.h; ll_line_protocol.h; ll_greedy.h; ll_sampled.h; ll_collector.h;
// ll_gather_rows.h: the sharded filters' gather and sum);
// cuda_module inlines them for NVRTC, so both compilers see the same text. This file holds
// the kernels the host launches; which one, with which grid, tpspec/exchange/ll_plan.py
// decides.
//
// Semantics: bit-identical to the torch reference in tpspec/keys.py (local_row_keys,
// pack_keys, philox_words, exponential_from_words, portable_log, gumbel_scores). Change
// both together. All float arithmetic of exact scores goes through the inline-PTX helpers
// below (add/sub/mul/div with an explicit .rn rounding and no .ftz): PTX never contracts
// such instructions into FMA, and they keep subnormals even though cupy appends
// -ftz=true to every NVRTC compile. Only the pruning estimates of sampled rows use plain
// float operations: their roundings (and flushed subnormals) sit inside the error bound
// of keys.gumbel_bound_table, so they decide which columns get an exact score, never a key.
//
// Keys: kernels work on the *unsigned* form ukey = key ^ (1 << 63), so the empty key
// (EMPTY_KEY = -2^63) is 0 and a plain unsigned 64-bit max reduces.

#include "ll_collector.h"
#include "ll_gather_rows.h"
#include "ll_greedy.h"
#include "ll_line_protocol.h"
#include "ll_sampled.h"

// ------------------------------------------------------- max_keys / argmax_tokens kernel

// One row of exchange_keys_impl's input as loaded (see there): loads only, so that a
// caller can issue other loads before the first use of these.
struct RowInput {
    i64 key_or_column;  // mode 0: the signed key; mode 1: the local argmax column
    u32 max_raw;        // mode 1: local_max[row] as stored (a float32 or a 16-bit float)
};

__device__ __forceinline__ RowInput load_row_input(int mode, const i64* keys, const void* local_max, int max_dtype,
                                                   const void* local_argmax, int argmax_is_i64, int row) {
    RowInput in;
    in.max_raw = 0u;
    if (mode == 0) {
        in.key_or_column = keys[row];
    } else {
        in.max_raw = max_dtype == 0 ? ((const u32*)local_max)[row] : (u32)((const u16*)local_max)[row];
        in.key_or_column = argmax_is_i64 ? ((const i64*)local_argmax)[row] : (i64)((const int*)local_argmax)[row];
    }
    return in;
}

__device__ __forceinline__ u64 row_ukey(int mode, const RowInput& in, int max_dtype, i64 vocab_offset) {
    if (mode == 0) return (u64)in.key_or_column ^ 0x8000000000000000ull;
    u32 b;
    if (max_dtype == 0) b = in.max_raw;
    else if (max_dtype == 1) b = Elem<1>::bits((u16)in.max_raw);
    else b = Elem<2>::bits((u16)in.max_raw);
    return make_ukey(canonical_bits(b), (u32)(in.key_or_column + vocab_offset));
}

// One block. mode 0: keys[row] are signed int64 keys. mode 1: pack (local_max[row],
// local_argmax[row] + vocab_offset) like keys.pack_keys; max_dtype 0/1/2 =
// float32/bfloat16/float16, argmax_is_i64 picks int64 or int32 columns. WAIT_BATCH: peer
// lines a waiting thread polls at once, no more than the world needs (see there); one
// kernel per batch, picked by the host, so each world size runs only its own wait loop.
template <int WAIT_BATCH>
__device__ __forceinline__ void exchange_keys_impl(int mode, const i64* keys, const void* local_max, int max_dtype,
                                                   const void* local_argmax, int argmax_is_i64, i64 vocab_offset,
                                                   int rows, i64* out, int want_tokens, u64 ctrl, u64 lines,
                                                   int line_count, const u64* peer_slots, u64 host_error, int rank,
                                                   int world, int max_rows, u64 timeout_ns) {
    Exchange x = {(ChannelCtrl*)ctrl, lines, line_count, peer_slots, (HostError*)host_error,
                  rank, world, max_rows, timeout_ns};
    // The thread's first row is loaded before the prologue, whose first use of a loaded
    // value (the slot pointers it stages in shared memory) would otherwise hold these loads
    // back by a memory round trip: one round trip in all before the publish, not two.
    const int first = (int)threadIdx.x;
    RowInput in = {0, 0u};
    if (first < rows) in = load_row_input(mode, keys, local_max, max_dtype, local_argmax, argmax_is_i64, first);
    const ExchangeStart start = exchange_prologue(x);
    if (first < rows) s_keys[first] = row_ukey(mode, in, max_dtype, vocab_offset);
    for (int row = first + (int)blockDim.x; row < rows; row += blockDim.x) {
        in = load_row_input(mode, keys, local_max, max_dtype, local_argmax, argmax_is_i64, row);
        s_keys[row] = row_ukey(mode, in, max_dtype, vocab_offset);
    }
    exchange_rows<WAIT_BATCH>(x, start, s_keys, rows, out, want_tokens, (i64*)0, 0);
}

#define LL_EXCHANGE_KEYS_KERNEL(NAME, WAIT_BATCH)                                                              \
    extern "C" __global__ void __launch_bounds__(LL_THREADS)                                                   \
        NAME(int mode, const i64* keys, const void* local_max, int max_dtype, const void* local_argmax,        \
             int argmax_is_i64, i64 vocab_offset, int rows, i64* out, int want_tokens, u64 ctrl, u64 lines,    \
             int line_count, const u64* peer_slots, u64 host_error, int rank, int world, int max_rows,         \
             u64 timeout_ns) {                                                                                 \
        exchange_keys_impl<WAIT_BATCH>(mode, keys, local_max, max_dtype, local_argmax, argmax_is_i64,          \
                                       vocab_offset, rows, out, want_tokens, ctrl, lines, line_count,          \
                                       peer_slots, host_error, rank, world, max_rows, timeout_ns);             \
    }

LL_EXCHANGE_KEYS_KERNEL(ll_exchange_keys_1, 1)  // world 1-2 (ll_plan.exchange_keys_kernel picks by world)
LL_EXCHANGE_KEYS_KERNEL(ll_exchange_keys_4, 4)  // world 3-5
LL_EXCHANGE_KEYS_KERNEL(ll_exchange_keys_8, 8)  // world 6+

// gather_rows / sum_rows of the sharded filters (ll_gather_rows.h), by world size as above.
LL_GATHER_ROWS_KERNEL(ll_gather_rows_1, 1)  // world 1-2 (ll_plan.gather_rows_kernel)
LL_GATHER_ROWS_KERNEL(ll_gather_rows_4, 4)  // world 3-5
LL_GATHER_ROWS_KERNEL(ll_gather_rows_8, 8)  // world 6+

// grid = rows * chunks blocks, one work item each; item w reduces columns
// [chunk * (w % chunks), ...) of row w / chunks. Item 0, the collector, runs in the last
// block, item w > 0 in block w - 1. Every item but 0 writes its key to its block line w (see
// the protocol above); the collector gathers them, reduces each row over its chunks, runs
// the exchange and writes out[row]: the token (want_tokens) or the winning signed key.
//   logits: [rows, *] with row stride `row_stride` (elements), `cols` real columns
//           (columns at or past the true vocab size are excluded by the host).
//   temperature: float32 [rows] or null (all greedy); rows with T >= threshold sample.
//   seeds/offsets: int64 [rows] or null (then seed = unseeded_seed, offset =
//           (*step_counter << 32) + row; *step_counter += 1 once the collector holds every
//           block's line, so after all blocks read it, when advance_step).
//   gumbel_table: keys.gumbel_bound_table() (GUMBEL_TABLE_SIZE + 4 floats).
//   lines: the channel's block lines (line_count >= rows * chunks lines of 16 bytes).
//   Dynamic shared memory: 8 * rows bytes, plus 8 * rows * chunks when chunks > 1.
template <int DTYPE, bool ONE_TILE, bool COLUMNS>
__device__ void argmax_logits_impl(const void* logits, i64 row_stride, int rows, int cols, u32 column0, int chunk,
                                   int chunks, int aligned, const float* temperature, float threshold,
                                   const i64* seeds, const i64* offsets, i64* step_counter, u64 unseeded_seed,
                                   int advance_step, i64* out, int want_tokens, const float* gumbel_table,
                                   u64 ctrl_ptr, u64 lines, int line_count, const u64* peer_slots,
                                   u64 host_error, int rank, int world, int max_rows, u64 timeout_ns) {
    typedef typename Elem<DTYPE>::raw raw;
    __shared__ float s_table[GUMBEL_TABLE_SIZE + 4];
    ChannelCtrl* ctrl = (ChannelCtrl*)ctrl_ptr;
    // Work item 0 (the collector: row 0's first chunk) runs in the grid's last block, item w
    // in block w - 1. Blocks start in index order, so by the time the collector waits, every
    // block it waits for has started, and none of them waits for anything. Run as block 0, a
    // collector that held its SM while the grid was larger than what fits the GPU at once
    // (another kernel beside it, or more registers or shared memory per block) kept later
    // blocks from starting until it timed out.
    const int work = blockIdx.x + 1 == gridDim.x ? 0 : (int)blockIdx.x + 1;
    const bool collector = work == 0;

    const int row = work / chunks;
    const int chunk_index = work - row * chunks;
    const int begin = chunk_index * chunk;
    const int end = min(cols, begin + chunk);
    const raw* row_ptr = (const raw*)logits + (i64)row * row_stride;
    const int VEC = Elem<DTYPE>::per16;
    // 16-byte packs over [begin, vec_end) when the rows allow (begin is a multiple of VEC).
    const int vec_end = aligned ? begin + max(0, (end - begin) / VEC) * VEC : begin;

    // The epoch (and, in the collector, what the exchange needs) is loaded up front, beside the
    // row's inputs: off the path from the last block's key to the exchange.
    Exchange x = {ctrl, lines, line_count, peer_slots, (HostError*)host_error, rank, world, max_rows, timeout_ns};
    ExchangeStart start;
    if (collector) {
        start = exchange_prologue(x);
    } else {
        start.epoch = *(volatile u32*)&ctrl->epoch;
        start.failed_before = 0u;
    }

    // A row's inputs are loaded side by side, with no branch between them: on a sampled
    // row each dependent load would add a memory round trip to a latency-bound call.
    float t = 1.0f;
    u64 seed = unseeded_seed, offset = 0ull;
    const int TABLE_PER_THREAD = (GUMBEL_TABLE_SIZE + 4 + LL_THREADS - 1) / LL_THREADS;
    float table_part[TABLE_PER_THREAD];
    const bool pruned_quad_chunk =
        ONE_TILE && chunk <= 4 * PRUNED_QUADS_MAX * LL_THREADS && aligned && (column0 & 3u) == 0u;
    if (temperature) {  // uniform: the call has sampled rows
        t = temperature[row];
        if (seeds) {
            seed = (u64)seeds[row];
            offset = (u64)offsets[row];
        } else {
            offset = ((u64)(*(volatile i64*)step_counter) << 32) + (u64)row;
        }
        if (!COLUMNS) {  // uniform: the _columns kernels score every column exactly
#pragma unroll
            for (int k = 0; k < TABLE_PER_THREAD; ++k) {
                const int i = (int)threadIdx.x + k * LL_THREADS;
                table_part[k] = i < GUMBEL_TABLE_SIZE + 4 ? gumbel_table[i] : 0.0f;
            }
        }
    }
    const bool sampled = temperature && f_ge(t, threshold);
    u64 best;
    if (COLUMNS && sampled) {  // uniform over the block
        // The _columns kernels (chunks of one or two columns a thread): each column with its
        // quad's Philox block and its word, one exact score. A thread's chain then holds one or
        // two scores, not the four of a quad: a shorter dependent chain where a call is
        // latency bound.
        RowNoise noise = {t, (u32)seed, (u32)(seed >> 32), (u32)offset, (u32)(offset >> 32)};
        best = scalar_span<DTYPE>(row_ptr, begin, end, column0, true, noise);
    } else if (sampled) {
        RowNoise noise = {t, (u32)seed, (u32)(seed >> 32), (u32)offset, (u32)(offset >> 32)};
#pragma unroll
        for (int k = 0; k < TABLE_PER_THREAD; ++k) {
            const int i = (int)threadIdx.x + k * LL_THREADS;
            if (i < GUMBEL_TABLE_SIZE + 4) s_table[i] = table_part[k];
        }
        if (threadIdx.x == 0) {
            s_low = ordered_int(-__int_as_float(0x7f800000));
            s_survivor_count = 0;
        }
        __syncthreads();
        if (pruned_quad_chunk) {  // uniform over the block
            const int quad_end = begin + max(0, (end - begin) / 4) * 4;
            best = chunk <= 4 * LL_THREADS ? pruned_quads<DTYPE, 1>(row_ptr, begin, quad_end, column0, noise, s_table)
                                           : pruned_quads<DTYPE, 2>(row_ptr, begin, quad_end, column0, noise, s_table);
            const u64 tail = scalar_span<DTYPE>(row_ptr, quad_end, end, column0, true, noise);
            best = tail > best ? tail : best;
        } else {
            // Pruned packs need quads aligned with Philox blocks; otherwise every column is scored.
            const int packed_end = (column0 & 3u) == 0u ? vec_end : begin;
            best = sampled_span<DTYPE, ONE_TILE>(row_ptr, begin, packed_end, column0, noise, s_table);
            const u64 tail = scalar_span<DTYPE>(row_ptr, packed_end, end, column0, true, noise);
            best = tail > best ? tail : best;
        }
    } else {
        RowNoise none = {1.0f, 0u, 0u, 0u, 0u};
        best = greedy_span<DTYPE>(row_ptr, begin, vec_end, column0);
        u64 tail = scalar_span<DTYPE>(row_ptr, vec_end, end, column0, false, none);
        best = tail > best ? tail : best;
    }
    best = block_max(best);

    if (!collector) {
        if (threadIdx.x == 0) {
            store_line(lines + 16ull * (u64)work, (u32)best, start.epoch, (u32)(best >> 32), start.epoch);
        }
        return;
    }

    // The collector: every item's key (one line each), the row maxima, the exchange (whose first
    // barrier publishes s_keys and s_local_failed to the whole block).
    if (rows <= LL_THREADS / 32 &&
        chunks <= (COLUMNS ? COLUMNS_GATHER_MAX_CHUNKS : ROW_GATHER_MAX_CHUNKS)) {  // uniform
        if (!gather_row_maxima<COLUMNS ? 4 : 2>(lines, rows, chunks, start.epoch, timeout_ns, best, s_keys)) {
            s_local_failed = 1u;
        }
    } else {
        u64* s_parts = chunks > 1 ? s_keys + rows : s_keys;
        if (threadIdx.x == 0) s_parts[0] = best;
        const bool complete = gather_block_lines(lines, rows * chunks, start.epoch, timeout_ns, s_parts);
        if (!complete) s_local_failed = 1u;
        __syncthreads();
        if (chunks > 1) reduce_chunk_parts(s_parts, rows, chunks, s_keys);
    }
    exchange_rows<4>(x, start, s_keys, rows, out, want_tokens, step_counter, advance_step);
}

#define LL_ARGMAX_LOGITS_KERNEL(NAME, DTYPE, ONE, COLUMNS)                                                             \
    extern "C" __global__ void __launch_bounds__(LL_THREADS)                                                           \
        NAME(const void* logits, i64 row_stride, int rows, int cols, u32 column0, int chunk, int chunks,               \
             int aligned, const float* temperature, float threshold, const i64* seeds, const i64* offsets,             \
             i64* step_counter, u64 unseeded_seed, int advance_step, i64* out, int want_tokens,                        \
             const float* gumbel_table, u64 ctrl, u64 lines, int line_count, const u64* peer_slots,                    \
             u64 host_error, int rank, int world, int max_rows, u64 timeout_ns) {                                      \
        argmax_logits_impl<DTYPE, ONE, COLUMNS>(logits, row_stride, rows, cols, column0, chunk, chunks, aligned,       \
                                                temperature, threshold, seeds, offsets, step_counter, unseeded_seed,   \
                                                advance_step, out, want_tokens, gumbel_table, ctrl, lines, line_count, \
                                                peer_slots, host_error, rank, world, max_rows, timeout_ns);            \
    }

LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f32, 0, false, false)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_bf16, 1, false, false)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f16, 2, false, false)
// Calls with sampled rows whose every chunk fits one tile (ll_plan picks them).
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f32_one_tile, 0, true, false)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_bf16_one_tile, 1, true, false)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f16_one_tile, 2, true, false)
// Calls with sampled rows whose chunks hold at most two columns a thread (ll_plan picks them).
// Kernels of their own, so the _one_tile kernels' code (and register budget) stays as it is.
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f32_columns, 0, false, true)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_bf16_columns, 1, false, true)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f16_columns, 2, false, true)
