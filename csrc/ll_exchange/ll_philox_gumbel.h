#ifndef TPSPEC_LL_PHILOX_GUMBEL_H
#define TPSPEC_LL_PHILOX_GUMBEL_H

#include "ll_common.h"

// The noise of sampled rows and its exact score: Philox4x32-10 words of a column and the
// portable Gumbel score x / T - ln(-ln(1 - U)), bit for bit as tpspec/keys.py computes them.
// Every operation of an exact score is an inline-PTX .rn instruction of ll_common.h, in the
// reference's order, so no compiler flag (FMA contraction, -ftz) can change a bit.

// ---------------------------------------------------------------------------- philox

struct Words4 {
    u32 w0, w1, w2, w3;
};

__device__ __forceinline__ Words4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        u32 hi0 = __umulhi(PHILOX_M0, c0), lo0 = PHILOX_M0 * c0;
        u32 hi1 = __umulhi(PHILOX_M1, c2), lo1 = PHILOX_M1 * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    Words4 w = {c0, c1, c2, c3};
    return w;
}

// Philox4x32-10 with the key schedule (round r's key words) computed once by the caller.
struct PhiloxKeys {
    u32 k0[10], k1[10];
};

// The moves are opaque to the compiler, so it keeps the 20 words in registers instead of
// recomputing them with two adds per round of every Philox block.
__device__ __forceinline__ u32 kept(u32 v) {
    u32 r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
    return r;
}

__device__ __forceinline__ PhiloxKeys philox_keys(u32 k0, u32 k1) {
    PhiloxKeys keys;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        keys.k0[round] = kept(k0 + (u32)round * PHILOX_W0);
        keys.k1[round] = kept(k1 + (u32)round * PHILOX_W1);
    }
    return keys;
}

__device__ __forceinline__ Words4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, const PhiloxKeys& keys) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        u32 hi0 = __umulhi(PHILOX_M0, c0), lo0 = PHILOX_M0 * c0;
        u32 hi1 = __umulhi(PHILOX_M1, c2), lo1 = PHILOX_M1 * c2;
        u32 n0 = hi1 ^ c1 ^ keys.k0[round], n2 = hi0 ^ c3 ^ keys.k1[round];
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    Words4 w = {c0, c1, c2, c3};
    return w;
}

__device__ __forceinline__ u32 pick_word(const Words4& w, u32 k) {
    return k == 0 ? w.w0 : (k == 1 ? w.w1 : (k == 2 ? w.w2 : w.w3));
}

// ----------------------------------------------------------------- portable arithmetic

// x = m * 2^e with m in [sqrt(1/2), sqrt(2)] (positive, finite, normal x): portable_log's
// reduction, exact.
struct LogReduction {
    float m;
    float e;
};
__device__ __forceinline__ LogReduction log_reduction(float x) {
    u32 bits = __float_as_uint(x);
    int exponent = (int)((bits >> 23) & 0xffu) - 127;
    u32 mantissa_bits = (bits & 0x007fffffu) | 0x3f800000u;
    int big = mantissa_bits > SQRT2_BITS ? 1 : 0;
    float m = fbits(mantissa_bits);
    if (big) m = f_mul(m, 0.5f);
    return {m, f_from_i32(exponent + big)};
}

// keys.portable_log: positive, finite, normal float32 x.
__device__ __forceinline__ float portable_log(float x) {
    const LogReduction r = log_reduction(x);
    float s = f_div(f_sub(r.m, 1.0f), f_add(r.m, 1.0f));
    float z = f_mul(s, s);
    float p = f_mul(z, fbits(INV9_BITS));
    p = f_add(p, fbits(INV7_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV5_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV3_BITS));
    p = f_mul(p, z);
    p = f_add(p, 1.0f);
    float t = f_mul(s, p);
    t = f_add(t, t);
    float low = f_mul(r.e, fbits(LN2_LO_BITS));
    low = f_add(low, t);
    float high = f_mul(r.e, fbits(LN2_HI_BITS));
    return f_add(high, low);
}

// (h + 0.5) * 2^-32 rounded once to float32: round(2h + 1) * 2^-33 is the same number.
__device__ __forceinline__ float unit_from_word(u32 h) {
    return f_mul(f_from_u64(2ull * (u64)h + 1ull), fbits(TWO_POW_M33_BITS));
}

// keys.exponential_from_words: E = -ln(1 - U) ~ Exp(1), with no branch. Both of the
// reference's branches are 2 atanh(s) by the same Horner steps, the series one two terms
// longer: U < 1/2 takes s = U / (2 - U); U >= 1/2 takes s = (m - 1) / (m + 1) from the
// complement c = m * 2^e (portable_log's reduction) and adds e ln 2. Picking the operands
// per lane runs one rounding, one division and one series per column where a warp with
// both kinds of lanes ran both branches. Every operation is the reference's, in its
// order (starting the shorter series at the constant 1/9 gives z * 1/9 exactly as
// portable_log's first step), so the bits are the reference's.
__device__ __forceinline__ float exponential_from_word(u32 h) {
    const bool series_branch = h < 0x80000000u;
    const float v = unit_from_word(series_branch ? h : 0xffffffffu - h);  // U, or the complement
    const LogReduction r = log_reduction(v);  // of the complement; unused on the series branch
    const float numerator = series_branch ? v : f_sub(r.m, 1.0f);
    const float denominator = series_branch ? f_sub(2.0f, v) : f_add(r.m, 1.0f);
    const float s = f_div(numerator, denominator);
    const float z = f_mul(s, s);
    float p = f_mul(z, fbits(INV13_BITS));
    p = f_add(p, fbits(INV11_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV9_BITS));
    p = series_branch ? p : fbits(INV9_BITS);
    p = f_mul(p, z);
    p = f_add(p, fbits(INV7_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV5_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV3_BITS));
    p = f_mul(p, z);
    p = f_add(p, 1.0f);
    float t = f_mul(s, p);
    t = f_add(t, t);
    const float low = f_add(f_mul(r.e, fbits(LN2_LO_BITS)), t);  // portable_log's last steps
    const float log_complement = f_add(f_mul(r.e, fbits(LN2_HI_BITS)), low);
    return series_branch ? t : fbits(__float_as_uint(log_complement) ^ 0x80000000u);  // -ln, sign flip: exact
}

// Canonical bits of the Gumbel score x / T - ln(E) of one column (x: canonical logit).
__device__ __forceinline__ u32 gumbel_score_bits(u32 x_canon, float temperature, u32 word) {
    float e = exponential_from_word(word);
    float log_e = portable_log(e);
    float scaled = f_div(fbits(x_canon), temperature);
    return canonical_bits(__float_as_uint(f_sub(scaled, log_e)));
}

struct RowNoise {  // Gumbel parameters of one sampled row
    float temperature;
    u32 seed_lo, seed_hi, off_lo, off_hi;
};

__device__ __forceinline__ u32 philox_word(u32 column, const RowNoise& noise) {
    Words4 w = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, noise.seed_lo, noise.seed_hi);
    return pick_word(w, column & 3u);
}

// Exact unsigned key of one column (canonical value bits `value`): the portable score.
__device__ __forceinline__ u64 exact_key(u32 value, u32 column, bool sampled, const RowNoise& noise) {
    if (sampled) value = gumbel_score_bits(value, noise.temperature, philox_word(column, noise));
    return make_ukey(value, column);
}

#endif  // TPSPEC_LL_PHILOX_GUMBEL_H
