#ifndef TPSPEC_LL_SAMPLED_H
#define TPSPEC_LL_SAMPLED_H

#include "ll_philox_gumbel.h"

// Sampled rows. The contract fixes the noise (Philox4x32-10 of the global column), so
// every column that could win needs its Philox block; the exact portable score is needed
// only by the few columns that can still win. The estimate of a column is
// A = t + G[bucket(h)], t = x * (1/T), h its Philox word; its exact score lies in
// [A - W(A), A + W(A)], W(A) = C0 + REL * |A| (keys.gumbel_bound_table). A + W(A) and
// A - W(A) are increasing in A. `low` is a lower bound of the block's best exact score
// (it starts at -inf): the warp's largest logit X of the tile (its column scores at least
// X/T + noise_min - err) and A - W(A) of columns estimated so far; warps share it through
// s_low. Per tile (SAMPLED_PACKS 16-byte packs a thread, in registers, the next tile
// already loading), per quad (4 columns, one Philox block):
//   pass 1. a lane whose best case (its largest t + noise_max + err) is below low cannot
//      win this tile; when no lane of the warp can, the warp skips Philox for the tile
//      (columns far below the top logit, the common case). Otherwise every quad gets its
//      Philox block: the noise and G[bucket(h)] both decrease as h grows (G holds the
//      midpoints of consecutive word intervals), so A_q = max t + G[bucket(min h)] is at
//      least every estimate of the quad (quads of lanes that cannot win get it too: the
//      bound is sound for every quad, so pass 2 drops them or scores them and they lose),
//      and the column holding min h has the quad's largest noise: its A - W(A) raises
//      low. Then low becomes the warp's maximum (and goes to s_low).
//   pass 2. quads with A_q + W(A_q) >= low (a few per warp) get per-column estimates;
//      every column with A + W(A) >= low is listed (s_survivors).
// Once the block's tiles are done, each listed column still at or above the block's
// final low gets the exact portable score. The winner always does: its score is at least
// every lower bound and at most its own A + W(A) and its quad's A_q + W(A_q).
// The set of exactly scored columns depends on timing (how far s_low has risen), the
// result does not: it is the largest exact key, and the winner is always among them.
// The bound is relative, so it holds for every finite t (an overflowing bound rounds
// outward to +-inf); quads holding a NaN or a t above 1e37 are scored exactly; -inf
// columns can only win when every column is -inf (then low stays -inf and all are scored).
#define HUGE_ESTIMATE 1e37f

__device__ __forceinline__ u32 gumbel_bucket(u32 h) {  // keys.gumbel_bucket_index
    u32 half = h >> 31;
    u32 c = half ? ~h : h;
    u32 lz = __clz(c);
    u32 norm;
    asm("shl.b32 %0, %1, %2;" : "=r"(norm) : "r"(c), "r"(lz));  // PTX clamps: c = 0 gives 0
    u32 sub = (norm >> (31 - GUMBEL_SUB_BITS)) & ((1u << GUMBEL_SUB_BITS) - 1u);
    return half * (33u << GUMBEL_SUB_BITS) + (lz << GUMBEL_SUB_BITS) + sub;
}

__device__ __forceinline__ float bound_error(float t) {  // ABS + REL * |t|
    return GUMBEL_ABS_ERROR + GUMBEL_REL_ERROR * fabsf(t);
}

// Pruning arithmetic, -inf kept as -inf (a plain -inf + inf would give NaN).
__device__ __forceinline__ float best_case(float t, float noise_max) {  // >= every exact score of t
    return t == -__int_as_float(0x7f800000) ? t : t + noise_max + bound_error(t);
}
__device__ __forceinline__ float upper_bound(float a, float c0) {  // A + W(A)
    return a == -__int_as_float(0x7f800000) ? a : a + (c0 + GUMBEL_REL_ERROR * fabsf(a));
}
__device__ __forceinline__ float lower_bound(float a, float c0) {  // A - W(A)
    return a - (c0 + GUMBEL_REL_ERROR * fabsf(a));
}

// Order-preserving int of a non-NaN float (signed compare), and back.
__device__ __forceinline__ int ordered_int(float f) {
    const int i = __float_as_int(f);
    return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float from_ordered_int(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// Canonical float bits back from ordered_high (inverse of ordered_high).
__device__ __forceinline__ u32 canonical_from_ordered(u32 o) { return (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o; }

// Canonical float32 bits of value i (0 <= i < VEC, a run-time index) of a pack.
template <int DTYPE>
__device__ __forceinline__ u32 pack_value_at(const uint4& p, int i) {
    const int per_word = 4 / (int)sizeof(typename Elem<DTYPE>::raw);
    const int word_index = i / per_word;
    const u32 word = word_index == 0 ? p.x : (word_index == 1 ? p.y : (word_index == 2 ? p.z : p.w));
    if (per_word == 1) return canonical_bits(word);
    const u16 half = (i & 1) ? (u16)(word >> 16) : (u16)(word & 0xffffu);
    return canonical_bits(Elem<DTYPE>::bits((typename Elem<DTYPE>::raw)half));
}

template <int DTYPE>
__device__ __forceinline__ float widened(const uint4& pack, int i) {  // value i as float32 (no canonicalization)
    const typename Elem<DTYPE>::raw* vals = (const typename Elem<DTYPE>::raw*)&pack;
    return fbits(Elem<DTYPE>::bits(vals[i]));
}

// Largest value of quad q of a pack as float32, NaN when it holds one (packed maxima for
// 16-bit types; multiplying by 1/T > 0 keeps the order, so it gives the quad's max t).
template <int DTYPE>
__device__ __forceinline__ float quad_max_value(const uint4& p, int q);
template <>
__device__ __forceinline__ float quad_max_value<0>(const uint4& p, int q) {
    return f_max_nan(f_max_nan(fbits(p.x), fbits(p.y)), f_max_nan(fbits(p.z), fbits(p.w)));
}
template <>
__device__ __forceinline__ float quad_max_value<1>(const uint4& p, int q) {
    const u32 m = bf16x2_max_nan(pack_word(p, 2 * q), pack_word(p, 2 * q + 1));
    return f_max_nan(fbits(m << 16), fbits(m & 0xffff0000u));
}
template <>
__device__ __forceinline__ float quad_max_value<2>(const uint4& p, int q) {
    const u32 m = f16x2_max_nan(pack_word(p, 2 * q), pack_word(p, 2 * q + 1));
    return f_max_nan(fbits(f16_to_f32_bits((u16)(m & 0xffffu))), fbits(f16_to_f32_bits((u16)(m >> 16))));
}

// The smallest Philox word of a quad and the value (float32) of the column holding it.
struct MinWord {
    u32 word;
    float value;
};
template <int DTYPE>
__device__ __forceinline__ MinWord min_word_column(const uint4& p, int q, const Words4& w) {
    MinWord m = {w.w0, widened<DTYPE>(p, 4 * q)};
    const float v1 = widened<DTYPE>(p, 4 * q + 1), v2 = widened<DTYPE>(p, 4 * q + 2);
    const float v3 = widened<DTYPE>(p, 4 * q + 3);
    if (w.w1 < m.word) m = {w.w1, v1};
    if (w.w2 < m.word) m = {w.w2, v2};
    if (w.w3 < m.word) m = {w.w3, v3};
    return m;
}

// Estimate t + G of one column (-inf stays -inf; a NaN t gives NaN, handled per quad).
__device__ __forceinline__ float column_estimate(float t, u32 word, const float* s_table) {
    return t + s_table[gumbel_bucket(word)];
}

// The block's lower bound of its row's best exact score (ordered_int), shared by its warps.
__shared__ int s_low;

// Columns that passed a warp's bound, scored exactly once the block's bound is final (by
// then most of them are below it). A full list falls back to scoring on the spot.
#define SURVIVOR_SLOTS 256
struct Survivor {
    u32 column, bits, word;  // global column, canonical value bits, Philox word
    float estimate;          // +inf: must be scored (a NaN or huge t)
};
__shared__ Survivor s_survivors[SURVIVOR_SLOTS];
__shared__ int s_survivor_count;

// One tile of sampled_span (see there): this thread's packs (pack k holds the columns from
// bases[k]; none when bases[k] >= vec_end). BLOCK_BOUND (a block of one tile only: every
// thread of the block must call): pass 2 waits at a barrier for every warp's pass 1 and
// lists against the block's bound instead of the warp's, so fewer columns get listed and
// exactly scored.
template <int DTYPE, bool BLOCK_BOUND>
__device__ __forceinline__ void sampled_tile(const uint4 (&packs)[SAMPLED_PACKS], const int (&bases)[SAMPLED_PACKS],
                                             int vec_end, u32 column0, const RowNoise& noise,
                                             const PhiloxKeys& keys, const float* s_table, float inv_t, u64& best) {
    const int VEC = Elem<DTYPE>::per16;
    const int K = SAMPLED_PACKS;
    const int QPP = VEC / 4;  // quads per pack
    const float c0 = s_table[GUMBEL_TABLE_SIZE];
    const float noise_max = s_table[GUMBEL_TABLE_SIZE + 1];
    const float noise_min = s_table[GUMBEL_TABLE_SIZE + 2];
    const int lane = (int)(threadIdx.x & 31u);
    float low = from_ordered_int(*(volatile int*)&s_low);
    // The lane's and the warp's largest logit of the tile (ordered; 0: no real pack).
    u32 lane_top = 0u;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (bases[k] < vec_end) {
            const u32 order = ordered_high(canonical_bits(pack_max_bits<DTYPE>(packs[k])));
            lane_top = order > lane_top ? order : lane_top;
        }
    }
    const u32 top = warp_max_u32(lane_top);
    if (top != 0u && top <= ordered_high(0x7f800000u)) {
        const float t_top = fbits(canonical_from_ordered(top)) * inv_t;
        if (fabsf(t_top) <= HUGE_ESTIMATE) low = fmaxf(low, t_top + noise_min - bound_error(t_top));
    }
    // The skip rule, per lane: a lane whose largest t cannot reach low even with the
    // largest noise needs no noise this tile. Once any lane needs it, every quad gets
    // its Philox block (side by side, no divergence); pass 2 then sorts them by reach.
    bool lane_needed = false;
    if (lane_top != 0u) {
        const float t_lane = fbits(canonical_from_ordered(lane_top)) * inv_t;  // NaN: a NaN column
        lane_needed = !(t_lane <= HUGE_ESTIMATE) || !(best_case(t_lane, noise_max) < low);
    }
    // Pass 1, per quad: A_q + W(A_q) (what the quad can reach) and A - W(A) of its
    // smallest word's column (the quad's largest noise), a lower bound of the row's best score.
    float reach[K * QPP];
#pragma unroll
    for (int j = 0; j < K * QPP; ++j) reach[j] = -__int_as_float(0x7f800000);
    if (__any_sync(0xffffffffu, lane_needed)) {
#pragma unroll
        for (int j = 0; j < K * QPP; ++j) {
            const int k = j / QPP, q = j - k * QPP;
            const float t_quad = quad_max_value<DTYPE>(packs[k], q) * inv_t;
            const bool special = !(t_quad <= HUGE_ESTIMATE);  // NaN or huge: score exactly
            const u32 column = column0 + (u32)(bases[k] + 4 * q);
            const Words4 w = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, keys);
            const MinWord m = min_word_column<DTYPE>(packs[k], q, w);
            const float g = s_table[gumbel_bucket(m.word)];
            reach[j] = special ? __int_as_float(0x7f800000) : upper_bound(t_quad + g, c0);
            if (bases[k] < vec_end && !special) low = fmaxf(low, lower_bound(m.value * inv_t + g, c0));
        }
    }
    {  // the warp's bound, and the block's
        int low_bits = warp_max_i32(ordered_int(low));
        if (lane == 0) low_bits = max(low_bits, atomicMax(&s_low, low_bits));
        low = from_ordered_int(__shfl_sync(0xffffffffu, low_bits, 0));
    }
    if (BLOCK_BOUND) {  // every warp's pass 1 is in s_low: pass 2 lists against the block's bound
        __syncthreads();
        low = from_ordered_int(*(volatile int*)&s_low);
    }
    // Pass 2: quads that can still reach low (a few per warp) list every column that can.
    u32 candidates = 0u, specials = 0u;
#pragma unroll
    for (int j = 0; j < K * QPP; ++j) {
        // (-inf reach passes a -inf low: packs past the span must not)
        if (bases[j / QPP] < vec_end && !(reach[j] < low)) candidates |= 1u << j;
        if (reach[j] == __int_as_float(0x7f800000)) specials |= 1u << j;
    }
    while (candidates) {
        const int j = __ffs(candidates) - 1;
        candidates &= candidates - 1u;
        const int k = j / QPP, first = (j - k * QPP) * 4;
        const uint4 pack = k == 0 ? packs[0] : packs[K - 1];
        const u32 column = column0 + (u32)((k == 0 ? bases[0] : bases[K - 1]) + first);
        const bool special = (specials >> j) & 1u;
        const Words4 w = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, keys);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 bits = pack_value_at<DTYPE>(pack, first + i);
            const u32 word = pick_word(w, (u32)i);
            const float est = column_estimate(fbits(bits) * inv_t, word, s_table);
            if (special || !(upper_bound(est, c0) < low)) {
                const int slot = atomicAdd(&s_survivor_count, 1);
                if (slot < SURVIVOR_SLOTS) {
                    s_survivors[slot] = {column + (u32)i, bits, word, special ? __int_as_float(0x7f800000) : est};
                } else {
                    const u64 key = make_ukey(gumbel_score_bits(bits, noise.temperature, word), column + (u32)i);
                    best = key > best ? key : best;
                }
            }
        }
    }
    __syncwarp();  // reconverge here, or the lanes run the next tile's setup apart
}

// Sampled rows whose slice starts at a global column that is a multiple of 4 (so a quad
// of a pack is one Philox block; the host's vocab offsets are in practice). See above.
// ONE_TILE (the fused kernels the host picks when every block's chunk fits one tile): a
// block whose span is one tile runs it outside the tile loop, with the block's bound in
// pass 2; other blocks take the loop. Separate kernels, so the loop of the others keeps
// its code (the barrier inside the loop's code took it from 64 to 86 registers).
template <int DTYPE, bool ONE_TILE>
__device__ u64 sampled_span(const typename Elem<DTYPE>::raw* row_ptr, int begin, int vec_end, u32 column0,
                            const RowNoise& noise, const float* s_table) {
    const int VEC = Elem<DTYPE>::per16;
    const int K = SAMPLED_PACKS;
    const float c0 = s_table[GUMBEL_TABLE_SIZE];
    const float inv_t = 1.0f / noise.temperature;  // estimates only: any rounding is in the error bound
    const int stride = (int)blockDim.x * VEC * K;
    const PhiloxKeys keys = philox_keys(noise.seed_lo, noise.seed_hi);
    u64 best = 0ull;
    // This thread's pack k of a tile is pack_ptr[k * blockDim.x]; the pointer advances a
    // tile at a time (no per-tile 64-bit address arithmetic).
    const int thread_base = begin + (int)threadIdx.x * VEC;
    const int pack_stride = (int)blockDim.x;  // in 16-byte packs
    const uint4* pack_ptr = (const uint4*)(row_ptr + thread_base);
    uint4 next[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        next[k] = thread_base + k * pack_stride * VEC < vec_end ? load_pack(pack_ptr + k * pack_stride)
                                                                : make_uint4(0u, 0u, 0u, 0u);
    }
    if (ONE_TILE && begin < vec_end && begin + stride >= vec_end) {  // uniform over the block
        uint4 packs[K];
        int bases[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            packs[k] = next[k];
            bases[k] = thread_base + k * pack_stride * VEC;
        }
        sampled_tile<DTYPE, true>(packs, bases, vec_end, column0, noise, keys, s_table, inv_t, best);
    } else {
        for (int tile = begin; tile < vec_end; tile += stride) {  // uniform over the block
            uint4 packs[K];
            int bases[K];
            pack_ptr += K * pack_stride;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                packs[k] = next[k];
                bases[k] = tile - begin + thread_base + k * pack_stride * VEC;
                next[k] = bases[k] + stride < vec_end ? load_pack(pack_ptr + k * pack_stride)
                                                      : make_uint4(0u, 0u, 0u, 0u);
            }
            sampled_tile<DTYPE, false>(packs, bases, vec_end, column0, noise, keys, s_table, inv_t, best);
        }
    }
    // The survivors against the block's final bound, one per thread.
    __syncthreads();
    const float final_low = from_ordered_int(*(volatile int*)&s_low);
    const int listed = min(*(volatile int*)&s_survivor_count, SURVIVOR_SLOTS);
    for (int i = threadIdx.x; i < listed; i += blockDim.x) {
        const Survivor sv = s_survivors[i];
        if (!(upper_bound(sv.estimate, c0) < final_low)) {
            const u64 key = make_ukey(gumbel_score_bits(sv.bits, noise.temperature, sv.word), sv.column);
            best = key > best ? key : best;
        }
    }
    return best;
}

// Columns [begin, end) one by one (unaligned rows and the tail after the 16-byte packs).
template <int DTYPE>
__device__ __forceinline__ u64 scalar_span(const typename Elem<DTYPE>::raw* row_ptr, int begin, int end,
                                           u32 column0, bool sampled, const RowNoise& noise) {
    u64 best = 0ull;
    for (int col = begin + threadIdx.x; col < end; col += blockDim.x) {
        const u64 key = exact_key(canonical_bits(Elem<DTYPE>::bits(row_ptr[col])), column0 + (u32)col, sampled, noise);
        best = key > best ? key : best;
    }
    return best;
}

// The quad of columns at p (a multiple of 4 columns from a 16-byte aligned row start) as
// loaded, in one read-only load: four float32 words, or four 16-bit values in x and y.
template <int DTYPE>
__device__ __forceinline__ uint4 load_quad(const typename Elem<DTYPE>::raw* p) {
    if (DTYPE == 0) return load_pack(p);
    uint4 q = make_uint4(0u, 0u, 0u, 0u);
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(q.x), "=r"(q.y) : "l"(p));
    return q;
}

// Value k (0-3) of a loaded quad as float32 bits (widened, not canonicalized).
template <int DTYPE>
__device__ __forceinline__ u32 quad_bits(const uint4& q, int k) {
    if (DTYPE == 0) return k == 0 ? q.x : (k == 1 ? q.y : (k == 2 ? q.z : q.w));
    const u32 word = k < 2 ? q.x : q.y;
    return Elem<DTYPE>::bits((typename Elem<DTYPE>::raw)((k & 1) ? word >> 16 : word & 0xffffu));
}

// Sampled columns [begin, quad_end) of a block, QPT (1 or 2) quads a thread: thread i's quad j
// starts at column begin + 4 * (i + j * blockDim.x) (begin and column0 multiples of 4, 16-byte
// aligned rows). Pruned within each warp, with no barrier and no shared list: every quad gets
// its Philox block and every column its estimate A = t + G[bucket(h)] (as in sampled_span);
// the warp's bound `low` is its largest A - W(A), a lower bound of its best exact score; only
// columns with A + W(A) >= low can be the warp's best, and only they get the exact portable
// score, one after another in the lanes that hold them. On random rows about one column a
// warp passes (the table's bound is that tight), so a warp runs about one exact score where
// scoring every column ran four a lane. PRUNED_QUADS_MAX bounds QPT: more quads a thread cost
// registers and gained nothing. Columns with a NaN or huge t pass without raising low; -inf columns reach -inf, so they pass only when low is -inf (every column of
// the warp -inf). The result, the max of the passing columns' exact keys, is the max of all of them.
template <int DTYPE, int QPT>
__device__ u64 pruned_quads(const typename Elem<DTYPE>::raw* row_ptr, int begin, int quad_end, u32 column0,
                            const RowNoise& noise, const float* s_table) {
    const float c0 = s_table[GUMBEL_TABLE_SIZE];
    const float inv_t = 1.0f / noise.temperature;  // estimates only: any rounding is in the error bound
    // Two quads share one key schedule; one quad derives its keys inside its rounds (the
    // schedule's moves are volatile, so an unused one would still run).
    PhiloxKeys keys;
    if constexpr (QPT > 1) keys = philox_keys(noise.seed_lo, noise.seed_hi);
    uint4 quad[QPT];
    Words4 words[QPT];
    float reach[QPT][4];
    float low = -__int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        const int col = begin + 4 * ((int)threadIdx.x + j * (int)blockDim.x);
        quad[j] = col < quad_end ? load_quad<DTYPE>(row_ptr + col) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        const int col = begin + 4 * ((int)threadIdx.x + j * (int)blockDim.x);
        const u32 column = column0 + (u32)col;
        if constexpr (QPT == 1) {
            words[j] = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, noise.seed_lo, noise.seed_hi);
        } else {
            words[j] = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, keys);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float t = fbits(quad_bits<DTYPE>(quad[j], k)) * inv_t;
            const bool special = !(t <= HUGE_ESTIMATE);  // NaN or huge: scored exactly
            const float estimate = column_estimate(t, pick_word(words[j], (u32)k), s_table);
            reach[j][k] = special ? __int_as_float(0x7f800000) : upper_bound(estimate, c0);
            if (col < quad_end && !special) low = fmaxf(low, lower_bound(estimate, c0));
        }
    }
    low = from_ordered_int(warp_max_i32(ordered_int(low)));
    u32 passing = 0u;  // bit 4 * j + k: column k of quad j
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        const int col = begin + 4 * ((int)threadIdx.x + j * (int)blockDim.x);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (col < quad_end && !(reach[j][k] < low)) passing |= 1u << (4 * j + k);
        }
    }
    u64 best = 0ull;
    while (passing) {
        const int bit = __ffs(passing) - 1;
        passing &= passing - 1u;
        const int j = bit >> 2;
        const u32 k = (u32)(bit & 3);
        const uint4 q = (QPT > 1 && j == 1) ? quad[QPT - 1] : quad[0];  // selects, not a local array
        const Words4 w = (QPT > 1 && j == 1) ? words[QPT - 1] : words[0];
        u32 bits = quad_bits<DTYPE>(q, 0);
        bits = k == 1u ? quad_bits<DTYPE>(q, 1) : bits;
        bits = k == 2u ? quad_bits<DTYPE>(q, 2) : bits;
        bits = k == 3u ? quad_bits<DTYPE>(q, 3) : bits;
        const u32 column = column0 + (u32)(begin + 4 * ((int)threadIdx.x + j * (int)blockDim.x)) + k;
        const u64 key = make_ukey(gumbel_score_bits(canonical_bits(bits), noise.temperature, pick_word(w, k)), column);
        best = key > best ? key : best;
    }
    __syncwarp();  // reconverge before the block's maximum
    return best;
}

#endif  // TPSPEC_LL_SAMPLED_H
