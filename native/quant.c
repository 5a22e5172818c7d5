/*
 * quant.c - weights in their GGUF type and the matrix products over them.
 *
 * The canonical order. A row of any type is first a row of floats: each block is
 * unpacked by the integer and float operations ggml's dequantizers use (small
 * integers times the block scale: exact for every type but Q6_K, whose one rounding
 * is the same operation in every build). Every output element is then the one dot
 * product of ws_simd.h over those floats (8 lanes, fused multiply-adds in order of
 * k, a fixed reduction tree, the tail in order). The F32 kernels are that dot over
 * the stored floats, so an F32 model computes exactly what it did before typed
 * weights existed, and a quantized row gives the bits of its dequantized F32 row.
 *
 * Three ways to run that order, chosen by the number of tokens, never changing the
 * bits: one token (a decode step) unpacks each 32-element chunk of 4 rows into
 * registers and feeds it straight to the FMAs; 2..8 tokens (a verification batch) do
 * the same and feed each unpacked chunk to every token's accumulators; more tokens
 * (prefill) unpack 4 rows once into a per-thread buffer and run the F32 tiles over
 * them for a whole block of tokens, so each weight block is unpacked once per 48
 * tokens.
 */
#include "quant.h"
#include "ws_simd.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------- */
/* types                                                                       */

typedef struct {
    int32_t type;
    int block;      /* elements per block */
    int bytes;      /* bytes per block    */
    const char *name;
} type_info;

static const type_info TYPES[] = {
    {WS_TYPE_F32, 1, 4, "F32"},      {WS_TYPE_F16, 1, 2, "F16"},
    {WS_TYPE_BF16, 1, 2, "BF16"},    {WS_TYPE_Q8_0, 32, 34, "Q8_0"},
    {WS_TYPE_Q4_0, 32, 18, "Q4_0"},  {WS_TYPE_Q4_1, 32, 20, "Q4_1"},
    {WS_TYPE_Q5_0, 32, 22, "Q5_0"},  {WS_TYPE_Q4_K, 256, 144, "Q4_K"},
    {WS_TYPE_Q5_K, 256, 176, "Q5_K"}, {WS_TYPE_Q6_K, 256, 210, "Q6_K"},
};

static const type_info *type_find(int32_t type) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].type == type) return &TYPES[i];
    return NULL;
}

int ws_type_block(int32_t type) {
    const type_info *ti = type_find(type);
    return ti ? ti->block : 0;
}

const char *ws_type_name(int32_t type) {
    const type_info *ti = type_find(type);
    return ti ? ti->name : NULL;
}

size_t ws_type_row_bytes(int32_t type, int64_t n) {
    const type_info *ti = type_find(type);
    if (!ti || n <= 0 || n % ti->block != 0 || n > (int64_t)1 << 40) return 0;
    return (size_t)(n / ti->block) * (size_t)ti->bytes;
}

static inline int is_plain(int32_t type) {
    return type == WS_TYPE_F32 || type == WS_TYPE_F16 || type == WS_TYPE_BF16;
}

/* ------------------------------------------------------------------------- */
/* scalar unpacking: the reference, and the portable build's path              */

/* a little-endian IEEE half in memory to float (ws_simd.h's conversion) */
static inline float half_to_float(const uint8_t *p) {
    return float_from_half((uint16_t)(p[0] | (uint16_t)p[1] << 8));
}

static inline float bf16_to_float(const uint8_t *p) {
    const uint32_t bits = ((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* scale and min of sub-block j of a Q4_K/Q5_K block (6 bits each, packed in 12 bytes) */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* sub-block c (32 values) of a Q4_K/Q5_K row: its block b, its low and high quant bits,
   its index s in the block (its 4-bit half: s & 1; its high bit: bit s), scale and min */
typedef struct {
    const uint8_t *b, *qs, *qh;
    int k5, s, sc, mn;
} k4_sub;

static inline k4_sub k4_sub_block(int32_t type, const uint8_t *row, int c) {
    k4_sub k;
    k.k5 = type == WS_TYPE_Q5_K;
    k.s = c % 8;
    k.b = row + (size_t)(c / 8) * (k.k5 ? 176 : 144);
    k.qh = k.b + 16;
    k.qs = k.b + 16 + (k.k5 ? 32 : 0) + 32 * (k.s / 2);
    scale_min_k4(k.s, k.b + 4, &k.sc, &k.mn);
    return k;
}

/* sub-block c (32 values) of a Q6_K row: its block b, low and high quant bits, its
   two 16-value scales, and g (low bits: the high nibble when g >= 2; high bits at 2g) */
typedef struct {
    const uint8_t *b, *ql, *qh;
    const int8_t *sc;
    int g;
} q6_sub;

static inline q6_sub q6_sub_block(const uint8_t *row, int c) {
    const int s = c % 8, h = s / 4;
    q6_sub q;
    q.g = s % 4;
    q.b = row + (size_t)(c / 8) * 210;
    q.ql = q.b + 64 * h + 32 * (q.g & 1);
    q.qh = q.b + 128 + 32 * h;
    q.sc = (const int8_t *)(q.b + 192) + 8 * h + 2 * q.g;
    return q;
}

/*
 * Elements [32c, 32c + 32) of a quantized row (c: chunk index; a 256-element block
 * holds 8 chunks, one per sub-block) into out[32]. For the plain types, 32 elements.
 * w = d*q (Q8_0, Q4_0, Q5_0): exact. Q4_1: d*q + m, d*q exact, so fmaf rounds as
 * ggml's mul-then-add does. Q4_K/Q5_K: (d*sc)*q - dmin*m, both products exact, one
 * rounding, again what fmaf gives. Q6_K: (d*sc)*q, d*sc exact, one rounding.
 */
static void unpack32_ref(int32_t type, const uint8_t *row, int c, float *out) {
    switch (type) {
    case WS_TYPE_F32:
        memcpy(out, row + (size_t)c * 128, 128);
        return;
    case WS_TYPE_F16:
        for (int j = 0; j < 32; j++) out[j] = half_to_float(row + (size_t)c * 64 + 2 * j);
        return;
    case WS_TYPE_BF16:
        for (int j = 0; j < 32; j++) out[j] = bf16_to_float(row + (size_t)c * 64 + 2 * j);
        return;
    case WS_TYPE_Q8_0: {
        const uint8_t *b = row + (size_t)c * 34;
        const float d = half_to_float(b);
        for (int j = 0; j < 32; j++) out[j] = d * (float)(int8_t)b[2 + j];
        return;
    }
    case WS_TYPE_Q4_0: {
        const uint8_t *b = row + (size_t)c * 18, *qs = b + 2;
        const float d = half_to_float(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((qs[j] & 0xF) - 8);
            out[j + 16] = d * (float)((qs[j] >> 4) - 8);
        }
        return;
    }
    case WS_TYPE_Q4_1: {
        const uint8_t *b = row + (size_t)c * 20, *qs = b + 4;
        const float d = half_to_float(b), m = half_to_float(b + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = fmaf((float)(qs[j] & 0xF), d, m);
            out[j + 16] = fmaf((float)(qs[j] >> 4), d, m);
        }
        return;
    }
    case WS_TYPE_Q5_0: {
        const uint8_t *b = row + (size_t)c * 22, *qs = b + 6;
        const float d = half_to_float(b);
        const uint32_t qh = get_le32(b + 2);
        for (int j = 0; j < 16; j++) {
            const int h0 = (int)((qh >> j) & 1u) << 4, h1 = (int)((qh >> (j + 16)) & 1u) << 4;
            out[j] = d * (float)(((qs[j] & 0xF) | h0) - 16);
            out[j + 16] = d * (float)(((qs[j] >> 4) | h1) - 16);
        }
        return;
    }
    case WS_TYPE_Q4_K:
    case WS_TYPE_Q5_K: {
        const k4_sub k = k4_sub_block(type, row, c);
        const float d1 = half_to_float(k.b) * (float)k.sc, m1 = half_to_float(k.b + 2) * (float)k.mn;
        for (int l = 0; l < 32; l++) {
            int q = k.s & 1 ? k.qs[l] >> 4 : k.qs[l] & 0xF;
            if (k.k5) q |= ((k.qh[l] >> k.s) & 1) << 4;
            out[l] = fmaf(d1, (float)q, -m1);
        }
        return;
    }
    case WS_TYPE_Q6_K: {
        const q6_sub k = q6_sub_block(row, c);
        const int g = k.g;
        const float d = half_to_float(k.b + 208);
        for (int l = 0; l < 32; l++) {
            const int q =
                ((g >= 2 ? k.ql[l] >> 4 : k.ql[l] & 0xF) | ((k.qh[l] >> (2 * g)) & 3) << 4) - 32;
            out[l] = (d * (float)k.sc[l / 16]) * (float)q;
        }
        return;
    }
    default:
        memset(out, 0, 128);
    }
}

/* element k of a plain row (the tails of rows whose length is not a multiple of 32) */
static inline float plain_at(int32_t type, const uint8_t *row, int k) {
    if (type == WS_TYPE_F16) return half_to_float(row + 2 * (size_t)k);
    if (type == WS_TYPE_BF16) return bf16_to_float(row + 2 * (size_t)k);
    float f;
    memcpy(&f, row + 4 * (size_t)k, sizeof f);
    return f;
}

/* ------------------------------------------------------------------------- */
/* unpacking into registers: the same values as unpack32_ref, 8 at a time      */

typedef struct {
    lanes8 v[4];
} chunk32;

#if WS_SIMD
static inline float half_scalar(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

static inline __m256i load8_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
}

static inline __attribute__((always_inline)) chunk32 unpack32(const int32_t type,
                                                              const uint8_t *row, int c) {
    chunk32 w;
    const __m256i m4 = _mm256_set1_epi32(0xF);
    switch (type) {
    case WS_TYPE_F16:
        for (int g = 0; g < 4; g++)
            w.v[g] = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(const void *)(row + (size_t)c * 64 + 16 * g)));
        return w;
    case WS_TYPE_BF16:
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)(const void *)(row + (size_t)c * 64 + 16 * g)));
            w.v[g] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        }
        return w;
    case WS_TYPE_Q8_0: {
        const uint8_t *b = row + (size_t)c * 34;
        const __m256 d = _mm256_set1_ps(half_scalar(b));
        for (int g = 0; g < 4; g++) {
            const __m256i q = _mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(const void *)(b + 2 + 8 * g)));
            w.v[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
        }
        return w;
    }
    case WS_TYPE_Q4_0:
    case WS_TYPE_Q4_1: {
        const int q41 = type == WS_TYPE_Q4_1;
        const uint8_t *b = row + (size_t)c * (q41 ? 20 : 18), *qs = b + (q41 ? 4 : 2);
        const __m256 d = _mm256_set1_ps(half_scalar(b));
        const __m256i b0 = load8_u8(qs), b1 = load8_u8(qs + 8);
        const __m256i q[4] = {_mm256_and_si256(b0, m4), _mm256_and_si256(b1, m4),
                              _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
        if (q41) {
            const __m256 m = _mm256_set1_ps(half_scalar(b + 2));
            for (int g = 0; g < 4; g++) w.v[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[g]), d, m);
        } else {
            const __m256i eight = _mm256_set1_epi32(8);
            for (int g = 0; g < 4; g++)
                w.v[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[g], eight)));
        }
        return w;
    }
    case WS_TYPE_Q5_0: {
        const uint8_t *b = row + (size_t)c * 22, *qs = b + 6;
        const __m256 d = _mm256_set1_ps(half_scalar(b));
        const __m256i qh = _mm256_set1_epi32((int)get_le32(b + 2));
        const __m256i b0 = load8_u8(qs), b1 = load8_u8(qs + 8);
        const __m256i q[4] = {_mm256_and_si256(b0, m4), _mm256_and_si256(b1, m4),
                              _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
        const __m256i one = _mm256_set1_epi32(1), sixteen = _mm256_set1_epi32(16);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (int g = 0; g < 4; g++) {
            const __m256i sh = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * g));
            const __m256i hb = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh, sh), one), 4);
            const __m256i v = _mm256_sub_epi32(_mm256_or_si256(q[g], hb), sixteen);
            w.v[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
        }
        return w;
    }
    case WS_TYPE_Q4_K:
    case WS_TYPE_Q5_K: {
        const k4_sub k = k4_sub_block(type, row, c);
        const __m256 d1 = _mm256_set1_ps(half_scalar(k.b) * (float)k.sc);
        const __m256 m1 = _mm256_set1_ps(-(half_scalar(k.b + 2) * (float)k.mn));
        for (int g = 0; g < 4; g++) {
            const __m256i raw = load8_u8(k.qs + 8 * g);
            __m256i q = k.s & 1 ? _mm256_srli_epi32(raw, 4) : _mm256_and_si256(raw, m4);
            if (k.k5) {
                const __m256i h = _mm256_srli_epi32(load8_u8(k.qh + 8 * g), k.s);
                q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(1)), 4));
            }
            w.v[g] = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(q), m1);
        }
        return w;
    }
    case WS_TYPE_Q6_K: {
        const q6_sub k = q6_sub_block(row, c);
        const int g2 = k.g;
        const float d = half_scalar(k.b + 208);
        const __m256 ds0 = _mm256_set1_ps(d * (float)k.sc[0]), ds1 = _mm256_set1_ps(d * (float)k.sc[1]);
        const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
        for (int g = 0; g < 4; g++) {
            const __m256i raw = load8_u8(k.ql + 8 * g);
            const __m256i lo = g2 >= 2 ? _mm256_srli_epi32(raw, 4) : _mm256_and_si256(raw, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(load8_u8(k.qh + 8 * g), 2 * g2), three);
            const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), bias);
            w.v[g] = _mm256_mul_ps(g < 2 ? ds0 : ds1, _mm256_cvtepi32_ps(q));
        }
        return w;
    }
    default:
        for (int g = 0; g < 4; g++)
            w.v[g] = _mm256_loadu_ps((const float *)(const void *)(row + (size_t)c * 128 + 32 * g));
        return w;
    }
}
#else
static inline chunk32 unpack32(const int32_t type, const uint8_t *row, int c) {
    float f[32];
    unpack32_ref(type, row, c, f);
    chunk32 w;
    for (int g = 0; g < 4; g++) w.v[g] = l8_load(f + 8 * g);
    return w;
}
#endif

/*
 * AVX-512 (when the build targets it): one 16-lane register holds the 8 canonical
 * lanes of two rows (row a low, row b high), so every lane still performs the
 * canonical sequence of its row, and the AVX2 and portable builds give its bits.
 */
#if WS_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define WS_AVX512 1
typedef struct {
    __m512 v[4];
} chunk32x2;

/* the f16 pairs (d, m) at a and at b as registers [d_a x8 | d_b x8] and
   [m_a x8 | m_b x8]: one conversion and two permutes instead of four scalar
   conversions and broadcasts */
static inline void scales_pair(const uint8_t *a, const uint8_t *b, __m512 *d, __m512 *m) {
    int32_t sa, sb;
    memcpy(&sa, a, sizeof sa);
    memcpy(&sb, b, sizeof sb);
    const __m512 v = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi32(sa, sb, 0, 0)));
    *d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), v);
    *m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), v);
}

static inline __m512 join_ps(__m256 a, __m256 b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

static inline __attribute__((always_inline)) chunk32x2 unpack32x2(const int32_t type,
                                                                  const uint8_t *ra,
                                                                  const uint8_t *rb, int c) {
    chunk32x2 w;
    switch (type) {
    case WS_TYPE_Q8_0: {
        const uint8_t *a = ra + (size_t)c * 34, *b = rb + (size_t)c * 34;
        __m512 d, unused;
        scales_pair(a, b, &d, &unused); /* d, then the first two quants: not used */
        for (int h = 0; h < 2; h++) {
            const __m128i la = _mm_loadu_si128((const __m128i *)(const void *)(a + 2 + 16 * h));
            const __m128i lb = _mm_loadu_si128((const __m128i *)(const void *)(b + 2 + 16 * h));
            const __m512i lo = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(la, lb));
            const __m512i hi = _mm512_cvtepi8_epi32(_mm_unpackhi_epi64(la, lb));
            w.v[2 * h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo));
            w.v[2 * h + 1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
        }
        return w;
    }
    case WS_TYPE_Q4_0:
    case WS_TYPE_Q4_1: {
        const int q41 = type == WS_TYPE_Q4_1, bs = q41 ? 20 : 18, off = q41 ? 4 : 2;
        const uint8_t *a = ra + (size_t)c * bs, *b = rb + (size_t)c * bs;
        const __m128i la = _mm_loadu_si128((const __m128i *)(const void *)(a + off));
        const __m128i lb = _mm_loadu_si128((const __m128i *)(const void *)(b + off));
        const __m512i wl = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(la, lb));
        const __m512i wh = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(la, lb));
        const __m512i m4 = _mm512_set1_epi32(0xF);
        const __m512i q[4] = {_mm512_and_si512(wl, m4), _mm512_and_si512(wh, m4),
                              _mm512_srli_epi32(wl, 4), _mm512_srli_epi32(wh, 4)};
        __m512 d, m;
        scales_pair(a, b, &d, &m); /* Q4_0: m is the first quants, not used */
        if (q41) {
            for (int g = 0; g < 4; g++) w.v[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[g]), d, m);
        } else {
            const __m512i eight = _mm512_set1_epi32(8);
            for (int g = 0; g < 4; g++)
                w.v[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q[g], eight)));
        }
        return w;
    }
    default: {
        const chunk32 a = unpack32(type, ra, c), b = unpack32(type, rb, c);
        for (int g = 0; g < 4; g++) w.v[g] = join_ps(a.v[g], b.v[g]);
        return w;
    }
    }
}
#else
#define WS_AVX512 0
#endif

/* ------------------------------------------------------------------------- */
/* rows as floats                                                              */

/* bytes of a row of n elements of a type the model admitted (n a multiple of its
   block): inlined, so that with a constant type the kernels compute it in registers
   instead of calling ws_type_row_bytes for every row */
static inline __attribute__((always_inline)) size_t row_bytes_of(const int32_t type, int n) {
    switch (type) {
    case WS_TYPE_F32: return (size_t)n * 4;
    case WS_TYPE_F16:
    case WS_TYPE_BF16: return (size_t)n * 2;
    case WS_TYPE_Q8_0: return (size_t)(n / 32) * 34;
    case WS_TYPE_Q4_0: return (size_t)(n / 32) * 18;
    case WS_TYPE_Q4_1: return (size_t)(n / 32) * 20;
    case WS_TYPE_Q5_0: return (size_t)(n / 32) * 22;
    case WS_TYPE_Q4_K: return (size_t)(n / 256) * 144;
    case WS_TYPE_Q5_K: return (size_t)(n / 256) * 176;
    case WS_TYPE_Q6_K: return (size_t)(n / 256) * 210;
    default: return ws_type_row_bytes(type, n);
    }
}

static inline const uint8_t *row_ptr(const ws_tensor *t, int r) {
    return (const uint8_t *)t->data + (size_t)r * ws_type_row_bytes(t->type, t->cols);
}

/* a whole row of n elements; plain types may end in a partial chunk */
static void unpack_row(int32_t type, const uint8_t *row, int n, float *out) {
    const int n32 = n & ~31;
    for (int c = 0; c < n32 / 32; c++) {
        const chunk32 w = unpack32(type, row, c);
        for (int g = 0; g < 4; g++) l8_store(out + 32 * c + 8 * g, w.v[g]);
    }
    for (int k = n32; k < n; k++) out[k] = plain_at(type, row, k);
}

void ws_row_f32(const ws_tensor *t, int32_t row, float *out) {
    unpack_row(t->type, row_ptr(t, row), t->cols, out);
}

/* ------------------------------------------------------------------------- */
/* F32 tiles (shared by the typed batch path, over unpacked rows)              */

/* 4 rows x 2 tokens sharing their loads; out[t*ldo + r] (+)= dot(W[r], X[t]) */
static inline void tile_4x2(float *out, int ldo, const float *W, const float *X, int ldx, int n,
                            int r, int t, int add) {
    const int n8 = n & ~7;
    const float *x0 = X + (size_t)t * ldx, *x1 = x0 + ldx;
    const float *w0 = W + (size_t)r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    lanes8 a00 = l8_zero(), a10 = l8_zero(), a20 = l8_zero(), a30 = l8_zero();
    lanes8 a01 = l8_zero(), a11 = l8_zero(), a21 = l8_zero(), a31 = l8_zero();
    for (int k = 0; k < n8; k += 8) {
        lanes8 xv0 = l8_load(x0 + k), xv1 = l8_load(x1 + k);
        lanes8 wv = l8_load(w0 + k);
        a00 = l8_fma(wv, xv0, a00); a01 = l8_fma(wv, xv1, a01);
        wv = l8_load(w1 + k);
        a10 = l8_fma(wv, xv0, a10); a11 = l8_fma(wv, xv1, a11);
        wv = l8_load(w2 + k);
        a20 = l8_fma(wv, xv0, a20); a21 = l8_fma(wv, xv1, a21);
        wv = l8_load(w3 + k);
        a30 = l8_fma(wv, xv0, a30); a31 = l8_fma(wv, xv1, a31);
    }
    float s[8] = {
        dot_tail(l8_sum(a00), w0, x0, n8, n), dot_tail(l8_sum(a10), w1, x0, n8, n),
        dot_tail(l8_sum(a20), w2, x0, n8, n), dot_tail(l8_sum(a30), w3, x0, n8, n),
        dot_tail(l8_sum(a01), w0, x1, n8, n), dot_tail(l8_sum(a11), w1, x1, n8, n),
        dot_tail(l8_sum(a21), w2, x1, n8, n), dot_tail(l8_sum(a31), w3, x1, n8, n),
    };
    float *o0 = out + (size_t)t * ldo + r, *o1 = o0 + ldo;
    for (int i = 0; i < 4; i++) {
        o0[i] = add ? o0[i] + s[i] : s[i];
        o1[i] = add ? o1[i] + s[4 + i] : s[4 + i];
    }
}

/* 4 rows x 3 tokens sharing their loads (12 accumulators) */
static inline void tile_4x3(float *out, int ldo, const float *W, const float *X, int ldx, int n,
                            int r, int t, int add) {
    const int n8 = n & ~7;
    const float *x0 = X + (size_t)t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx;
    const float *w0 = W + (size_t)r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    lanes8 a00 = l8_zero(), a10 = l8_zero(), a20 = l8_zero(), a30 = l8_zero();
    lanes8 a01 = l8_zero(), a11 = l8_zero(), a21 = l8_zero(), a31 = l8_zero();
    lanes8 a02 = l8_zero(), a12 = l8_zero(), a22 = l8_zero(), a32 = l8_zero();
    for (int k = 0; k < n8; k += 8) {
        const lanes8 xv0 = l8_load(x0 + k), xv1 = l8_load(x1 + k), xv2 = l8_load(x2 + k);
        lanes8 wv = l8_load(w0 + k);
        a00 = l8_fma(wv, xv0, a00); a01 = l8_fma(wv, xv1, a01); a02 = l8_fma(wv, xv2, a02);
        wv = l8_load(w1 + k);
        a10 = l8_fma(wv, xv0, a10); a11 = l8_fma(wv, xv1, a11); a12 = l8_fma(wv, xv2, a12);
        wv = l8_load(w2 + k);
        a20 = l8_fma(wv, xv0, a20); a21 = l8_fma(wv, xv1, a21); a22 = l8_fma(wv, xv2, a22);
        wv = l8_load(w3 + k);
        a30 = l8_fma(wv, xv0, a30); a31 = l8_fma(wv, xv1, a31); a32 = l8_fma(wv, xv2, a32);
    }
    const float *xs[3] = {x0, x1, x2};
    const float *ws[4] = {w0, w1, w2, w3};
    const lanes8 acc[3][4] = {{a00, a10, a20, a30}, {a01, a11, a21, a31}, {a02, a12, a22, a32}};
    for (int j = 0; j < 3; j++) {
        float *o = out + (size_t)(t + j) * ldo + r;
        for (int i = 0; i < 4; i++) {
            const float sv = dot_tail(l8_sum(acc[j][i]), ws[i], xs[j], n8, n);
            o[i] = add ? o[i] + sv : sv;
        }
    }
}

/* 4 rows x 1 token */
static inline void tile_4x1(float *out, int ldo, const float *W, const float *X, int ldx, int n,
                            int r, int t, int add) {
    const int n8 = n & ~7;
    const float *x = X + (size_t)t * ldx;
    const float *w0 = W + (size_t)r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    lanes8 a0 = l8_zero(), a1 = l8_zero(), a2 = l8_zero(), a3 = l8_zero();
    for (int k = 0; k < n8; k += 8) {
        lanes8 xv = l8_load(x + k);
        a0 = l8_fma(l8_load(w0 + k), xv, a0);
        a1 = l8_fma(l8_load(w1 + k), xv, a1);
        a2 = l8_fma(l8_load(w2 + k), xv, a2);
        a3 = l8_fma(l8_load(w3 + k), xv, a3);
    }
    float s[4] = {dot_tail(l8_sum(a0), w0, x, n8, n), dot_tail(l8_sum(a1), w1, x, n8, n),
                  dot_tail(l8_sum(a2), w2, x, n8, n), dot_tail(l8_sum(a3), w3, x, n8, n)};
    float *o = out + (size_t)t * ldo + r;
    for (int i = 0; i < 4; i++) o[i] = add ? o[i] + s[i] : s[i];
}


/* tokens [tb, te) of 4 rows r..r+3 of W (F32, [rows][n]) */
static void tiles_4rows(float *out, int ldo, const float *W, const float *X, int ldx, int n,
                        int r, int tb, int te, int add) {
    int t = tb;
    /* threes, then twos: a remainder of 4 as 2 + 2, never 3 + 1 (a one-token
       tile feeds one FMA per weight load: 4 slots stepped together would pay
       almost a whole extra pass over the weights) */
    for (; te - t >= 3 && te - t != 4; t += 3) tile_4x3(out, ldo, W, X, ldx, n, r, t, add);
    for (; t + 2 <= te; t += 2) tile_4x2(out, ldo, W, X, ldx, n, r, t, add);
    if (t < te) tile_4x1(out, ldo, W, X, ldx, n, r, t, add);
}

static inline void store_out(float *o, float v, int add) { *o = add ? *o + v : v; }

/*
 * A block of 4 weight rows is used for every token of a block of up to 48 tokens
 * (3 at a time, so that each weight load feeds 3 FMAs; 48 tokens of activations
 * stay in L2), so a verification batch reads the weights once, not once per token.
 */
#define WS_TOKEN_BLOCK 48
static void matmul_f32(float *out, int ldo, const float *W, const float *X, int ldx, int n,
                       int r0, int r1, int nt, int add) {
    for (int tb = 0; tb < nt; tb += WS_TOKEN_BLOCK) {
        const int te = tb + WS_TOKEN_BLOCK < nt ? tb + WS_TOKEN_BLOCK : nt;
        int r = r0;
        for (; r + 4 <= r1; r += 4) tiles_4rows(out, ldo, W, X, ldx, n, r, tb, te, add);
        for (; r < r1; r++) {
            const float *w = W + (size_t)r * n;
            for (int t = tb; t < te; t++)
                store_out(out + (size_t)t * ldo + r, dot(w, X + (size_t)t * ldx, n), add);
        }
    }
}

/* ------------------------------------------------------------------------- */
/* typed products                                                              */

/* the end of a row's canonical dot: the lanes' sum, then for plain rows whose length
   is not a multiple of 32 the rest of the row (8-lane steps, then in order) */
static inline __attribute__((always_inline)) float
finish_row(lanes8 a, const uint8_t *w, const float *x, int n, const int32_t type) {
    const int n32 = n & ~31, n8 = n & ~7;
    if (n32 == n) return l8_sum(a);
    float rest[32];
    for (int k = n32; k < n; k++) rest[k - n32] = plain_at(type, w, k);
    for (int k = n32; k < n8; k += 8) a = l8_fma(l8_load(rest + (k - n32)), l8_load(x + k), a);
    float s = l8_sum(a);
    for (int k = n8; k < n; k++) s = fmaf(rest[k - n32], x[k], s);
    return s;
}

/*
 * R rows (1 or 4) x 1 token, unpacking in registers: per row the canonical dot of
 * its unpacked values with x (chunks of 32 in order = 8-lane FMAs in order of k).
 */
static inline __attribute__((always_inline)) void
qtile_rx1(float *out, const ws_tensor *W, const float *x, int r, int add, const int R,
          const int32_t type) {
    const int n = W->cols, n32 = n & ~31;
    const size_t rb = row_bytes_of(type, n);
    const uint8_t *w[4];
    lanes8 a[4];
    for (int i = 0; i < R; i++) {
        w[i] = (const uint8_t *)W->data + (size_t)(r + i) * rb;
        a[i] = l8_zero();
    }
    for (int c = 0; c < n32 / 32; c++) {
        const float *xc = x + 32 * c;
        const lanes8 x0 = l8_load(xc), x1 = l8_load(xc + 8), x2 = l8_load(xc + 16),
                     x3 = l8_load(xc + 24);
        for (int i = 0; i < R; i++) {
            const chunk32 q = unpack32(type, w[i], c);
            a[i] = l8_fma(q.v[0], x0, a[i]);
            a[i] = l8_fma(q.v[1], x1, a[i]);
            a[i] = l8_fma(q.v[2], x2, a[i]);
            a[i] = l8_fma(q.v[3], x3, a[i]);
        }
    }
    for (int i = 0; i < R; i++) store_out(out + r + i, finish_row(a[i], w[i], x, n, type), add);
}

#if WS_AVX512
/* 8 rows x 1 token as 4 row pairs: 4 independent FMA chains of 16 lanes */
static inline __attribute__((always_inline)) void
qtile_8x1(float *out, const ws_tensor *W, const float *x, int r, int add, const int32_t type) {
    const int n = W->cols, n32 = n & ~31;
    const size_t rb = row_bytes_of(type, n);
    const uint8_t *w[8];
    __m512 a[4];
    for (int i = 0; i < 8; i++) w[i] = (const uint8_t *)W->data + (size_t)(r + i) * rb;
    for (int p = 0; p < 4; p++) a[p] = _mm512_setzero_ps();
    for (int c = 0; c < n32 / 32; c++) {
        const float *xc = x + 32 * c;
        __m512 xv[4];
        for (int g = 0; g < 4; g++) xv[g] = _mm512_broadcast_f32x8(_mm256_loadu_ps(xc + 8 * g));
        for (int p = 0; p < 4; p++) {
            const chunk32x2 q = unpack32x2(type, w[2 * p], w[2 * p + 1], c);
            for (int g = 0; g < 4; g++) a[p] = _mm512_fmadd_ps(q.v[g], xv[g], a[p]);
        }
    }
    for (int p = 0; p < 4; p++) {
        store_out(out + r + 2 * p, finish_row(_mm512_castps512_ps256(a[p]), w[2 * p], x, n, type),
                  add);
        store_out(out + r + 2 * p + 1,
                  finish_row(_mm512_extractf32x8_ps(a[p], 1), w[2 * p + 1], x, n, type), add);
    }
}
#endif

static inline __attribute__((always_inline)) void
qmatvec(float *out, const ws_tensor *W, const float *x, int r0, int r1, int add,
        const int32_t type) {
    int r = r0;
#if WS_AVX512
    for (; r + 8 <= r1; r += 8) qtile_8x1(out, W, x, r, add, type);
#endif
    for (; r + 4 <= r1; r += 4) qtile_rx1(out, W, x, r, add, 4, type);
    for (; r < r1; r++) qtile_rx1(out, W, x, r, add, 1, type);
}

#define WS_QMATVEC(T) \
    static void qmatvec_##T(float *out, const ws_tensor *W, const float *x, int r0, int r1, \
                            int add) { qmatvec(out, W, x, r0, r1, add, WS_TYPE_##T); }
WS_QMATVEC(F16)
WS_QMATVEC(BF16)
WS_QMATVEC(Q8_0)
WS_QMATVEC(Q4_0)
WS_QMATVEC(Q4_1)
WS_QMATVEC(Q5_0)
WS_QMATVEC(Q4_K)
WS_QMATVEC(Q5_K)
WS_QMATVEC(Q6_K)

/* one token: out[r] (+)= dot(W[r], x) for r in [r0, r1) */
static void matvec_typed(float *out, const ws_tensor *W, const float *x, int r0, int r1,
                         int add) {
    switch (W->type) {
    case WS_TYPE_F16: qmatvec_F16(out, W, x, r0, r1, add); break;
    case WS_TYPE_BF16: qmatvec_BF16(out, W, x, r0, r1, add); break;
    case WS_TYPE_Q8_0: qmatvec_Q8_0(out, W, x, r0, r1, add); break;
    case WS_TYPE_Q4_0: qmatvec_Q4_0(out, W, x, r0, r1, add); break;
    case WS_TYPE_Q4_1: qmatvec_Q4_1(out, W, x, r0, r1, add); break;
    case WS_TYPE_Q5_0: qmatvec_Q5_0(out, W, x, r0, r1, add); break;
    case WS_TYPE_Q4_K: qmatvec_Q4_K(out, W, x, r0, r1, add); break;
    case WS_TYPE_Q5_K: qmatvec_Q5_K(out, W, x, r0, r1, add); break;
    case WS_TYPE_Q6_K: qmatvec_Q6_K(out, W, x, r0, r1, add); break;
    default: break; /* ws_model_init admits only the types above */
    }
}

/*
 * A small batch (2..WS_REG_TOKENS tokens: a verification batch) unpacks each chunk of
 * a row into registers once and feeds it to every token's accumulator, instead of
 * writing the rows out as floats and reading them back for each tile of tokens. Per
 * output element the canonical sequence again, so the bits of the other paths.
 */
#define WS_REG_TOKENS 8

/* 1 row x NT tokens */
static inline __attribute__((always_inline)) void
qtile_1xt(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r, int add,
          const int NT, const int32_t type) {
    const int n = W->cols, n32 = n & ~31;
    const uint8_t *w = (const uint8_t *)W->data + (size_t)r * row_bytes_of(type, n);
    lanes8 a[WS_REG_TOKENS];
    for (int t = 0; t < NT; t++) a[t] = l8_zero();
    for (int c = 0; c < n32 / 32; c++) {
        const chunk32 q = unpack32(type, w, c);
        for (int t = 0; t < NT; t++) {
            const float *xc = X + (size_t)t * ldx + 32 * c;
            for (int g = 0; g < 4; g++) a[t] = l8_fma(q.v[g], l8_load(xc + 8 * g), a[t]);
        }
    }
    for (int t = 0; t < NT; t++)
        store_out(out + (size_t)t * ldo + r, finish_row(a[t], w, X + (size_t)t * ldx, n, type),
                  add);
}

#if WS_AVX512
/* 4 rows (2 pairs of 16 lanes) x NT tokens, each activation chunk loaded once for both */
static inline __attribute__((always_inline)) void
qtile_4xt(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r, int add,
          const int NT, const int32_t type) {
    const int n = W->cols, n32 = n & ~31;
    const uint8_t *w[4];
    __m512 a[2][WS_REG_TOKENS];
    const size_t rb = row_bytes_of(type, n);
    for (int i = 0; i < 4; i++) w[i] = (const uint8_t *)W->data + (size_t)(r + i) * rb;
    for (int t = 0; t < NT; t++) a[0][t] = a[1][t] = _mm512_setzero_ps();
    for (int c = 0; c < n32 / 32; c++) {
        const chunk32x2 q0 = unpack32x2(type, w[0], w[1], c), q1 = unpack32x2(type, w[2], w[3], c);
        for (int t = 0; t < NT; t++) {
            const float *xc = X + (size_t)t * ldx + 32 * c;
            for (int g = 0; g < 4; g++) {
                const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xc + 8 * g));
                a[0][t] = _mm512_fmadd_ps(q0.v[g], xv, a[0][t]);
                a[1][t] = _mm512_fmadd_ps(q1.v[g], xv, a[1][t]);
            }
        }
    }
    for (int t = 0; t < NT; t++) {
        const float *x = X + (size_t)t * ldx;
        float *o = out + (size_t)t * ldo + r;
        for (int p = 0; p < 2; p++) {
            store_out(o + 2 * p, finish_row(_mm512_castps512_ps256(a[p][t]), w[2 * p], x, n, type),
                      add);
            store_out(o + 2 * p + 1,
                      finish_row(_mm512_extractf32x8_ps(a[p][t], 1), w[2 * p + 1], x, n, type),
                      add);
        }
    }
}
#endif

static inline __attribute__((always_inline)) void
qmatsmall_nt(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r0, int r1,
             int add, const int NT, const int32_t type) {
    int r = r0;
#if WS_AVX512
    for (; r + 4 <= r1; r += 4) qtile_4xt(out, ldo, W, X, ldx, r, add, NT, type);
#endif
    for (; r < r1; r++) qtile_1xt(out, ldo, W, X, ldx, r, add, NT, type);
}

static inline __attribute__((always_inline)) void
qmatsmall(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r0, int r1,
          int nt, int add, const int32_t type) {
    switch (nt) {
    case 2: qmatsmall_nt(out, ldo, W, X, ldx, r0, r1, add, 2, type); break;
    case 3: qmatsmall_nt(out, ldo, W, X, ldx, r0, r1, add, 3, type); break;
    case 4: qmatsmall_nt(out, ldo, W, X, ldx, r0, r1, add, 4, type); break;
    case 5: qmatsmall_nt(out, ldo, W, X, ldx, r0, r1, add, 5, type); break;
    case 6: qmatsmall_nt(out, ldo, W, X, ldx, r0, r1, add, 6, type); break;
    case 7: qmatsmall_nt(out, ldo, W, X, ldx, r0, r1, add, 7, type); break;
    default: qmatsmall_nt(out, ldo, W, X, ldx, r0, r1, add, 8, type); break;
    }
}

#define WS_QMATSMALL(T) \
    static void qmatsmall_##T(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, \
                              int r0, int r1, int nt, int add) { \
        qmatsmall(out, ldo, W, X, ldx, r0, r1, nt, add, WS_TYPE_##T); }
WS_QMATSMALL(F16)
WS_QMATSMALL(BF16)
WS_QMATSMALL(Q8_0)
WS_QMATSMALL(Q4_0)
WS_QMATSMALL(Q4_1)
WS_QMATSMALL(Q5_0)
WS_QMATSMALL(Q4_K)
WS_QMATSMALL(Q5_K)
WS_QMATSMALL(Q6_K)

/* 2..WS_REG_TOKENS tokens */
static void matmul_small_typed(float *out, int ldo, const ws_tensor *W, const float *X, int ldx,
                               int r0, int r1, int nt, int add) {
    switch (W->type) {
    case WS_TYPE_F16: qmatsmall_F16(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_BF16: qmatsmall_BF16(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_Q8_0: qmatsmall_Q8_0(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_Q4_0: qmatsmall_Q4_0(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_Q4_1: qmatsmall_Q4_1(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_Q5_0: qmatsmall_Q5_0(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_Q4_K: qmatsmall_Q4_K(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_Q5_K: qmatsmall_Q5_K(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_Q6_K: qmatsmall_Q6_K(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    default: break; /* ws_model_init admits only the types above */
    }
}

void ws_matmul(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r0,
               int r1, int nt, int add, float *scratch) {
    const int n = W->cols;
    if (W->type == WS_TYPE_F32) {
        matmul_f32(out, ldo, (const float *)W->data, X, ldx, n, r0, r1, nt, add);
        return;
    }
    if (nt == 1) {
        matvec_typed(out, W, X, r0, r1, add);
        return;
    }
    if (nt <= WS_REG_TOKENS) {
        matmul_small_typed(out, ldo, W, X, ldx, r0, r1, nt, add);
        return;
    }
    for (int tb = 0; tb < nt; tb += WS_TOKEN_BLOCK) {
        const int te = tb + WS_TOKEN_BLOCK < nt ? tb + WS_TOKEN_BLOCK : nt;
        int r = r0;
        for (; r + 4 <= r1; r += 4) {
            for (int i = 0; i < 4; i++) unpack_row(W->type, row_ptr(W, r + i), n, scratch + (size_t)i * n);
            tiles_4rows(out + r, ldo, scratch, X, ldx, n, 0, tb, te, add);
        }
        for (; r < r1; r++) {
            unpack_row(W->type, row_ptr(W, r), n, scratch);
            for (int t = tb; t < te; t++)
                store_out(out + (size_t)t * ldo + r, dot(scratch, X + (size_t)t * ldx, n), add);
        }
    }
}

/* ------------------------------------------------------------------------- */
/* entry points for the kernel tests                                           */

static int tensor_ok(const ws_tensor *t) {
    return t && t->data && t->rows > 0 && t->cols > 0 && ws_type_row_bytes(t->type, t->cols) > 0;
}

ws_status ws_tensor_dequantize(const ws_tensor *t, int32_t row, int reference, float *out,
                               size_t cap) {
    if (!tensor_ok(t) || row < 0 || row >= t->rows || !out) return WS_ERR_INVALID_ARGUMENT;
    if (cap < (size_t)t->cols) return WS_ERR_BUFFER_TOO_SMALL;
    if (!reference) {
        ws_row_f32(t, row, out);
        return WS_OK;
    }
    const uint8_t *src = row_ptr(t, row);
    const int n = t->cols, n32 = n & ~31;
    for (int c = 0; c < n32 / 32; c++) unpack32_ref(t->type, src, c, out + 32 * c);
    for (int k = n32; k < n; k++) out[k] = plain_at(t->type, src, k);
    return WS_OK;
}

ws_status ws_tensor_matmul(const ws_tensor *t, const float *x, int32_t nt, float *out,
                           size_t cap) {
    if (!tensor_ok(t) || !x || !out || nt <= 0) return WS_ERR_INVALID_ARGUMENT;
    if (cap / (size_t)nt < (size_t)t->rows) return WS_ERR_BUFFER_TOO_SMALL;
    float *scratch = malloc(sizeof(float) * 4 * (size_t)t->cols);
    if (!scratch) return WS_ERR_OUT_OF_MEMORY;
    ws_matmul(out, t->rows, t, x, t->cols, 0, t->rows, nt, 0, scratch);
    free(scratch);
    return WS_OK;
}
