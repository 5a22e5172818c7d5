/*
 * quant.c - weights in their GGUF type and the matrix products over them.
 *
 * Two arithmetics, chosen by the weight type, never by the number of tokens:
 *
 * F32, F16, BF16 rows: the canonical F32 order. Each block is unpacked to floats, and
 * every output element is the one dot product of ws_simd.h over those floats (8 lanes,
 * fused multiply-adds in order of k, a fixed reduction tree, the tail in order), so an
 * F32 model computes exactly what it did before typed weights existed. One token (a
 * decode step) unpacks each 32-element chunk into registers and feeds it straight to
 * the FMAs; 2..8 tokens feed each unpacked chunk to every token's accumulators; more
 * tokens (prefill) unpack 4 rows once into a per-thread buffer and run the F32 tiles
 * over them for a whole block of tokens.
 *
 * Integer types (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K): activations quantized to
 * 16 bits per block of 32, exact integer block sums, one float order per output
 * element (see "integer products" below). Decode, verification and prefill all run
 * that one kernel, up to 16 tokens at a time, each weight block unpacked once for them.
 *
 * The unpacking of a block to floats (unpack32_ref) follows ggml's dequantizers: small
 * integers times the block scale, exact for every type but Q6_K, whose one rounding is
 * the same operation in every build. The core uses it for embedding rows.
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
/* plain rows into registers: the same values as unpack32_ref, 8 at a time    */

typedef struct {
    lanes8 v[4];
} chunk32;

#if WS_SIMD
/* half_to_float by the F16C instruction (the same bits) */
static inline float half_scalar(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}
#else
static inline float half_scalar(const uint8_t *p) { return half_to_float(p); }
#endif

#if WS_SIMD

static inline __attribute__((always_inline)) chunk32 unpack32(const int32_t type,
                                                              const uint8_t *row, int c) {
    chunk32 w;
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

static inline __m512 join_ps(__m256 a, __m256 b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

static inline __attribute__((always_inline)) chunk32x2 unpack32x2(const int32_t type,
                                                                  const uint8_t *ra,
                                                                  const uint8_t *rb, int c) {
    chunk32x2 w;
    const chunk32 a = unpack32(type, ra, c), b = unpack32(type, rb, c);
    for (int g = 0; g < 4; g++) w.v[g] = join_ps(a.v[g], b.v[g]);
    return w;
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

/* a whole row of n elements; plain types may end in a partial chunk (quantized rows
   are unpacked as floats only for a token's embedding: the scalar code) */
static void unpack_row(int32_t type, const uint8_t *row, int n, float *out) {
    const int n32 = n & ~31;
    for (int c = 0; c < n32 / 32; c++) {
        if (!is_plain(type)) {
            unpack32_ref(type, row, c, out + 32 * c);
            continue;
        }
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

/* one token: out[r] (+)= dot(W[r], x) for r in [r0, r1) */
static void matvec_typed(float *out, const ws_tensor *W, const float *x, int r0, int r1,
                         int add) {
    switch (W->type) {
    case WS_TYPE_F16: qmatvec_F16(out, W, x, r0, r1, add); break;
    case WS_TYPE_BF16: qmatvec_BF16(out, W, x, r0, r1, add); break;
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

/* 2..WS_REG_TOKENS tokens */
static void matmul_small_typed(float *out, int ldo, const ws_tensor *W, const float *X, int ldx,
                               int r0, int r1, int nt, int add) {
    switch (W->type) {
    case WS_TYPE_F16: qmatsmall_F16(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    case WS_TYPE_BF16: qmatsmall_BF16(out, ldo, W, X, ldx, r0, r1, nt, add); break;
    default: break; /* ws_model_init admits only the types above */
    }
}

/* ------------------------------------------------------------------------- */
/* integer products: 16-bit activations                                        */
/*
 * Every integer weight type (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) multiplies
 * activations quantized once per product, per token, in blocks of 32 (the weights'
 * block, or a K-quant's 32-element sub-block): with amax the block's largest |x|,
 *     dx = amax / 32767,  q = rint(x * (32767 / amax))  in [-32767, 32767]
 * (nearest even; dx = 0 and q = 0 for an all-zero block), so x stands for dx * q,
 * 256 times finer than 8 bits. The weights are their small integers w (Q8_0 the
 * signed quants, Q4_0 nibble - 8, Q4_1 the nibble, Q5_0 5 bits - 16, Q4_K/Q5_K the
 * 4/5-bit value, Q6_K 6 bits - 32), and per block the integer sum isum = w . q is
 * exact (|isum| <= 32 * 128 * 32767 < 2^31; Q6_K sums its two 16-element halves
 * apart, as they have their own scales). Per output element, block by block in
 * order of k, from acc = 0:
 *     acc = fmaf(dw * dx, (float)isum, acc)     (Q6_K: once per half)
 *     acc = fmaf(mw, dx * (float)sum q, acc)    (Q4_1, Q4_K, Q5_K only)
 * dw: the block's f16 scale (K-quants: d * sc, exact), mw: Q4_1's f16 min, K-quants'
 * -(dmin * m) (exact). Integer sums are exact whatever instructions add them, so the
 * portable build, AVX2 (vpmaddwd) and AVX-512 VNNI (vpdpwssd) agree bit for bit, and
 * so do the one-token, verification and prefill shapes, which all run this kernel:
 * 8 rows (AVX2) or 16 rows (AVX-512) are the float lanes, each lane performing its
 * row's sequence.
 */
/* token counts up to this take itile_8xn (a decode step, a short verification) */
#ifndef WS_SHORT_TOKENS
#define WS_SHORT_TOKENS 3
#endif
/* how many 8-row tiles ahead the AVX2 tiles prefetch */
#ifndef WS_PF_TILES
#define WS_PF_TILES 2
#endif

static inline int is_int_type(int32_t type) {
    return type == WS_TYPE_Q8_0 || type == WS_TYPE_Q4_0 || type == WS_TYPE_Q4_1 ||
           type == WS_TYPE_Q5_0 || type == WS_TYPE_Q4_K || type == WS_TYPE_Q5_K ||
           type == WS_TYPE_Q6_K;
}

/* the integer types of 32-element blocks, one f16 scale (and Q4_1's minimum) at each
   block's start */
static inline int is_block32_type(int32_t type) {
    return type == WS_TYPE_Q8_0 || type == WS_TYPE_Q4_0 || type == WS_TYPE_Q4_1 ||
           type == WS_TYPE_Q5_0;
}

/* a block of tokens' quantized activations: q [nt][n], dx, s [nt][n/32] */
typedef struct {
    const int16_t *q;
    const float *d, *s; /* s = dx * (float)sum q */
    int nb;             /* blocks per token */
} xq_block;

static void quantize_x(const float *x, int n, int16_t *q, float *d, float *s) {
    for (int b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        int16_t *qb = q + 32 * b;
        float amax = 0.0f;
#if WS_SIMD
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 mx = _mm256_setzero_ps();
        for (int g = 0; g < 4; g++)
            mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * g), absmask));
        float m8[8];
        _mm256_storeu_ps(m8, mx);
        for (int j = 0; j < 8; j++) amax = m8[j] > amax ? m8[j] : amax;
#else
        for (int j = 0; j < 32; j++) {
            const float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
#endif
        const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int32_t sum = 0;
#if WS_SIMD
        const __m256 vid = _mm256_set1_ps(id);
        __m256i i32[4];
        for (int g = 0; g < 4; g++)
            i32[g] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * g), vid));
        /* 32 int32 to 32 int16 in order (packs works per 128-bit lane) */
        const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[0], i32[1]), 0xD8);
        const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[2], i32[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)(void *)qb, p01);
        _mm256_storeu_si256((__m256i *)(void *)(qb + 16), p23);
        const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                             _mm256_add_epi32(i32[2], i32[3]));
        int32_t t8[8];
        _mm256_storeu_si256((__m256i *)(void *)t8, s32);
        for (int j = 0; j < 8; j++) sum += t8[j];
#else
        for (int j = 0; j < 32; j++) {
            const int v = (int)rintf(xb[j] * id);
            qb[j] = (int16_t)v;
            sum += v;
        }
#endif
        d[b] = amax / 32767.0f;
        s[b] = d[b] * (float)sum;
    }
}

/* tokens [t0, t0 + nt) of X quantized into scratch */
static xq_block quantize_tokens(const float *X, int ldx, int n, int t0, int nt, void *scratch) {
    xq_block xb;
    const int nb = n / 32;
    int16_t *q = scratch;
    float *d = (float *)(void *)(q + (size_t)WS_XQ_TOKENS * n);
    float *s = d + (size_t)WS_XQ_TOKENS * nb;
    for (int t = 0; t < nt; t++)
        quantize_x(X + (size_t)(t0 + t) * ldx, n, q + (size_t)t * n, d + (size_t)t * nb,
                   s + (size_t)t * nb);
    xb.q = q;
    xb.d = d;
    xb.s = s;
    xb.nb = nb;
    return xb;
}

/* the scales of 32-element block c of a row: dw (Q6_K: dw for its first half, dw2 for
   its second) and mw (0 for the types without a min) */
typedef struct {
    float dw, dw2, mw;
} iscales;

static inline __attribute__((always_inline)) iscales iscales_of(const int32_t type,
                                                                const uint8_t *row, int c) {
    iscales s = {0.0f, 0.0f, 0.0f};
    switch (type) {
    case WS_TYPE_Q8_0: s.dw = half_scalar(row + (size_t)c * 34); break;
    case WS_TYPE_Q4_0: s.dw = half_scalar(row + (size_t)c * 18); break;
    case WS_TYPE_Q4_1:
        s.dw = half_scalar(row + (size_t)c * 20);
        s.mw = half_scalar(row + (size_t)c * 20 + 2);
        break;
    case WS_TYPE_Q5_0: s.dw = half_scalar(row + (size_t)c * 22); break;
    case WS_TYPE_Q4_K:
    case WS_TYPE_Q5_K: {
        const k4_sub k = k4_sub_block(type, row, c);
        s.dw = half_scalar(k.b) * (float)k.sc;
        s.mw = -(half_scalar(k.b + 2) * (float)k.mn);
        break;
    }
    default: { /* Q6_K */
        const q6_sub k = q6_sub_block(row, c);
        const float d = half_scalar(k.b + 208);
        s.dw = d * (float)k.sc[0];
        s.dw2 = d * (float)k.sc[1];
        break;
    }
    }
    return s;
}

/* the scales (iscales_of) of the 8 sub-blocks of 256-element block kb of K-quant rows
   w[0..R), decoded once per block: ks[0][s][i] = dw, ks[1][s][i] = dw2, ks[2][s][i] = mw
   of sub-block s of row i (R <= 16) */
static inline void kscales(const int32_t type, const uint8_t *const *w, int R, int kb,
                           float ks[3][8][16]) {
    for (int i = 0; i < R; i++) {
        if (type == WS_TYPE_Q6_K) {
            const uint8_t *b = w[i] + (size_t)kb * 210;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = half_scalar(b + 208);
            for (int j = 0; j < 8; j++) {
                ks[0][j][i] = d * (float)sc[2 * j];
                ks[1][j][i] = d * (float)sc[2 * j + 1];
                ks[2][j][i] = 0.0f;
            }
            continue;
        }
        const uint8_t *b = w[i] + (size_t)kb * (type == WS_TYPE_Q5_K ? 176 : 144);
        const float d = half_scalar(b), dmin = half_scalar(b + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min_k4(j, b + 4, &sc, &mn);
            ks[0][j][i] = d * (float)sc;
            ks[1][j][i] = 0.0f;
            ks[2][j][i] = -(dmin * (float)mn);
        }
    }
}

/* the 32 integer weights of block c of a row (see above) */
static inline void iweights_ref(const int32_t type, const uint8_t *row, int c, int w[32]) {
    switch (type) {
    case WS_TYPE_Q8_0:
        for (int j = 0; j < 32; j++) w[j] = (int8_t)row[(size_t)c * 34 + 2 + j];
        return;
    case WS_TYPE_Q4_0:
    case WS_TYPE_Q4_1: {
        const int q41 = type == WS_TYPE_Q4_1;
        const uint8_t *qs = row + (size_t)c * (q41 ? 20 : 18) + (q41 ? 4 : 2);
        const int off = q41 ? 0 : 8;
        for (int j = 0; j < 16; j++) {
            w[j] = (qs[j] & 0xF) - off;
            w[j + 16] = (qs[j] >> 4) - off;
        }
        return;
    }
    case WS_TYPE_Q5_0: {
        const uint8_t *b = row + (size_t)c * 22, *qs = b + 6;
        const uint32_t qh = get_le32(b + 2);
        for (int j = 0; j < 16; j++) {
            w[j] = ((qs[j] & 0xF) | (int)((qh >> j) & 1u) << 4) - 16;
            w[j + 16] = ((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) - 16;
        }
        return;
    }
    case WS_TYPE_Q4_K:
    case WS_TYPE_Q5_K: {
        const k4_sub k = k4_sub_block(type, row, c);
        for (int l = 0; l < 32; l++) {
            w[l] = k.s & 1 ? k.qs[l] >> 4 : k.qs[l] & 0xF;
            if (k.k5) w[l] |= ((k.qh[l] >> k.s) & 1) << 4;
        }
        return;
    }
    default: { /* Q6_K */
        const q6_sub k = q6_sub_block(row, c);
        const int g = k.g;
        for (int l = 0; l < 32; l++)
            w[l] = ((g >= 2 ? k.ql[l] >> 4 : k.ql[l] & 0xF) | ((k.qh[l] >> (2 * g)) & 3) << 4) - 32;
        return;
    }
    }
}

/* one block's contribution to a row's accumulator, in the canonical order */
static inline float iblock_acc(float acc, iscales s, int32_t isum, int32_t isum2, float dx,
                               float sx, const int32_t type) {
    acc = fmaf(s.dw * dx, (float)isum, acc);
    if (type == WS_TYPE_Q6_K) acc = fmaf(s.dw2 * dx, (float)isum2, acc);
    if (type == WS_TYPE_Q4_1 || type == WS_TYPE_Q4_K || type == WS_TYPE_Q5_K)
        acc = fmaf(s.mw, sx, acc);
    return acc;
}

#if WS_SIMD
/* 16 unsigned bytes as 16 int16 */
static inline __m256i load16_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p));
}

/* the 32 integer weights of block c of a row as two vectors of 16 int16 (the values of
   iweights_ref: elements 0..15 in w[0], 16..31 in w[1]) */
static inline __attribute__((always_inline)) void iweights16(const int32_t type,
                                                             const uint8_t *row, int c,
                                                             __m256i w[2]) {
    const __m256i m4 = _mm256_set1_epi16(0xF);
    switch (type) {
    case WS_TYPE_Q8_0: {
        const uint8_t *b = row + (size_t)c * 34 + 2;
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)b));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(b + 16)));
        return;
    }
    case WS_TYPE_Q4_0:
    case WS_TYPE_Q4_1:
    case WS_TYPE_Q5_0: {
        const int bs = type == WS_TYPE_Q4_1 ? 20 : type == WS_TYPE_Q4_0 ? 18 : 22;
        const uint8_t *b = row + (size_t)c * bs, *qs = b + (type == WS_TYPE_Q4_1 ? 4 : bs - 16);
        const __m256i v = load16_u8(qs);
        w[0] = _mm256_and_si256(v, m4);
        w[1] = _mm256_srli_epi16(v, 4);
        if (type == WS_TYPE_Q4_0) {
            w[0] = _mm256_sub_epi16(w[0], _mm256_set1_epi16(8));
            w[1] = _mm256_sub_epi16(w[1], _mm256_set1_epi16(8));
        } else if (type == WS_TYPE_Q5_0) { /* bit j of qh -> 16 in element j */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
            const uint32_t qh = get_le32(b + 2);
            /* nibble - 16 where the bit is clear: the same values in one masked step */
            for (int h = 0; h < 2; h++)
                w[h] = _mm256_mask_sub_epi16(w[h], (__mmask16)~(qh >> (16 * h)), w[h],
                                             _mm256_set1_epi16(16));
#else
            /* qh in every dword, each 16-bit lane given half h of it by a byte shuffle,
               then lane j tests its bit j: nibble - 16 where the bit is clear */
            const __m256i all = _mm256_castps_si256(
                _mm256_broadcast_ss((const float *)(const void *)(b + 2)));
            const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024,
                                                  2048, 4096, 8192, 16384, (short)0x8000);
            const __m256i sixteen = _mm256_set1_epi16(16);
            for (int h = 0; h < 2; h++) {
                const __m256i half = _mm256_shuffle_epi8(
                    all, _mm256_set1_epi16((short)((2 * h) | (2 * h + 1) << 8)));
                const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(half, bit), bit);
                w[h] = _mm256_sub_epi16(w[h], _mm256_andnot_si256(set, sixteen));
            }
#endif
        }
        return;
    }
    case WS_TYPE_Q4_K:
    case WS_TYPE_Q5_K: {
        const k4_sub k = k4_sub_block(type, row, c);
        for (int h = 0; h < 2; h++) {
            const __m256i v = load16_u8(k.qs + 16 * h); /* shifts by constants: cheaper */
            w[h] = _mm256_and_si256(k.s & 1 ? _mm256_srli_epi16(v, 4) : v, m4);
            if (k.k5) {
                const __m256i hb = _mm256_srli_epi16(load16_u8(k.qh + 16 * h), k.s);
                w[h] = _mm256_or_si256(
                    w[h], _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi16(1)), 4));
            }
        }
        return;
    }
    default: { /* Q6_K */
        const q6_sub k = q6_sub_block(row, c);
        for (int h = 0; h < 2; h++) {
            /* bits 2g, 2g + 1 of qh to bits 4, 5, by shifts of constant counts */
            const __m256i l = load16_u8(k.ql + 16 * h), qh = load16_u8(k.qh + 16 * h);
            const __m256i lo = _mm256_and_si256(k.g >= 2 ? _mm256_srli_epi16(l, 4) : l, m4);
            __m256i hi;
            switch (k.g) {
            case 0: hi = _mm256_slli_epi16(qh, 4); break;
            case 1: hi = _mm256_slli_epi16(qh, 2); break;
            case 2: hi = qh; break;
            default: hi = _mm256_srli_epi16(qh, 2); break;
            }
            w[h] = _mm256_sub_epi16(
                _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi16(0x30))),
                _mm256_set1_epi16(32));
        }
        return;
    }
    }
}

/* acc + the int16 products of a and b summed in pairs, as 8 int32 (exact: |a| <= 128
   and |b| <= 32767 never reach vpmaddwd's one overflowing case) */
static inline __m256i dot_i16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* 8 vectors of 8 int32 partial sums -> [sum p0, ..., sum p7] */
static inline __m256i hsum8x8(const __m256i p[8]) {
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* the f16 in the low (hi = 0) or high half of each of 8 int32 as 8 floats */
static inline __m256 halves_ps(__m256i v, int hi) {
    const __m256i pick = hi ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1,
                                               -1, -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1,
                                               -1, -1, -1, -1, -1)
                            : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1,
                                               -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1,
                                               -1, -1, -1, -1);
    const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
}

/* the scales of block b of 8 rows (iscales_of, lane i for row w[i]; vidx: the rows'
   offsets from w[0]): Q8_0, Q4_0, Q4_1 and Q5_0 gather the f16 pair that leads each
   block, the K-quants read them from ks (kscales) */
static inline __attribute__((always_inline)) void
iscales8(const int32_t type, const uint8_t *const w[8], __m256i vidx, int b,
         const float ks[3][8][16], __m256 *dw, __m256 *dw2, __m256 *mw) {
    if (is_block32_type(type)) {
        const int bs = row_bytes_of(type, 32);
        const __m256i g = _mm256_i32gather_epi32((const int *)(const void *)(w[0] + (size_t)b * bs),
                                                 vidx, 1);
        *dw = halves_ps(g, 0);
        *mw = type == WS_TYPE_Q4_1 ? halves_ps(g, 1) : _mm256_setzero_ps();
        *dw2 = _mm256_setzero_ps();
        return;
    }
    *dw = _mm256_loadu_ps(ks[0][b % 8]);
    *dw2 = _mm256_loadu_ps(ks[1][b % 8]);
    *mw = _mm256_loadu_ps(ks[2][b % 8]);
}

/* kscales for 8 rows (vidx: their offsets from w0), lane i for row i: the packed scales
   gathered and decoded in vectors, the same integers and the same (exact) float products
   as the scalar kscales */
static inline __attribute__((always_inline)) void
kscales8(const int32_t type, const uint8_t *w0, __m256i vidx, int kb, float ks[3][8][16]) {
    const __m256i b6 = _mm256_set1_epi32(63), b4 = _mm256_set1_epi32(0xF);
    const uint8_t *blk = w0 + (size_t)kb * row_bytes_of(type, 256);
    if (type == WS_TYPE_Q6_K) {
        __m256i sc[4]; /* the 16 int8 scales, 4 per lane each */
        for (int k = 0; k < 4; k++)
            sc[k] = _mm256_i32gather_epi32((const int *)(const void *)(blk + 192 + 4 * k), vidx, 1);
        /* d: the f16 at 208, as the high half of the dword at 206 (inside the block) */
        const __m256 d =
            halves_ps(_mm256_i32gather_epi32((const int *)(const void *)(blk + 206), vidx, 1), 1);
        for (int j = 0; j < 8; j++) {
            for (int h = 0; h < 2; h++) {
                const int e = 2 * j + h; /* scale e: byte e % 4 of sc[e / 4], sign-extended */
                const __m256i v =
                    _mm256_srai_epi32(_mm256_slli_epi32(sc[e / 4], 24 - 8 * (e % 4)), 24);
                _mm256_storeu_ps(ks[h][j], _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
            }
            _mm256_storeu_ps(ks[2][j], _mm256_setzero_ps());
        }
        return;
    }
    const __m256i g = _mm256_i32gather_epi32((const int *)(const void *)blk, vidx, 1); /* d | dmin */
    const __m256 d = halves_ps(g, 0);
    /* -dmin: -(dmin * m) is (-dmin) * m exactly (rounding is symmetric in sign) */
    const __m256 ndmin = _mm256_xor_ps(halves_ps(g, 1), _mm256_set1_ps(-0.0f));
    __m256i q[3]; /* the 12 scale bytes, 4 per lane each (scale_min_k4's q) */
    for (int k = 0; k < 3; k++)
        q[k] = _mm256_i32gather_epi32((const int *)(const void *)(blk + 4 + 4 * k), vidx, 1);
    for (int j = 0; j < 8; j++) {
        const int sh = 8 * (j % 4);
        __m256i sc, mn;
        if (j < 4) {
            sc = _mm256_and_si256(_mm256_srli_epi32(q[0], sh), b6);
            mn = _mm256_and_si256(_mm256_srli_epi32(q[1], sh), b6);
        } else {
            const __m256i hi2 = _mm256_set1_epi32(3);
            const __m256i t = _mm256_srli_epi32(q[2], sh);
            sc = _mm256_or_si256(
                _mm256_and_si256(t, b4),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(q[0], sh + 6), hi2), 4));
            mn = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32(t, 4), b4),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(q[1], sh + 6), hi2), 4));
        }
        _mm256_storeu_ps(ks[0][j], _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
        _mm256_storeu_ps(ks[1][j], _mm256_setzero_ps());
        _mm256_storeu_ps(ks[2][j], _mm256_mul_ps(ndmin, _mm256_cvtepi32_ps(mn)));
    }
}

/*
 * The tokens' steps over block b of a tile, one text for both widths so that their float
 * steps, hence their bits, are the same (P: the intrinsics' prefix, _mm256 or _mm512; S:
 * its integer suffix; LOADX: 16 int16 activations as the width wants them; DOT / HSUM:
 * the width's pairwise product and row-sum tree): per token, acc += (dw * dx) * (the rows'
 * sums of w . x), Q6_K's second half likewise with dw2, then mw * (dx * sum q) for the
 * types with a minimum.
 */
#define ITILE_TOKENS(P, S, LOADX, DOT, HSUM, acc, NT, xb, b, wv, vdw, vdw2, vmw, type)         \
    for (int t_ = 0; t_ < (NT); t_++) {                                                        \
        const int16_t *xq_ = (xb)->q + (size_t)t_ * (xb)->nb * 32 + 32 * (b);                  \
        const __typeof__(LOADX(xq_)) x0_ = LOADX(xq_), x1_ = LOADX(xq_ + 16);                  \
        const size_t tb_ = (size_t)t_ * (xb)->nb + (b);                                        \
        const __typeof__(vdw) dx_ = P##_set1_ps((xb)->d[tb_]);                                 \
        __typeof__(LOADX(xq_)) p_[8];                                                          \
        if ((type) == WS_TYPE_Q6_K) {                                                          \
            __typeof__(LOADX(xq_)) p2_[8];                                                     \
            for (int i_ = 0; i_ < 8; i_++) {                                                   \
                p_[i_] = DOT(P##_setzero_##S(), (wv)[i_][0], x0_);                             \
                p2_[i_] = DOT(P##_setzero_##S(), (wv)[i_][1], x1_);                            \
            }                                                                                  \
            acc[t_] = P##_fmadd_ps(P##_mul_ps(vdw, dx_), P##_cvtepi32_ps(HSUM(p_)), acc[t_]);  \
            acc[t_] = P##_fmadd_ps(P##_mul_ps(vdw2, dx_), P##_cvtepi32_ps(HSUM(p2_)), acc[t_]); \
        } else {                                                                               \
            for (int i_ = 0; i_ < 8; i_++)                                                     \
                p_[i_] = DOT(DOT(P##_setzero_##S(), (wv)[i_][0], x0_), (wv)[i_][1], x1_);      \
            acc[t_] = P##_fmadd_ps(P##_mul_ps(vdw, dx_), P##_cvtepi32_ps(HSUM(p_)), acc[t_]);  \
        }                                                                                      \
        if ((type) == WS_TYPE_Q4_1 || (type) == WS_TYPE_Q4_K || (type) == WS_TYPE_Q5_K)        \
            acc[t_] = P##_fmadd_ps(vmw, P##_set1_ps((xb)->s[tb_]), acc[t_]);                   \
    }

/* a tile's results, lane i of acc[t] for row r + i of token t, stored or added to out */
#define ITILE_STORE(P, acc, NT, out, ldo, r, nrows, add)                                       \
    for (int t_ = 0; t_ < (NT); t_++) {                                                        \
        float v_[16];                                                                          \
        P##_storeu_ps(v_, acc[t_]);                                                            \
        float *o_ = (out) + (size_t)t_ * (ldo) + (r);                                          \
        for (int i_ = 0; i_ < (nrows); i_++) o_[i_] = (add) ? o_[i_] + v_[i_] : v_[i_];        \
    }

/* The 8 or 16 rows of a tile are read as as many short interleaved streams, which the hardware
   prefetcher follows poorly: block b of a tile prefetches bytes [b * step, (b + 1) * step)
   of the next tile's next_len (contiguous), step = pf_step(next_len, blocks per row). */
static inline size_t pf_step(size_t next_len, int nb) {
    return (next_len / (size_t)nb + 63) & ~(size_t)63;
}

static inline __attribute__((always_inline)) void prefetch_share(const uint8_t *next,
                                                                 size_t next_len, size_t step,
                                                                 int b) {
    for (size_t o = (size_t)b * step; o < (size_t)(b + 1) * step && o < next_len; o += 64)
        _mm_prefetch((const char *)next + o, _MM_HINT_T0);
}

static inline __m256i load_x8(const int16_t *q) {
    return _mm256_loadu_si256((const __m256i *)(const void *)q);
}

/* 8 rows (w[i]; a repeated row for a short tile) x NT tokens */
static inline __attribute__((always_inline)) void
itile_8xt(float *out, int ldo, const uint8_t *const w[8], int nrows, const xq_block *xb, int r,
          int add, const uint8_t *next, size_t next_len, const int NT, const int32_t type) {
    __m256 acc[WS_XQ_TOKENS];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    int32_t idx[8]; /* the rows' offsets from w[0], for the gathers of the scales */
    for (int i = 0; i < 8; i++) idx[i] = (int32_t)(w[i] - w[0]);
    const __m256i vidx = _mm256_loadu_si256((const __m256i *)(const void *)idx);
    const int is_k = type == WS_TYPE_Q4_K || type == WS_TYPE_Q5_K || type == WS_TYPE_Q6_K;
    float ks[3][8][16];
    const size_t step = pf_step(next_len, xb->nb);
    for (int b = 0; b < xb->nb; b++) {
        prefetch_share(next, next_len, step, b);
        __m256i wv[8][2];
        for (int i = 0; i < 8; i++) iweights16(type, w[i], b, wv[i]);
        if (is_k && b % 8 == 0) kscales8(type, w[0], vidx, b / 8, ks);
        __m256 vdw, vdw2, vmw;
        iscales8(type, w, vidx, b, ks, &vdw, &vdw2, &vmw);
        ITILE_TOKENS(_mm256, si256, load_x8, dot_i16, hsum8x8, acc, NT, xb, b, wv, vdw, vdw2,
                     vmw, type)
    }
    ITILE_STORE(_mm256, acc, NT, out, ldo, r, nrows, add)
}

/* 8 consecutive rows (w0 + i * rb) x NT <= 4 tokens, a decode step or a short
   verification: each row's block is unpacked once and multiplied at once with every
   token's activations (its two vpmaddwd summed into one register), and the rows' partial
   sums are reduced pairwise as they come, so few of them are live (itile_8xt unpacks all
   8 rows' weights first, 16 registers, and spills them once per token). The same exact
   integer sums and the same float steps per lane as ITILE_TOKENS: the bits of itile_8xt. */
static inline __attribute__((always_inline)) void
itile_8xn(float *out, int ldo, const uint8_t *w0, size_t rb, const xq_block *xb, int r, int add,
          const int NT, const int32_t type) {
    /* the tile WS_PF_TILES ahead (8 contiguous rows), read at the pace of this one: block b
       prefetches its share, pf_bytes (8 rows' bytes per 32 elements, rounded up), with
       unconditional prefetches (they never fault, past the end they do nothing useful) */
    const int pf_bytes = 8 * (is_block32_type(type) ? (int)row_bytes_of(type, 32)
                                                    : ((int)row_bytes_of(type, 256) + 7) / 8);
    const uint8_t *pf = w0 + (size_t)WS_PF_TILES * 8 * rb;
    const uint8_t *w[8];
    for (int i = 0; i < 8; i++) w[i] = w0 + (size_t)i * rb;
    const __m256i vidx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32((int)rb));
    const int is_k = type == WS_TYPE_Q4_K || type == WS_TYPE_Q5_K || type == WS_TYPE_Q6_K;
    const int q6 = type == WS_TYPE_Q6_K;
    float ks[3][8][16];
    __m256 acc[4];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < xb->nb; b++) {
        for (int l = 0; l < (pf_bytes + 63) / 64; l++)
            _mm_prefetch((const char *)pf + (size_t)b * pf_bytes + 64 * l, _MM_HINT_T0);
        if (is_k && b % 8 == 0) kscales8(type, w[0], vidx, b / 8, ks);
        __m256i x0[4], x1[4];
        for (int t = 0; t < NT; t++) {
            const int16_t *xq = xb->q + (size_t)t * xb->nb * 32 + 32 * b;
            x0[t] = load_x8(xq);
            x1[t] = load_x8(xq + 16);
        }
        /* hsum8x8's tree, taken as the rows come (a pair's vphaddd as soon as both rows
           are done) */
        __m256i h[4][4], h2[4][4], q[4][2], q2[4][2];
        for (int i = 0; i < 8; i += 2) {
            __m256i pa[4], pb[4], pa2[4], pb2[4];
            __m256i wv[2];
            iweights16(type, w[i], b, wv);
            for (int t = 0; t < NT; t++) {
                if (q6) {
                    pa[t] = _mm256_madd_epi16(wv[0], x0[t]);
                    pa2[t] = _mm256_madd_epi16(wv[1], x1[t]);
                } else {
                    pa[t] = _mm256_add_epi32(_mm256_madd_epi16(wv[0], x0[t]),
                                             _mm256_madd_epi16(wv[1], x1[t]));
                }
            }
            iweights16(type, w[i + 1], b, wv);
            for (int t = 0; t < NT; t++) {
                if (q6) {
                    pb[t] = _mm256_madd_epi16(wv[0], x0[t]);
                    pb2[t] = _mm256_madd_epi16(wv[1], x1[t]);
                } else {
                    pb[t] = _mm256_add_epi32(_mm256_madd_epi16(wv[0], x0[t]),
                                             _mm256_madd_epi16(wv[1], x1[t]));
                }
                h[t][i / 2] = _mm256_hadd_epi32(pa[t], pb[t]);
                if (q6) h2[t][i / 2] = _mm256_hadd_epi32(pa2[t], pb2[t]);
                if (i % 4 == 2) {
                    q[t][i / 4] = _mm256_hadd_epi32(h[t][i / 2 - 1], h[t][i / 2]);
                    if (q6) q2[t][i / 4] = _mm256_hadd_epi32(h2[t][i / 2 - 1], h2[t][i / 2]);
                }
            }
        }
        __m256 vdw, vdw2, vmw;
        iscales8(type, w, vidx, b, ks, &vdw, &vdw2, &vmw);
        for (int t = 0; t < NT; t++) {
            const size_t tb = (size_t)t * xb->nb + b;
            const __m256 dx = _mm256_set1_ps(xb->d[tb]);
            const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(q[t][0], q[t][1], 0x20),
                                                 _mm256_permute2x128_si256(q[t][0], q[t][1], 0x31));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(vdw, dx), _mm256_cvtepi32_ps(sum), acc[t]);
            if (q6) {
                const __m256i sum2 =
                    _mm256_add_epi32(_mm256_permute2x128_si256(q2[t][0], q2[t][1], 0x20),
                                     _mm256_permute2x128_si256(q2[t][0], q2[t][1], 0x31));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(vdw2, dx), _mm256_cvtepi32_ps(sum2), acc[t]);
            }
            if (type == WS_TYPE_Q4_1 || type == WS_TYPE_Q4_K || type == WS_TYPE_Q5_K)
                acc[t] = _mm256_fmadd_ps(vmw, _mm256_set1_ps(xb->s[tb]), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        float *o = out + (size_t)t * ldo + r;
        const __m256 v = add ? _mm256_add_ps(_mm256_loadu_ps(o), acc[t]) : acc[t];
        _mm256_storeu_ps(o, v);
    }
}
#else
static inline void itile_8xt(float *out, int ldo, const uint8_t *const w[8], int nrows,
                             const xq_block *xb, int r, int add, const uint8_t *next,
                             size_t next_len, const int NT, const int32_t type) {
    (void)next;
    (void)next_len;
    for (int i = 0; i < nrows; i++) {
        for (int t = 0; t < NT; t++) {
            float acc = 0.0f;
            for (int b = 0; b < xb->nb; b++) {
                int wq[32];
                iweights_ref(type, w[i], b, wq);
                const int16_t *x = xb->q + (size_t)t * xb->nb * 32 + 32 * b;
                int32_t isum = 0, isum2 = 0; /* Q6_K: its halves apart */
                for (int j = 0; j < 16; j++) isum += wq[j] * x[j];
                for (int j = 16; j < 32; j++) {
                    if (type == WS_TYPE_Q6_K)
                        isum2 += wq[j] * x[j];
                    else
                        isum += wq[j] * x[j];
                }
                const size_t tb = (size_t)t * xb->nb + b;
                acc = iblock_acc(acc, iscales_of(type, w[i], b), isum, isum2, xb->d[tb], xb->s[tb],
                                 type);
            }
            float *o = out + (size_t)t * ldo + r + i;
            *o = add ? *o + acc : acc;
        }
    }
}
#endif

#if WS_AVX512
/*
 * AVX-512: 16 rows x NT tokens. A register holds a pair of rows, 16 weights of each
 * ([row a | row b]), so one vpdpwssd multiplies 32 weights by the activations (the
 * same 16 of them in both halves) and a block's 8 pairs reduce to the 16 rows' sums
 * in one tree. Pair p holds rows (p, p + 4) for p < 4 and (p + 4, p + 8) after, so the
 * tree leaves the sums in row order. Each float lane then performs its row's sequence,
 * as in itile_8xt, so the bits are the AVX2 and portable builds'.
 */
static inline __m512i dot_i16x2(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* vphaddd within each 128-bit lane, on 512 bits */
static inline __m512i hadd512(__m512i a, __m512i b) {
    const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
    const __m512i even = _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0)));
    const __m512i odd = _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(even, odd);
}

/* 8 pairs [row a: 8 int32 | row b: 8 int32] -> the 16 rows' sums in row order */
static inline __m512i hsum16(const __m512i p[8]) {
    const __m512i a = hadd512(hadd512(p[0], p[1]), hadd512(p[2], p[3]));
    const __m512i b = hadd512(hadd512(p[4], p[5]), hadd512(p[6], p[7]));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 int16 activations in both 256-bit halves (each register holds two rows) */
static inline __m512i load_x16(const int16_t *q) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(const void *)q));
}

static inline int pair_row(int p, int h) { return p < 4 ? p + 4 * h : p + 4 + 4 * h; }

/* kscales for 16 rows (vidx: their offsets from w[0]), lanes for rows: the packed scales
   gathered and decoded in vectors, the same integers and the same float products */
static inline __attribute__((always_inline)) void
kscales16(const int32_t type, const uint8_t *w0, __m512i vidx, int kb, float ks[3][8][16]) {
    const __m512i b6 = _mm512_set1_epi32(63), b4 = _mm512_set1_epi32(0xF);
    if (type == WS_TYPE_Q6_K) {
        const uint8_t *blk = w0 + (size_t)kb * row_bytes_of(type, 256);
        __m512i sc[4]; /* the 16 int8 scales, 4 per lane each */
        for (int k = 0; k < 4; k++) sc[k] = _mm512_i32gather_epi32(vidx, blk + 192 + 4 * k, 1);
        /* d: the f16 at 208, as the high half of the dword at 206 (inside the block) */
        const __m512i gd = _mm512_i32gather_epi32(vidx, blk + 206, 1);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(gd, 16)));
        for (int j = 0; j < 8; j++)
            for (int h = 0; h < 2; h++) {
                const int e = 2 * j + h; /* scale e: byte e % 4 of sc[e / 4], sign-extended */
                const __m512i v =
                    _mm512_srai_epi32(_mm512_slli_epi32(sc[e / 4], 24 - 8 * (e % 4)), 24);
                _mm512_storeu_ps(ks[h][j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)));
            }
        for (int j = 0; j < 8; j++) _mm512_storeu_ps(ks[2][j], _mm512_setzero_ps());
        return;
    }
    const uint8_t *blk = w0 + (size_t)kb * row_bytes_of(type, 256);
    const __m512i g = _mm512_i32gather_epi32(vidx, blk, 1); /* d | dmin */
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    /* -dmin: -(dmin * m) is (-dmin) * m exactly (rounding is symmetric in sign) */
    const __m512 ndmin = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))),
        _mm512_set1_epi32((int)0x80000000u)));
    __m512i q[3]; /* the 12 scale bytes, 4 per lane each (scale_min_k4's q) */
    for (int k = 0; k < 3; k++) q[k] = _mm512_i32gather_epi32(vidx, blk + 4 + 4 * k, 1);
    for (int j = 0; j < 8; j++) {
        const int sh = 8 * (j % 4);
        __m512i sc, mn;
        if (j < 4) {
            sc = _mm512_and_si512(_mm512_srli_epi32(q[0], sh), b6);
            mn = _mm512_and_si512(_mm512_srli_epi32(q[1], sh), b6);
        } else {
            const __m512i hi2 = _mm512_set1_epi32(3);
            const __m512i t = _mm512_srli_epi32(q[2], sh);
            sc = _mm512_or_si512(
                _mm512_and_si512(t, b4),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q[0], sh + 6), hi2), 4));
            mn = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32(t, 4), b4),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q[1], sh + 6), hi2), 4));
        }
        _mm512_storeu_ps(ks[0][j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_storeu_ps(ks[1][j], _mm512_setzero_ps());
        _mm512_storeu_ps(ks[2][j], _mm512_mul_ps(ndmin, _mm512_cvtepi32_ps(mn)));
    }
}

/* 16 bytes at a and 16 at b as one 256-bit register */
static inline __m256i join16(const uint8_t *a, const uint8_t *b) {
    return _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)a)),
        _mm_loadu_si128((const __m128i *)(const void *)b), 1);
}

/* block c of rows ra and rb as a pair's two registers (wv[h]: row ra's elements 16h ..
   16h + 15, then row rb's; iweights16's values). The 32-element types widen both rows'
   bytes in one instruction, the K-quants join two iweights16. */
static inline __attribute__((always_inline)) void
iweights_pair(const int32_t type, const uint8_t *ra, const uint8_t *rb, int c, __m512i wv[2]) {
    switch (type) {
    case WS_TYPE_Q8_0: {
        const size_t o = (size_t)c * row_bytes_of(type, 32) + 2;
        for (int h = 0; h < 2; h++)
            wv[h] = _mm512_cvtepi8_epi16(join16(ra + o + 16 * h, rb + o + 16 * h));
        return;
    }
    case WS_TYPE_Q4_0:
    case WS_TYPE_Q4_1:
    case WS_TYPE_Q5_0: {
        const size_t bs = row_bytes_of(type, 32), o = (size_t)c * bs;
        const __m512i v = _mm512_cvtepu8_epi16(join16(ra + o + bs - 16, rb + o + bs - 16));
        wv[0] = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
        wv[1] = _mm512_srli_epi16(v, 4);
        if (type == WS_TYPE_Q4_0)
            for (int h = 0; h < 2; h++) wv[h] = _mm512_sub_epi16(wv[h], _mm512_set1_epi16(8));
        if (type == WS_TYPE_Q5_0) { /* nibble - 16 where the element's fifth bit is clear */
            const uint32_t qa = get_le32(ra + o + 2), qb = get_le32(rb + o + 2);
            const uint32_t bits[2] = {(qa & 0xFFFFu) | qb << 16, qa >> 16 | (qb & 0xFFFF0000u)};
            for (int h = 0; h < 2; h++)
                wv[h] = _mm512_mask_sub_epi16(wv[h], (__mmask32)~bits[h], wv[h],
                                              _mm512_set1_epi16(16));
        }
        return;
    }
    default: {
        __m256i wa[2], wb[2];
        iweights16(type, ra, c, wa);
        iweights16(type, rb, c, wb);
        for (int h = 0; h < 2; h++)
            wv[h] = _mm512_inserti64x4(_mm512_castsi256_si512(wa[h]), wb[h], 1);
        return;
    }
    }
}

/* the f16 scales (and Q4_1's minimums) of block b of 16 rows of a 32-element type */
static inline __attribute__((always_inline)) void
gathered_scales(const int32_t type, const uint8_t *w0, __m512i vidx, int b, __m512 *dw,
                __m512 *mw) {
    const __m512i g =
        _mm512_i32gather_epi32(vidx, (const void *)(w0 + (size_t)b * row_bytes_of(type, 32)), 1);
    *dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    *mw = type == WS_TYPE_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))
                               : _mm512_setzero_ps();
}

/* 8 bytes at each of 4 rows (offset o) as one 256-bit register, row a's first */
static inline __m256i join8x4(const uint8_t *a, const uint8_t *b, const uint8_t *c,
                              const uint8_t *d, size_t o) {
    const __m128d ab = _mm_loadh_pd(
        _mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(const void *)(a + o))),
        (const double *)(const void *)(b + o));
    const __m128d cd = _mm_loadh_pd(
        _mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(const void *)(c + o))),
        (const double *)(const void *)(d + o));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_castpd_si128(ab)),
                                   _mm_castpd_si128(cd), 1);
}

/* Block c of four rows r[0..4) as a quad's four registers: wq[s] holds elements 8s ..
   8s + 7 of each row, one row per 128-bit lane (iweights16's values), for the
   32-element types */
static inline __attribute__((always_inline)) void
iweights_quad(const int32_t type, const uint8_t *const r[4], int c, __m512i wq[4]) {
    const size_t bs = row_bytes_of(type, 32), o = (size_t)c * bs;
    if (type == WS_TYPE_Q8_0) {
        for (int s = 0; s < 4; s++)
            wq[s] = _mm512_cvtepi8_epi16(join8x4(r[0], r[1], r[2], r[3], o + 2 + 8 * (size_t)s));
        return;
    }
    const size_t qs = o + bs - 16;
    for (int h = 0; h < 2; h++) { /* bytes 8h .. 8h + 7: elements 8h.. (low), 16 + 8h.. (high) */
        const __m512i v = _mm512_cvtepu8_epi16(join8x4(r[0], r[1], r[2], r[3], qs + 8 * (size_t)h));
        wq[h] = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
        wq[2 + h] = _mm512_srli_epi16(v, 4);
    }
    if (type == WS_TYPE_Q4_0)
        for (int s = 0; s < 4; s++) wq[s] = _mm512_sub_epi16(wq[s], _mm512_set1_epi16(8));
    if (type == WS_TYPE_Q5_0) { /* nibble - 16 where the element's fifth bit is clear */
        uint32_t qh[4];
        for (int i = 0; i < 4; i++) qh[i] = get_le32(r[i] + o + 2);
        for (int s = 0; s < 4; s++) {
            uint32_t m = 0;
            for (int i = 0; i < 4; i++) m |= ((qh[i] >> (8 * s)) & 0xFFu) << (8 * i);
            wq[s] = _mm512_mask_sub_epi16(wq[s], (__mmask32)~m, wq[s], _mm512_set1_epi16(16));
        }
    }
}

/* A prefill's 16 rows x 16 tokens for the 32-element types with four rows to a register
   (quad q: rows q, q + 4, q + 8, q + 12, one per 128-bit lane), so that a token's block
   leaves each row's sum in 4 lanes instead of 8 and a tree of 3 additions puts the 16
   sums in row order. The integer sums are the same exact values, each lane then performs
   its row's sequence: the bits of itile_16xt. */
static inline __attribute__((always_inline)) void
itile_16x16_quad(float *out, int ldo, const uint8_t *const w[16], int nrows, const xq_block *xb,
                 int r, int add, const uint8_t *next, size_t next_len, const int32_t type) {
    const int NT = WS_XQ_TOKENS;
    __m512 acc[WS_XQ_TOKENS];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    int32_t idx[16];
    for (int i = 0; i < 16; i++) idx[i] = (int32_t)(w[i] - w[0]);
    const __m512i vidx = _mm512_loadu_si512((const void *)idx);
    const size_t step = pf_step(next_len, xb->nb);
    for (int b = 0; b < xb->nb; b++) {
        prefetch_share(next, next_len, step, b);
        __m512i wq[4][4];
        for (int q = 0; q < 4; q++) {
            const uint8_t *rq[4] = {w[q], w[q + 4], w[q + 8], w[q + 12]};
            iweights_quad(type, rq, b, wq[q]);
        }
        __m512 vdw, vmw;
        gathered_scales(type, w[0], vidx, b, &vdw, &vmw);
        for (int t = 0; t < NT; t++) {
            const int16_t *xq = xb->q + (size_t)t * xb->nb * 32 + 32 * b;
            __m512i xs[4];
            for (int s = 0; s < 4; s++)
                xs[s] = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(xq + 8 * s)));
            __m512i a[4];
            for (int q = 0; q < 4; q++) {
                a[q] = dot_i16x2(_mm512_setzero_si512(), wq[q][0], xs[0]);
                for (int s = 1; s < 4; s++) a[q] = dot_i16x2(a[q], wq[q][s], xs[s]);
            }
            const __m512i sum = hadd512(hadd512(a[0], a[1]), hadd512(a[2], a[3]));
            const size_t tb = (size_t)t * xb->nb + b;
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(vdw, _mm512_set1_ps(xb->d[tb])),
                                     _mm512_cvtepi32_ps(sum), acc[t]);
            if (type == WS_TYPE_Q4_1)
                acc[t] = _mm512_fmadd_ps(vmw, _mm512_set1_ps(xb->s[tb]), acc[t]);
        }
    }
    ITILE_STORE(_mm512, acc, NT, out, ldo, r, nrows, add)
}

static inline __attribute__((always_inline)) void
itile_16xt(float *out, int ldo, const uint8_t *const w[16], int nrows, const xq_block *xb, int r,
           int add, const uint8_t *next, size_t next_len, const int NT, const int32_t type) {
    const int gathered = is_block32_type(type);
    __m512 acc[WS_XQ_TOKENS];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    int32_t idx[16];
    for (int i = 0; i < 16; i++) idx[i] = (int32_t)(w[i] - w[0]);
    const __m512i vidx = _mm512_loadu_si512((const void *)idx);
    float ks[3][8][16]; /* K-quants: kscales of the current 256-element block */
    const size_t step = pf_step(next_len, xb->nb);
    for (int b = 0; b < xb->nb; b++) {
        prefetch_share(next, next_len, step, b);
        __m512i wv[8][2];
        for (int p = 0; p < 8; p++)
            iweights_pair(type, w[pair_row(p, 0)], w[pair_row(p, 1)], b, wv[p]);
        __m512 vdw, vdw2 = _mm512_setzero_ps(), vmw = _mm512_setzero_ps();
        if (gathered) {
            gathered_scales(type, w[0], vidx, b, &vdw, &vmw);
        } else {
            if (b % 8 == 0) kscales16(type, w[0], vidx, b / 8, ks);
            vdw = _mm512_loadu_ps(ks[0][b % 8]);
            vdw2 = _mm512_loadu_ps(ks[1][b % 8]);
            vmw = _mm512_loadu_ps(ks[2][b % 8]);
        }
        ITILE_TOKENS(_mm512, si512, load_x16, dot_i16x2, hsum16, acc, NT, xb, b, wv, vdw, vdw2,
                     vmw, type)
    }
    ITILE_STORE(_mm512, acc, NT, out, ldo, r, nrows, add)
}
#endif


static inline __attribute__((always_inline)) void
imatmul_nt(float *out, int ldo, const ws_tensor *W, const xq_block *xb, int r0, int r1, int add,
           const int NT, const int32_t type) {
    const size_t rb = row_bytes_of(type, W->cols);
    int r = r0;
#if WS_AVX512
    for (; r + 8 < r1; r += 16) { /* more than 8 rows left: 16 (repeating the last) */
        const int nrows = r1 - r < 16 ? r1 - r : 16;
        const uint8_t *w[16];
        for (int i = 0; i < 16; i++)
            w[i] = (const uint8_t *)W->data + (size_t)(r + (i < nrows ? i : nrows - 1)) * rb;
        const int next_rows = r + 16 < r1 ? (r1 - r - 16 < 16 ? r1 - r - 16 : 16) : 0;
        const uint8_t *next = (const uint8_t *)W->data + (size_t)(r + 16) * rb;
        if (NT == WS_XQ_TOKENS && is_block32_type(type))
            itile_16x16_quad(out, ldo, w, nrows, xb, r, add, next, (size_t)next_rows * rb, type);
        else
            itile_16xt(out, ldo, w, nrows, xb, r, add, next, (size_t)next_rows * rb, NT, type);
    }
#endif
#if WS_SIMD
    if (NT <= WS_SHORT_TOKENS)
        for (; r + 8 <= r1; r += 8)
            itile_8xn(out, ldo, (const uint8_t *)W->data + (size_t)r * rb, rb, xb, r, add, NT,
                      type);
#endif
    for (; r < r1; r += 8) {
        const int nrows = r1 - r < 8 ? r1 - r : 8;
        const uint8_t *w[8];
        for (int i = 0; i < 8; i++)
            w[i] = (const uint8_t *)W->data + (size_t)(r + (i < nrows ? i : nrows - 1)) * rb;
        /* the tile WS_PF_TILES ahead, while it lies in [r0, r1) */
        const int ahead = r + 8 * WS_PF_TILES;
        const int next_rows = ahead < r1 ? (r1 - ahead < 8 ? r1 - ahead : 8) : 0;
        const uint8_t *next = (const uint8_t *)W->data + (size_t)ahead * rb;
        itile_8xt(out, ldo, w, nrows, xb, r, add, next, (size_t)next_rows * rb, NT, type);
    }
}

static inline __attribute__((always_inline)) void
imatmul(float *out, int ldo, const ws_tensor *W, const xq_block *xb, int r0, int r1, int nt,
        int add, const int32_t type) {
    switch (nt) {
    case 1: imatmul_nt(out, ldo, W, xb, r0, r1, add, 1, type); break;
    case 2: imatmul_nt(out, ldo, W, xb, r0, r1, add, 2, type); break;
    case 3: imatmul_nt(out, ldo, W, xb, r0, r1, add, 3, type); break;
    case 4: imatmul_nt(out, ldo, W, xb, r0, r1, add, 4, type); break;
    case 5: imatmul_nt(out, ldo, W, xb, r0, r1, add, 5, type); break;
    case 6: imatmul_nt(out, ldo, W, xb, r0, r1, add, 6, type); break;
    case 7: imatmul_nt(out, ldo, W, xb, r0, r1, add, 7, type); break;
    case 8: imatmul_nt(out, ldo, W, xb, r0, r1, add, 8, type); break;
    default: imatmul_nt(out, ldo, W, xb, r0, r1, add, WS_XQ_TOKENS, type); break;
    }
}

#define WS_IMATMUL(T) \
    static void imatmul_##T(float *out, int ldo, const ws_tensor *W, const xq_block *xb, \
                            int r0, int r1, int nt, int add) { \
        imatmul(out, ldo, W, xb, r0, r1, nt, add, WS_TYPE_##T); }
WS_IMATMUL(Q8_0)
WS_IMATMUL(Q4_0)
WS_IMATMUL(Q4_1)
WS_IMATMUL(Q5_0)
WS_IMATMUL(Q4_K)
WS_IMATMUL(Q5_K)
WS_IMATMUL(Q6_K)

/* out (+)= W . X over 16-bit activations: WS_XQ_TOKENS tokens at a time, a rest of
   9..15 as 8 and then the others (the tiles are compiled for 1..8 and 16 tokens) */
static void matmul_int(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r0,
                       int r1, int nt, int add, void *scratch) {
    for (int t0 = 0, n; t0 < nt; t0 += n) {
        n = nt - t0 >= WS_XQ_TOKENS ? WS_XQ_TOKENS : nt - t0 > 8 ? 8 : nt - t0;
        const xq_block xb = quantize_tokens(X, ldx, W->cols, t0, n, scratch);
        float *o = out + (size_t)t0 * ldo;
        switch (W->type) {
        case WS_TYPE_Q8_0: imatmul_Q8_0(o, ldo, W, &xb, r0, r1, n, add); break;
        case WS_TYPE_Q4_0: imatmul_Q4_0(o, ldo, W, &xb, r0, r1, n, add); break;
        case WS_TYPE_Q4_1: imatmul_Q4_1(o, ldo, W, &xb, r0, r1, n, add); break;
        case WS_TYPE_Q5_0: imatmul_Q5_0(o, ldo, W, &xb, r0, r1, n, add); break;
        case WS_TYPE_Q4_K: imatmul_Q4_K(o, ldo, W, &xb, r0, r1, n, add); break;
        case WS_TYPE_Q5_K: imatmul_Q5_K(o, ldo, W, &xb, r0, r1, n, add); break;
        default: imatmul_Q6_K(o, ldo, W, &xb, r0, r1, n, add); break;
        }
    }
}

void ws_matmul(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r0,
               int r1, int nt, int add, float *scratch) {
    const int n = W->cols;
    if (W->type == WS_TYPE_F32) {
        matmul_f32(out, ldo, (const float *)W->data, X, ldx, n, r0, r1, nt, add);
        return;
    }
    if (is_int_type(W->type)) {
        matmul_int(out, ldo, W, X, ldx, r0, r1, nt, add, scratch);
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
    float *scratch = malloc(WS_MATMUL_SCRATCH_BYTES(t->cols));
    if (!scratch) return WS_ERR_OUT_OF_MEMORY;
    ws_matmul(out, t->rows, t, x, t->cols, 0, t->rows, nt, 0, scratch);
    free(scratch);
    return WS_OK;
}

const char *ws_kernel_path(void) {
#if WS_AVX512 && defined(__AVX512VNNI__)
    return "avx512-vnni: 16-row vpdpwssd tiles, 16-bit activations";
#elif WS_AVX512
    return "avx512: 16-row vpmaddwd tiles, 16-bit activations";
#elif WS_SIMD
    return "avx2+fma: 8-row vpmaddwd tiles, 16-bit activations";
#else
    return "portable: scalar, 16-bit activations";
#endif
}
