/* ws_simd.h - the 8-lane float primitives and the canonical dot product shared by the
 * core's C files (internal). AVX2+FMA when the build targets it, else a scalar
 * path that performs the same IEEE operations per lane (fmaf), so both builds give
 * the same bits. */
#ifndef WS_SIMD_H
#define WS_SIMD_H

#include "ws_math.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WS_SIMD 1
#else
#define WS_SIMD 0
#endif

/* ------------------------------------------------------------------------- */
/* dot products: one fixed order for every kernel                             */
/*
 * A dot product of length n accumulates w[k]*x[k] into 8 lanes with fused
 * multiply-adds for k < n8 = n & ~7 (lane k % 8), reduces the lanes in a
 * fixed tree, then adds the tail with fmaf in order. The single-row kernel and
 * the tiled kernels below execute exactly this sequence per output element.
 */

#if WS_SIMD
typedef __m256 lanes8;
static inline lanes8 l8_zero(void) { return _mm256_setzero_ps(); }
static inline lanes8 l8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline lanes8 l8_fma(lanes8 a, lanes8 b, lanes8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline float l8_sum(lanes8 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                 /* l0+l4, l1+l5, l2+l6, l3+l7 */
    __m128 sh = _mm_movehl_ps(s, s);               /* s2, s3                     */
    __m128 s2 = _mm_add_ps(s, sh);                 /* s0+s2, s1+s3               */
    __m128 s3 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 0x1));
    return _mm_cvtss_f32(s3);
}
#else
typedef struct { float v[8]; } lanes8;
static inline lanes8 l8_zero(void) { lanes8 r; memset(&r, 0, sizeof r); return r; }
static inline lanes8 l8_load(const float *p) { lanes8 r; memcpy(r.v, p, sizeof r.v); return r; }
static inline lanes8 l8_fma(lanes8 a, lanes8 b, lanes8 c) {
    for (int i = 0; i < 8; i++) c.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
static inline float l8_sum(lanes8 v) {
    float s0 = v.v[0] + v.v[4], s1 = v.v[1] + v.v[5], s2 = v.v[2] + v.v[6], s3 = v.v[3] + v.v[7];
    float t0 = s0 + s2, t1 = s1 + s3;
    return t0 + t1;
}
#endif

#if WS_SIMD
static inline lanes8 l8_add(lanes8 a, lanes8 b) { return _mm256_add_ps(a, b); }
static inline lanes8 l8_sub1(lanes8 a, float b) { return _mm256_sub_ps(a, _mm256_set1_ps(b)); }
static inline lanes8 l8_set1(float b) { return _mm256_set1_ps(b); }
static inline void l8_store(float *p, lanes8 v) { _mm256_storeu_ps(p, v); }
/* ws_expf on 8 lanes: the same IEEE operations in the same order, per lane */
static inline lanes8 l8_exp(lanes8 x) {
    const __m256 lo = _mm256_cmp_ps(x, _mm256_set1_ps(WS_EXP_LO), _CMP_LT_OQ);
    const __m256 hi = _mm256_cmp_ps(x, _mm256_set1_ps(WS_EXP_HI), _CMP_GT_OQ);
    const __m256 xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(WS_EXP_HI)),
                                    _mm256_set1_ps(WS_EXP_LO));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(WS_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-WS_LN2_HI), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-WS_LN2_LO), r);
    __m256 p = _mm256_set1_ps(WS_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(WS_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(WS_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(WS_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(WS_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(WS_EXP_P5));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
                                   _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    __m256 out = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), e));
    out = _mm256_blendv_ps(out, _mm256_setzero_ps(), lo);
    return _mm256_blendv_ps(out, _mm256_set1_ps(INFINITY), hi);
}
#else
static inline lanes8 l8_add(lanes8 a, lanes8 b) {
    for (int i = 0; i < 8; i++) a.v[i] += b.v[i];
    return a;
}
static inline lanes8 l8_sub1(lanes8 a, float b) {
    for (int i = 0; i < 8; i++) a.v[i] -= b;
    return a;
}
static inline lanes8 l8_set1(float b) {
    lanes8 r;
    for (int i = 0; i < 8; i++) r.v[i] = b;
    return r;
}
static inline void l8_store(float *p, lanes8 v) { memcpy(p, v.v, sizeof v.v); }
static inline lanes8 l8_exp(lanes8 x) {
    for (int i = 0; i < 8; i++) x.v[i] = ws_expf(x.v[i]);
    return x;
}
#endif

/* the l8_sum of four accumulators at once: the same additions per value (the tree
   of l8_sum, lane by lane), shared shuffles */
static inline void l8_sum4(lanes8 a, lanes8 b, lanes8 c, lanes8 d, float out[4]) {
#if WS_SIMD
    const __m256 sab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                                     _mm256_permute2f128_ps(a, b, 0x31)); /* a: l0+l4.. | b */
    const __m256 scd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20),
                                     _mm256_permute2f128_ps(c, d, 0x31));
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(sab, scd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(sab, scd, _MM_SHUFFLE(3, 2, 3, 2)));
    /* t: [a.t0 a.t1 c.t0 c.t1 | b.t0 b.t1 d.t0 d.t1]; then t0 + t1 */
    const __m256 u = _mm256_add_ps(t, _mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    float v[8];
    _mm256_storeu_ps(v, u);
    out[0] = v[0];
    out[1] = v[4];
    out[2] = v[2];
    out[3] = v[6];
#else
    out[0] = l8_sum(a);
    out[1] = l8_sum(b);
    out[2] = l8_sum(c);
    out[3] = l8_sum(d);
#endif
}

static inline float dot_tail(float acc, const float *w, const float *x, int k, int n) {
    for (; k < n; k++) acc = fmaf(w[k], x[k], acc);
    return acc;
}

static inline float dot(const float *w, const float *x, int n) {
    const int n8 = n & ~7;
    lanes8 a = l8_zero();
    for (int k = 0; k < n8; k += 8) a = l8_fma(l8_load(w + k), l8_load(x + k), a);
    return dot_tail(l8_sum(a), w, x, n8, n);
}

/* ------------------------------------------------------------------------- */
/* IEEE half <-> float (the f16 KV cache)                                      */
/*
 * The scalar conversions are the reference; with F16C the 8-lane instructions
 * compute the same bits (round to nearest even, subnormals kept, NaN quietened
 * with its top payload bits), so both builds store and read identical values.
 */

static inline uint16_t half_from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* infinity, or NaN made quiet */
        return (uint16_t)(sign | (ax == 0x7f800000u ? 0x7c00u : 0x7e00u | ((ax >> 13) & 0x3ffu)));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: rounds to inf */
    if (ax < 0x38800000u) {                                    /* below 2^-14: subnormal */
        if (ax <= 0x33000000u) return sign;                    /* <= 2^-25: rounds to 0  */
        const uint32_t e = ax >> 23;                           /* 102..112               */
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;                       /* units of 2^-24: 14..24 */
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t q = ((ax >> 23) - 112u) << 10 | (ax & 0x7fffffu) >> 13; /* rebias 127 -> 15 */
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++; /* a carry moves the exponent */
    return (uint16_t)(sign | q);
}

static inline float float_from_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | man << 13 | (man ? 0x400000u : 0u); /* inf, quiet NaN */
    } else if (exp != 0) {
        bits = sign | (exp + 112u) << 23 | man << 13;
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: man * 2^-24, normalised */
        uint32_t e = 113u;
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        bits = sign | e << 23 | (man & 0x3ffu) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if WS_SIMD && defined(__F16C__)
#define WS_F16C 1
#else
#define WS_F16C 0
#endif

/* 8 halves as 8 floats */
static inline lanes8 l8_load_h(const uint16_t *p) {
#if WS_F16C
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif WS_SIMD
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = float_from_half(p[i]);
    return _mm256_loadu_ps(f);
#else
    lanes8 r;
    for (int i = 0; i < 8; i++) r.v[i] = float_from_half(p[i]);
    return r;
#endif
}

/* ------------------------------------------------------------------------- */
/* the q8_0 KV cache: blocks of 32 int8 values and one half scale d            */
/*
 * A block holds x ~ d * q (llama.cpp's block_q8_0: the half d first, then the 32
 * int8 q). Read back, a value is the float product d * q: exact (an 11-bit
 * significand times a 7-bit integer fits a float's 24 bits), so every build reads
 * the same floats, which then take the f32 path's arithmetic.
 */
#define WS_Q8_BLOCK 32
#define WS_Q8_BLOCK_BYTES 34

/* the scale of the block that starts at p, as a float (exact) */
static inline float q8_scale(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if WS_F16C
    return _cvtsh_ss(h);
#else
    return float_from_half(h);
#endif
}

/* 8 values of a block from value i (i + 8 <= 32): d * q as floats */
static inline lanes8 l8_load_q8(const uint8_t *blk, int i, float d) {
#if WS_SIMD
    const __m128i q = _mm_loadl_epi64((const __m128i *)(const void *)(blk + 2 + i));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(d));
#else
    lanes8 r;
    for (int k = 0; k < 8; k++) r.v[k] = (float)(int8_t)blk[2 + i + k] * d;
    return r;
#endif
}

/* x[0..32) into one block: d = amax / 127 rounded to half, q = round(x / d) with
 * x / d taken as x * (1 / d) before d is rounded (llama.cpp's quantize_row_q8_0_ref).
 * Scalar in every build (the same bits); a NaN, or an infinity's x * 0, stores 0. */
static inline void q8_quantize_block(const float *x, uint8_t *blk) {
    float amax = 0.0f;
    for (int k = 0; k < WS_Q8_BLOCK; k++) {
        const float a = fabsf(x[k]);
        if (a > amax) amax = a;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = half_from_float(d);
    memcpy(blk, &dh, sizeof dh);
    for (int k = 0; k < WS_Q8_BLOCK; k++) {
        const float r = roundf(x[k] * id);
        const int q = r >= 127.0f ? 127 : r <= -127.0f ? -127 : r == r ? (int)r : 0;
        blk[2 + k] = (uint8_t)(int8_t)q;
    }
}

/* ------------------------------------------------------------------------- */
/* the build's widest lanes: 16 with AVX-512, else the 8 of lanes8             */
/*
 * For loops in which every lane is a chain of its own (nothing is added across
 * lanes), the width does not change the bits: such a loop takes WS_LANES lanes
 * at a time whatever the build. ln_load_h converts halves exactly as l8_load_h.
 */

#if WS_SIMD && defined(__AVX512F__)
#define WS_LANES 16
typedef __m512 lanes;
static inline lanes ln_zero(void) { return _mm512_setzero_ps(); }
static inline lanes ln_set1(float b) { return _mm512_set1_ps(b); }
static inline lanes ln_fma(lanes a, lanes b, lanes c) { return _mm512_fmadd_ps(a, b, c); }
static inline lanes ln_load(const float *p) { return _mm512_loadu_ps(p); }
static inline lanes ln_load_h(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}
static inline void ln_store(float *p, lanes v) { _mm512_storeu_ps(p, v); }
/* 16 values of a q8_0 block from value i (i + 16 <= 32), as l8_load_q8 */
static inline lanes ln_load_q8(const uint8_t *blk, int i, float d) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(const void *)(blk + 2 + i));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d));
}
#else
#define WS_LANES 8
typedef lanes8 lanes;
#define ln_zero l8_zero
#define ln_set1 l8_set1
#define ln_fma l8_fma
#define ln_load l8_load
#define ln_load_h l8_load_h
#define ln_load_q8 l8_load_q8
#define ln_store l8_store
#endif

#endif /* WS_SIMD_H */
