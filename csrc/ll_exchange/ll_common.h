#ifndef TPSPEC_LL_COMMON_H
#define TPSPEC_LL_COMMON_H

// What every LL kernel uses: integer types, IEEE float32 arithmetic with explicit
// rounding, the 64-bit key encoding, value loads and warp / block maxima.

#include "ll_constants.h"

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;

// ----------------------------------------------------------------- IEEE float32 helpers

// NAME(a, b): one PTX instruction of two operands and one result, each in a register of
// constraint C ("f": float32, "r": 32 bits), of C type T.
#define LL_BINARY_INSTRUCTION(NAME, T, C, INSTRUCTION)                    \
    __device__ __forceinline__ T NAME(T a, T b) {                         \
        T r;                                                              \
        asm(INSTRUCTION " %0, %1, %2;" : "=" C(r) : C(a), C(b));          \
        return r;                                                         \
    }

LL_BINARY_INSTRUCTION(f_add, float, "f", "add.rn.f32")
LL_BINARY_INSTRUCTION(f_sub, float, "f", "sub.rn.f32")
LL_BINARY_INSTRUCTION(f_mul, float, "f", "mul.rn.f32")
LL_BINARY_INSTRUCTION(f_div, float, "f", "div.rn.f32")
__device__ __forceinline__ bool f_ge(float a, float b) {  // a >= b, IEEE (false on NaN), no ftz
    u32 r;
    asm("{ .reg .pred p; setp.ge.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
__device__ __forceinline__ float f_from_u64(u64 v) {  // round to nearest even
    float r;
    asm("cvt.rn.f32.u64 %0, %1;" : "=f"(r) : "l"(v));
    return r;
}
__device__ __forceinline__ float f_from_i32(int v) {  // exact for the small ints used here
    float r;
    asm("cvt.rn.f32.s32 %0, %1;" : "=f"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 f16_to_f32_bits(u16 h) {  // exact widening
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return __float_as_uint(r);
}
__device__ __forceinline__ float fbits(u32 b) { return __uint_as_float(b); }

// ------------------------------------------------------------------------------ keys

// -0 -> +0, every NaN -> the canonical NaN (integer ops only: no ftz can touch them).
__device__ __forceinline__ u32 canonical_bits(u32 b) {
    if ((b & 0x7fffffffu) == 0u) return 0u;
    if ((b & 0x7fffffffu) > 0x7f800000u) return CANONICAL_NAN_BITS;
    return b;
}

// Canonical float bits -> the unsigned form of the key's high word (order preserving).
__device__ __forceinline__ u32 ordered_high(u32 canon) {
    return (canon & 0x80000000u) ? ~canon : (canon | 0x80000000u);
}

__device__ __forceinline__ u64 make_ukey(u32 canon, u32 column) {
    return ((u64)ordered_high(canon) << 32) | (u64)(0xffffffffu - column);
}

// ----------------------------------------------------------------------- value loads

template <int DTYPE>  // 0: float32, 1: bfloat16, 2: float16
struct Elem;

template <>
struct Elem<0> {
    typedef u32 raw;
    static const int per16 = 4;
    static __device__ __forceinline__ u32 bits(u32 v) { return v; }
};
template <>
struct Elem<1> {
    typedef u16 raw;
    static const int per16 = 8;
    static __device__ __forceinline__ u32 bits(u16 v) { return ((u32)v) << 16; }
};
template <>
struct Elem<2> {
    typedef u16 raw;
    static const int per16 = 8;
    static __device__ __forceinline__ u32 bits(u16 v) { return f16_to_f32_bits(v); }
};

// ------------------------------------------------------------------------ 16-byte packs

__device__ __forceinline__ uint4 load_pack(const void* address) {  // read-only 16-byte load
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(address));
    return v;
}

// --- NaN-propagating maxima (sm_80+; no .ftz, so subnormals compare exactly)
LL_BINARY_INSTRUCTION(f_max_nan, float, "f", "max.NaN.f32")
LL_BINARY_INSTRUCTION(bf16x2_max_nan, u32, "r", "max.NaN.bf16x2")
LL_BINARY_INSTRUCTION(f16x2_max_nan, u32, "r", "max.NaN.f16x2")

// float32 bits of the largest value of a pack (any NaN in it -> a NaN). Which zero or
// which NaN comes back does not matter: the caller canonicalizes.
template <int DTYPE>
__device__ __forceinline__ u32 pack_max_bits(uint4 p);
template <>
__device__ __forceinline__ u32 pack_max_bits<0>(uint4 p) {
    float m = f_max_nan(f_max_nan(fbits(p.x), fbits(p.y)), f_max_nan(fbits(p.z), fbits(p.w)));
    return __float_as_uint(m);
}
template <>
__device__ __forceinline__ u32 pack_max_bits<1>(uint4 p) {
    u32 m = bf16x2_max_nan(bf16x2_max_nan(p.x, p.y), bf16x2_max_nan(p.z, p.w));
    return __float_as_uint(f_max_nan(fbits(m & 0xffff0000u), fbits(m << 16)));
}
template <>
__device__ __forceinline__ u32 pack_max_bits<2>(uint4 p) {
    u32 m = f16x2_max_nan(f16x2_max_nan(p.x, p.y), f16x2_max_nan(p.z, p.w));
    return __float_as_uint(f_max_nan(fbits(f16_to_f32_bits((u16)(m & 0xffffu))), fbits(f16_to_f32_bits((u16)(m >> 16)))));
}

// Canonical float32 bits of value i of a pack.
template <int DTYPE>
__device__ __forceinline__ u32 pack_value(const uint4& p, int i) {
    const typename Elem<DTYPE>::raw* vals = (const typename Elem<DTYPE>::raw*)&p;
    return canonical_bits(Elem<DTYPE>::bits(vals[i]));
}

// --------------------------------------------------------------------- warp / block max

__device__ __forceinline__ int warp_max_i32(int v) {  // every lane of the warp must call
    int r;
    asm volatile("redux.sync.max.s32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 warp_max_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}

// Word w (0-3) of a pack.
__device__ __forceinline__ u32 pack_word(const uint4& p, int w) {
    return w == 0 ? p.x : (w == 1 ? p.y : (w == 2 ? p.z : p.w));
}

// Max of a 64-bit value over the warp: the high words' max, then the low words' max among
// the lanes holding it (two redux instructions instead of five dependent shuffle rounds).
__device__ __forceinline__ u64 warp_max_u64(u64 v) {  // every lane of the warp must call
    const u32 high = warp_max_u32((u32)(v >> 32));
    const u32 low = warp_max_u32((u32)(v >> 32) == high ? (u32)v : 0u);
    return ((u64)high << 32) | (u64)low;
}

__device__ __forceinline__ u64 block_max(u64 v) {
    __shared__ u64 s_warp[LL_THREADS / 32];
    v = warp_max_u64(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) s_warp[warp] = v;
    __syncthreads();
    if (warp == 0) v = warp_max_u64(lane < (int)(blockDim.x >> 5) ? s_warp[lane] : 0ull);
    return v;  // valid in thread 0
}

#endif  // TPSPEC_LL_COMMON_H
