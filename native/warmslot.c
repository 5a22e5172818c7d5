/*
 * warmslot.c - the decoding core (see warmslot.h).
 *
 * Layout follows llama2.c's run.c: the model (config + borrowed weights), the
 * context (KV cache, scratch buffers, thread pool) and one forward pass that
 * reads top to bottom. Every buffer carries a shape comment.
 */
#define _GNU_SOURCE
#include "warmslot.h"
#include "ws_math.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "quant.h"
#include "ws_simd.h"

/*
 * Query heads that share one KV head are processed together, up to WS_ATT_GROUP of
 * them: each key and value is read (and converted from half) once for the group. The
 * AVX-512 build has the registers for 4 heads' accumulators; with 16 registers more
 * than 2 would spill. The grouping never changes a head's operations.
 */
#if WS_SIMD && defined(__AVX512F__)
#define WS_ATT_GROUP 4
#else
#define WS_ATT_GROUP 2
#endif

/* ------------------------------------------------------------------------- */
/* errors                                                                      */

static _Thread_local char g_last_error[256];

const char *ws_last_error(void) { return g_last_error; }

static ws_status fail_global(ws_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return st;
}

/* ------------------------------------------------------------------------- */
/* deterministic scalar maths (no libm variance between machines)             */

static float ws_silu(float x) { return x / (1.0f + ws_expf(-x)); }

/* ------------------------------------------------------------------------- */
/* IEEE half <-> float for callers (the conversions themselves: ws_simd.h)      */

void ws_fp16_from_fp32(const float *in, uint16_t *out, size_t n) {
    size_t i = 0;
#if WS_F16C
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) out[i] = half_from_float(in[i]);
}

void ws_fp32_from_fp16(const uint16_t *in, float *out, size_t n) {
    size_t i = 0;
#if WS_F16C
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, l8_load_h(in + i));
#endif
    for (; i < n; i++) out[i] = float_from_half(in[i]);
}

/* ------------------------------------------------------------------------- */
/* model                                                                       */

struct ws_model {
    ws_hparams hp;
    ws_weights w;
    ws_layer_weights *layers; /* [n_layer], owned copy of the pointer table */
};

/* A weight matrix: present, of a supported type, of the expected shape. */
/* dims per head: explicit (gemma3's 256 for a width of 640 and 4 heads) or n_embd/n_head */
static int ws_head_dim(const ws_hparams *hp) {
    return hp->head_dim > 0 ? hp->head_dim : hp->n_embd / hp->n_head;
}

/* a gemma3 layer that attends to the last n_swa positions only */
static int ws_layer_is_local(const ws_hparams *hp, int layer) {
    return hp->arch == WS_ARCH_GEMMA3 && hp->n_swa > 0 && (layer + 1) % hp->swa_period != 0;
}

/* gelu with the tanh approximation, tanh(u) = 1 - 2 / (exp(2u) + 1) by ws_expf: the
   same bits on every machine */
static float ws_gelu_tanh(float x) {
    const float u = 0.7978845608028654f * x * (1.0f + 0.044715f * x * x);
    const float th = 1.0f - 2.0f / (ws_expf(2.0f * u) + 1.0f);
    return 0.5f * x * (1.0f + th);
}

static ws_status check_tensor(const ws_tensor *t, const char *name, int layer, int rows,
                              int cols) {
    char where[64];
    if (layer >= 0) snprintf(where, sizeof where, "layer %d %s", layer, name);
    else snprintf(where, sizeof where, "%s", name);
    if (!t->data) return fail_global(WS_ERR_INVALID_ARGUMENT, "%s: missing weight", where);
    if (!ws_type_name(t->type))
        return fail_global(WS_ERR_INVALID_ARGUMENT, "%s: tensor type %d is not supported", where,
                           t->type);
    if (t->rows != rows || t->cols != cols)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "%s: shape [%d][%d], expected [%d][%d]",
                           where, t->rows, t->cols, rows, cols);
    if (ws_type_row_bytes(t->type, t->cols) == 0)
        return fail_global(WS_ERR_INVALID_ARGUMENT,
                           "%s: %d columns are not a whole number of %s blocks of %d", where,
                           t->cols, ws_type_name(t->type), ws_type_block(t->type));
    return WS_OK;
}

ws_status ws_model_init(const ws_hparams *hp, const ws_weights *w, ws_model **out) {
    if (!out) return fail_global(WS_ERR_INVALID_ARGUMENT, "ws_model_init: out is NULL");
    *out = NULL;
    if (!hp || !w) return fail_global(WS_ERR_INVALID_ARGUMENT, "ws_model_init: NULL argument");
    if (hp->n_vocab <= 0 || hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_head <= 0 ||
        hp->n_head_kv <= 0 || hp->n_ff <= 0)
        return fail_global(WS_ERR_INVALID_ARGUMENT,
                           "hyper-parameters must be positive (n_vocab=%d n_embd=%d n_layer=%d "
                           "n_head=%d n_head_kv=%d n_ff=%d)",
                           hp->n_vocab, hp->n_embd, hp->n_layer, hp->n_head, hp->n_head_kv,
                           hp->n_ff);
    if (hp->n_layer > WS_MAX_LAYERS)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_layer %d exceeds %d", hp->n_layer,
                           WS_MAX_LAYERS);
    if (hp->n_embd % hp->n_head != 0)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_embd %d is not a multiple of n_head %d",
                           hp->n_embd, hp->n_head);
    if (hp->n_head % hp->n_head_kv != 0)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_head %d is not a multiple of n_head_kv %d",
                           hp->n_head, hp->n_head_kv);
    if (hp->arch != WS_ARCH_LLAMA && hp->arch != WS_ARCH_GEMMA3)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "architecture %d is not supported", hp->arch);
    if (hp->head_dim < 0 || (hp->arch == WS_ARCH_LLAMA && hp->head_dim != 0 &&
                             hp->head_dim != hp->n_embd / hp->n_head))
        return fail_global(WS_ERR_INVALID_ARGUMENT, "head_dim %d is not valid for this model",
                           hp->head_dim);
    if (hp->arch == WS_ARCH_GEMMA3 &&
        (hp->n_swa < 0 || hp->swa_period < 0 || (hp->n_swa > 0 && hp->swa_period <= 0) ||
         !(hp->rope_theta_swa > 0.0f) || !isfinite(hp->rope_theta_swa)))
        return fail_global(WS_ERR_INVALID_ARGUMENT,
                           "gemma3: n_swa %d, swa_period %d and rope_theta_swa %g are not valid",
                           hp->n_swa, hp->swa_period, (double)hp->rope_theta_swa);
    const int head_dim = ws_head_dim(hp);
    if (hp->n_rot <= 0 || hp->n_rot > head_dim || hp->n_rot % 2 != 0)
        return fail_global(WS_ERR_INVALID_ARGUMENT,
                           "n_rot %d must be even and in 1..head_dim (%d)", hp->n_rot, head_dim);
    if (!(hp->rms_eps > 0.0f) || !(hp->rope_theta > 0.0f) || !isfinite(hp->rope_theta))
        return fail_global(WS_ERR_INVALID_ARGUMENT, "rms_eps and rope_theta must be positive");
    if (!w->output_norm || !w->layers)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "missing output norm or layers");
    const int hd = head_dim, q_dim = hp->n_head * hd, kv_dim = hp->n_head_kv * hd;
    ws_status st = check_tensor(&w->tok_embd, "token_embd", -1, hp->n_vocab, hp->n_embd);
    if (st == WS_OK && w->output.data)
        st = check_tensor(&w->output, "output", -1, hp->n_vocab, hp->n_embd);
    for (int l = 0; st == WS_OK && l < hp->n_layer; l++) {
        const ws_layer_weights *L = &w->layers[l];
        if (!L->attn_norm || !L->ffn_norm)
            return fail_global(WS_ERR_INVALID_ARGUMENT, "layer %d has a missing norm weight", l);
        if (hp->arch == WS_ARCH_GEMMA3 && (!L->attn_q_norm || !L->attn_k_norm ||
                                           !L->post_attn_norm || !L->post_ffn_norm))
            return fail_global(WS_ERR_INVALID_ARGUMENT,
                               "layer %d: a gemma3 layer needs q/k and post-attention/FFN norms",
                               l);
        st = check_tensor(&L->wq, "attn_q", l, q_dim, hp->n_embd);
        if (st == WS_OK) st = check_tensor(&L->wk, "attn_k", l, kv_dim, hp->n_embd);
        if (st == WS_OK) st = check_tensor(&L->wv, "attn_v", l, kv_dim, hp->n_embd);
        if (st == WS_OK) st = check_tensor(&L->wo, "attn_output", l, hp->n_embd, q_dim);
        if (st == WS_OK) st = check_tensor(&L->w_gate, "ffn_gate", l, hp->n_ff, hp->n_embd);
        if (st == WS_OK) st = check_tensor(&L->w_up, "ffn_up", l, hp->n_ff, hp->n_embd);
        if (st == WS_OK) st = check_tensor(&L->w_down, "ffn_down", l, hp->n_embd, hp->n_ff);
    }
    if (st != WS_OK) return st;
    ws_model *m = calloc(1, sizeof *m);
    if (!m) return fail_global(WS_ERR_OUT_OF_MEMORY, "out of memory allocating the model");
    m->layers = malloc(sizeof(ws_layer_weights) * (size_t)hp->n_layer);
    if (!m->layers) {
        free(m);
        return fail_global(WS_ERR_OUT_OF_MEMORY, "out of memory allocating the layer table");
    }
    memcpy(m->layers, w->layers, sizeof(ws_layer_weights) * (size_t)hp->n_layer);
    m->hp = *hp;
    m->w = *w;
    m->w.layers = m->layers;
    *out = m;
    return WS_OK;
}

void ws_model_free(ws_model *m) {
    if (!m) return;
    free(m->layers);
    free(m);
}

const ws_hparams *ws_model_hparams(const ws_model *m) { return m ? &m->hp : NULL; }

/* ------------------------------------------------------------------------- */
/* thread pool: created once per context; one wake-up per forward chunk,       */
/* spinning barriers between the phases of the chunk                           */

typedef struct ws_pool {
    int n;                       /* threads including the caller             */
    pthread_t threads[WS_MAX_THREADS];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int job;              /* generation of the current job            */
    atomic_int stop;
    atomic_int bar_count;
    atomic_int bar_gen;
    struct ws_context *ctx;
} ws_pool;

typedef struct {
    ws_pool *pool;
    int ith;
} ws_worker_arg;

static void spin_pause(int *spins) {
    if (++*spins < 2048) {
#if WS_SIMD
        _mm_pause();
#endif
    } else {
        sched_yield();
    }
}

static void pool_barrier(ws_pool *p) {
    if (p->n == 1) return;
    int gen = atomic_load(&p->bar_gen);
    if (atomic_fetch_add(&p->bar_count, 1) == p->n - 1) {
        atomic_store(&p->bar_count, 0);
        atomic_fetch_add(&p->bar_gen, 1);
    } else {
        int spins = 0;
        while (atomic_load(&p->bar_gen) == gen) spin_pause(&spins);
    }
}

static void forward_worker(struct ws_context *ctx, int ith);

static void *pool_main(void *argp) {
    ws_worker_arg *arg = argp;
    ws_pool *p = arg->pool;
    const int ith = arg->ith;
    free(arg);
    int seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load(&p->job) == seen && !atomic_load(&p->stop) && spins < 20000) {
            spins++;
#if WS_SIMD
            _mm_pause();
#endif
        }
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->job) == seen && !atomic_load(&p->stop))
            pthread_cond_wait(&p->cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
        if (atomic_load(&p->stop)) break;
        seen = atomic_load(&p->job);
        forward_worker(p->ctx, ith);
    }
    return NULL;
}

/* ------------------------------------------------------------------------- */
/* context                                                                     */

struct ws_context {
    const ws_model *model;
    ws_context_params params;
    int head_dim, q_dim, kv_dim, n_rot;
    float attn_scale;

    /* KV cache: [n_slots][n_layer][n_head_kv][n_ctx][head_dim] of params.kv_type
       (float or IEEE half bits), kv_elem bytes per value */
    void *k_cache;
    void *v_cache;
    size_t kv_elem;
    int32_t *tokens;   /* [n_slots][n_ctx] */
    int32_t *n_past;   /* [n_slots]        */

    float *rope_cos;   /* [n_ctx][n_rot/2] */
    float *rope_sin;   /* [n_ctx][n_rot/2] */
    float *rope_cos_swa; /* [n_ctx][n_rot/2] local layers' base (gemma3), else NULL */
    float *rope_sin_swa;
    float *ybuf;       /* [n_batch][n_embd] a sub-layer's output before its post-norm */

    /* scratch for one chunk of at most n_batch tokens */
    float *x;          /* [n_batch][n_embd]  residual stream        */
    float *xn;         /* [n_threads][n_batch][n_embd] normalised stream, per thread */
    float *q;          /* [n_batch][q_dim]                          */
    float *att;        /* [n_batch][q_dim]   attention output       */
    float *hb;         /* [n_batch][n_ff]    gate                   */
    float *hb2;        /* [n_batch][n_ff]    up                     */
    float *scores;     /* [n_threads][WS_ATT_GROUP][n_ctx] attention weights */

    int32_t *tok_slot; /* [n_batch] slot of each token of the chunk     */
    int32_t *tok_pos;  /* [n_batch] position of each token in its slot  */
    float *kbuf;       /* [n_batch][kv_dim] new keys before the cache   */
    float *vbuf;       /* [n_batch][kv_dim] new values before the cache */
    float *wbuf;       /* [n_threads][4][wbuf_cols] weight rows unpacked to floats */
    int wbuf_cols;     /* the longest weight row: max(n_embd, n_ff, q_dim)       */

    /* the current chunk, read by every thread of the pool */
    struct {
        int nt;               /* tokens in chunk (slot, pos: tok_slot/tok_pos) */
        int out_t0, out_nt;   /* tokens whose logits are wanted         */
        float *logits;        /* [out_nt][n_vocab]                      */
    } job;

    ws_pool pool;
    int pool_started;
    char last_error[256];
};

static ws_status fail_ctx(const ws_context *cctx, ws_status st, const char *fmt, ...) {
    ws_context *ctx = (ws_context *)cctx;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->last_error, sizeof ctx->last_error, fmt, ap);
    va_end(ap);
    return st;
}

const char *ws_context_last_error(const ws_context *ctx) { return ctx ? ctx->last_error : ""; }

ws_context_params ws_context_default_params(void) {
    ws_context_params p = {.n_slots = 1, .n_ctx = 4096, .n_threads = 2, .n_batch = 512,
                           .kv_type = WS_KV_F16};
    return p;
}

ws_context_params ws_context_get_params(const ws_context *ctx) { return ctx->params; }

const ws_model *ws_context_model(const ws_context *ctx) { return ctx ? ctx->model : NULL; }

static size_t kv_elems_per_slot(const ws_context *ctx) {
    return (size_t)ctx->model->hp.n_layer * (size_t)ctx->params.n_ctx * (size_t)ctx->kv_dim;
}

size_t ws_context_kv_bytes(const ws_context *ctx) {
    return 2 * ctx->kv_elem * kv_elems_per_slot(ctx) * (size_t)ctx->params.n_slots;
}

/*
 * The KV caches are head-major: [slot][layer][KV head][position][head_dim], so the
 * keys (or values) of one KV head are one contiguous run of positions, which the
 * attention loop streams. The state format (ws_slot_state_get) stays position-major
 * per layer ([position][kv_dim]); get and set gather and scatter between the two.
 * The values are kept in the context's kv_type (kv_elem bytes each): the address of
 * a head's position is a byte address, cast to float or uint16_t by the reader.
 */
static uint8_t *kv_head(const ws_context *ctx, void *cache, int slot, int layer, int kvh,
                        int pos) {
    const ws_hparams *hp = &ctx->model->hp;
    const size_t plane = ((size_t)slot * (size_t)hp->n_layer + (size_t)layer) *
                         (size_t)hp->n_head_kv + (size_t)kvh;
    return (uint8_t *)cache +
           (plane * (size_t)ctx->params.n_ctx + (size_t)pos) * (size_t)ctx->head_dim *
               ctx->kv_elem;
}

/* One head's new key or value (hd floats) into the cache: copied, or rounded to half. */
static void kv_store(const ws_context *ctx, uint8_t *dst, const float *v, int hd) {
    if (ctx->params.kv_type == WS_KV_F16)
        ws_fp16_from_fp32(v, (uint16_t *)(void *)dst, (size_t)hd);
    else
        memcpy(dst, v, sizeof(float) * (size_t)hd);
}

/* positions [0, n) of one layer of a slot between the cache and a [n][kv_dim] buffer
   of the same element type (the state holds the cache's values as they are) */
static void kv_gather(const ws_context *ctx, void *cache, int slot, int layer, int n,
                      uint8_t *out) {
    const int hd = ctx->head_dim, nkv = ctx->model->hp.n_head_kv;
    const size_t es = ctx->kv_elem, row = es * (size_t)hd;
    for (int h = 0; h < nkv; h++) {
        const uint8_t *src = kv_head(ctx, cache, slot, layer, h, 0);
        for (int j = 0; j < n; j++)
            memcpy(out + es * ((size_t)j * ctx->kv_dim + (size_t)h * hd), src + (size_t)j * row,
                   row);
    }
}

static void kv_scatter(ws_context *ctx, void *cache, int slot, int layer, int n,
                       const uint8_t *in) {
    const int hd = ctx->head_dim, nkv = ctx->model->hp.n_head_kv;
    const size_t es = ctx->kv_elem, row = es * (size_t)hd;
    for (int h = 0; h < nkv; h++) {
        uint8_t *dst = kv_head(ctx, cache, slot, layer, h, 0);
        for (int j = 0; j < n; j++)
            memcpy(dst + (size_t)j * row, in + es * ((size_t)j * ctx->kv_dim + (size_t)h * hd),
                   row);
    }
}

/* Writes a zero into every page of p[0..n) (already zero: calloc), so the kernel
 * commits them now. Volatile: a plain memset of calloc'd memory may be elided. */
static void touch_pages(void *p, size_t n) {
    long page = sysconf(_SC_PAGESIZE);
    const size_t step = page > 0 ? (size_t)page : 4096u;
    volatile unsigned char *c = p;
    for (size_t i = 0; i < n; i += step) c[i] = 0;
}

static void *alloc_floats(size_t n, int *ok) {
    if (!*ok) return NULL;
    void *p = NULL;
    if (n == 0) n = 1;
    if (n > SIZE_MAX / sizeof(float) || posix_memalign(&p, 64, n * sizeof(float)) != 0) {
        *ok = 0;
        return NULL;
    }
    memset(p, 0, n * sizeof(float));
    return p;
}

static void pool_stop(ws_pool *p) {
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
}

void ws_context_free(ws_context *ctx) {
    if (!ctx) return;
    if (ctx->pool_started) {
        pool_stop(&ctx->pool);
        pthread_mutex_destroy(&ctx->pool.mu);
        pthread_cond_destroy(&ctx->pool.cv);
    }
    free(ctx->k_cache);
    free(ctx->v_cache);
    free(ctx->tokens);
    free(ctx->n_past);
    free(ctx->rope_cos);
    free(ctx->rope_sin);
    free(ctx->rope_cos_swa);
    free(ctx->rope_sin_swa);
    free(ctx->ybuf);
    free(ctx->x);
    free(ctx->xn);
    free(ctx->q);
    free(ctx->att);
    free(ctx->hb);
    free(ctx->hb2);
    free(ctx->scores);
    free(ctx->tok_slot);
    free(ctx->tok_pos);
    free(ctx->kbuf);
    free(ctx->vbuf);
    free(ctx->wbuf);
    free(ctx);
}

ws_status ws_context_init(const ws_model *model, ws_context_params params, ws_context **out) {
    if (!out) return fail_global(WS_ERR_INVALID_ARGUMENT, "ws_context_init: out is NULL");
    *out = NULL;
    if (!model) return fail_global(WS_ERR_INVALID_ARGUMENT, "ws_context_init: model is NULL");
    if (params.n_slots < 1 || params.n_slots > 1024)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_slots %d out of range 1..1024",
                           params.n_slots);
    if (params.n_ctx < 1 || params.n_ctx > (1 << 20))
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_ctx %d out of range 1..1048576",
                           params.n_ctx);
    if (params.n_threads < 1 || params.n_threads > WS_MAX_THREADS)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_threads %d out of range 1..%d",
                           params.n_threads, WS_MAX_THREADS);
    if (params.n_batch < 1 || params.n_batch > 65536)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_batch %d out of range 1..65536",
                           params.n_batch);
    if (params.kv_type != WS_KV_F32 && params.kv_type != WS_KV_F16)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "kv_type %d is not f32 (%d) or f16 (%d)",
                           params.kv_type, WS_KV_F32, WS_KV_F16);
    const ws_hparams *hp = &model->hp;
    ws_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return fail_global(WS_ERR_OUT_OF_MEMORY, "out of memory allocating the context");
    ctx->model = model;
    ctx->params = params;
    ctx->head_dim = ws_head_dim(hp);
    ctx->q_dim = hp->n_head * ctx->head_dim;
    ctx->kv_dim = hp->n_head_kv * ctx->head_dim;
    ctx->n_rot = hp->n_rot;
    ctx->attn_scale = (float)(1.0 / sqrt((double)ctx->head_dim));
    ctx->kv_elem = params.kv_type == WS_KV_F16 ? sizeof(uint16_t) : sizeof(float);

    /* KV cache size: refuse sizes that overflow or that the machine cannot hold */
    const double kv_bytes = 2.0 * (double)ctx->kv_elem * (double)hp->n_layer *
                            (double)params.n_ctx * (double)ctx->kv_dim * (double)params.n_slots;
    if (kv_bytes > (double)(SIZE_MAX / 4)) {
        free(ctx);
        return fail_global(WS_ERR_OUT_OF_MEMORY, "KV cache of %.0f bytes is too large", kv_bytes);
    }
    int ok = 1;
    const size_t nb = (size_t)params.n_batch;
    const size_t kv_all = kv_elems_per_slot(ctx) * (size_t)params.n_slots;
    /* calloc: the pages of a large cache are committed only when used, unless reserved */
    ctx->k_cache = calloc(kv_all ? kv_all : 1, ctx->kv_elem);
    ctx->v_cache = calloc(kv_all ? kv_all : 1, ctx->kv_elem);
    ok = ctx->k_cache && ctx->v_cache;
    if (ok && params.reserve_kv) {
        touch_pages(ctx->k_cache, kv_all * ctx->kv_elem);
        touch_pages(ctx->v_cache, kv_all * ctx->kv_elem);
    }
    ctx->rope_cos = alloc_floats((size_t)params.n_ctx * (size_t)(ctx->n_rot / 2), &ok);
    ctx->rope_sin = alloc_floats((size_t)params.n_ctx * (size_t)(ctx->n_rot / 2), &ok);
    if (hp->arch == WS_ARCH_GEMMA3) {
        ctx->rope_cos_swa = alloc_floats((size_t)params.n_ctx * (size_t)(ctx->n_rot / 2), &ok);
        ctx->rope_sin_swa = alloc_floats((size_t)params.n_ctx * (size_t)(ctx->n_rot / 2), &ok);
        ctx->ybuf = alloc_floats(nb * (size_t)hp->n_embd, &ok);
    }
    ctx->x = alloc_floats(nb * (size_t)hp->n_embd, &ok);
    ctx->xn = alloc_floats((size_t)params.n_threads * nb * (size_t)hp->n_embd, &ok);
    ctx->q = alloc_floats(nb * (size_t)ctx->q_dim, &ok);
    ctx->att = alloc_floats(nb * (size_t)ctx->q_dim, &ok);
    ctx->hb = alloc_floats(nb * (size_t)hp->n_ff, &ok);
    ctx->hb2 = alloc_floats(nb * (size_t)hp->n_ff, &ok);
    ctx->scores = alloc_floats((size_t)params.n_threads * WS_ATT_GROUP * (size_t)params.n_ctx, &ok);
    ctx->kbuf = alloc_floats(nb * (size_t)ctx->kv_dim, &ok);
    ctx->vbuf = alloc_floats(nb * (size_t)ctx->kv_dim, &ok);
    ctx->wbuf_cols = hp->n_embd > hp->n_ff ? hp->n_embd : hp->n_ff;
    if (ctx->q_dim > ctx->wbuf_cols) ctx->wbuf_cols = ctx->q_dim;
    ctx->wbuf = alloc_floats((size_t)params.n_threads * 4 * (size_t)ctx->wbuf_cols, &ok);
    if (ok) {
        ctx->tokens = calloc((size_t)params.n_slots * (size_t)params.n_ctx, sizeof(int32_t));
        ctx->n_past = calloc((size_t)params.n_slots, sizeof(int32_t));
        ctx->tok_slot = calloc(nb, sizeof(int32_t));
        ctx->tok_pos = calloc(nb, sizeof(int32_t));
        ok = ctx->tokens && ctx->n_past && ctx->tok_slot && ctx->tok_pos;
    }
    if (!ok) {
        ws_context_free(ctx);
        return fail_global(WS_ERR_OUT_OF_MEMORY,
                           "out of memory: a context of %d slots x %d positions needs %.1f MiB "
                           "of KV cache",
                           params.n_slots, params.n_ctx, kv_bytes / 1048576.0);
    }

    /* RoPE tables: rotation i turns by pos * theta^(-2i/n_rot) (llama: the pair (2i, 2i+1),
       gemma3: NeoX's pair (i, i + n_rot/2)); gemma3's local layers have their own base */
    const int half = ctx->n_rot / 2;
    for (int pos = 0; pos < params.n_ctx; pos++) {
        for (int i = 0; i < half; i++) {
            double freq = pow((double)hp->rope_theta, -2.0 * (double)i / (double)ctx->n_rot);
            double ang = (double)pos * freq;
            ctx->rope_cos[(size_t)pos * half + i] = (float)cos(ang);
            ctx->rope_sin[(size_t)pos * half + i] = (float)sin(ang);
            if (ctx->rope_cos_swa) {
                freq = pow((double)hp->rope_theta_swa, -2.0 * (double)i / (double)ctx->n_rot);
                ang = (double)pos * freq;
                ctx->rope_cos_swa[(size_t)pos * half + i] = (float)cos(ang);
                ctx->rope_sin_swa[(size_t)pos * half + i] = (float)sin(ang);
            }
        }
    }

    /* thread pool */
    ws_pool *p = &ctx->pool;
    p->n = params.n_threads;
    p->ctx = ctx;
    atomic_init(&p->job, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->bar_count, 0);
    atomic_init(&p->bar_gen, 0);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    ctx->pool_started = 1;
    for (int i = 1; i < p->n; i++) {
        ws_worker_arg *arg = malloc(sizeof *arg);
        int rc = arg ? 0 : 1;
        if (arg) {
            arg->pool = p;
            arg->ith = i;
            rc = pthread_create(&p->threads[i], NULL, pool_main, arg);
            if (rc != 0) free(arg);
        }
        if (rc != 0) {
            p->n = i; /* join the ones that started */
            ws_context_free(ctx);
            return fail_global(WS_ERR_THREAD, "could not start worker thread %d of %d", i,
                               params.n_threads);
        }
    }
    *out = ctx;
    return WS_OK;
}

/* ------------------------------------------------------------------------- */
/* the forward pass of one chunk, run by every thread of the pool             */

/* [start, end) of n items for thread ith of nth, in blocks of `align` items */
static void split_range(int n, int ith, int nth, int align, int *start, int *end) {
    int blocks = (n + align - 1) / align;
    int per = blocks / nth, rem = blocks % nth;
    int b0 = ith * per + (ith < rem ? ith : rem);
    int b1 = b0 + per + (ith < rem ? 1 : 0);
    *start = b0 * align < n ? b0 * align : n;
    *end = b1 * align < n ? b1 * align : n;
}

static void rmsnorm_rows(float *out, const float *x, const float *w, int n, float eps, int t0,
                         int t1) {
    for (int t = t0; t < t1; t++) {
        const float *xt = x + (size_t)t * n;
        float *ot = out + (size_t)t * n;
        float ss = dot(xt, xt, n);
        float scale = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) ot[i] = (xt[i] * scale) * w[i];
    }
}

static void rope_apply_neox(float *v, const float *cs, const float *sn, int half) {
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cs[i] - b * sn[i];
        v[i + half] = a * sn[i] + b * cs[i];
    }
}

static void rope_apply(float *v, const float *cs, const float *sn, int half) {
    for (int i = 0; i < half; i++) {
        float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cs[i] - b * sn[i];
        v[2 * i + 1] = a * sn[i] + b * cs[i];
    }
}

/* element i of a KV row as floats: 8 at a time, or one (the half's exact value) */
static inline lanes8 kv_l8(const uint8_t *base, size_t i, const int f16) {
    return f16 ? l8_load_h((const uint16_t *)(const void *)base + i)
               : l8_load((const float *)(const void *)base + i);
}

static inline float kv_at(const uint8_t *base, size_t i, const int f16) {
    return f16 ? float_from_half(((const uint16_t *)(const void *)base)[i])
               : ((const float *)(const void *)base)[i];
}

/* dot(q, key) over n values of a key at element i0 of the cache: the `dot` sequence */
static inline float dot_kv(const float *q, const uint8_t *base, size_t i0, int n, const int f16) {
    if (!f16) return dot(q, (const float *)(const void *)base + i0, n);
    const int n8 = n & ~7;
    lanes8 a = l8_zero();
    for (int k = 0; k < n8; k += 8) a = l8_fma(l8_load(q + k), kv_l8(base, i0 + (size_t)k, 1), a);
    float acc = l8_sum(a);
    for (int k = n8; k < n; k++) acc = fmaf(q[k], kv_at(base, i0 + (size_t)k, 1), acc);
    return acc;
}

/*
 * Attention of NH query heads (h0, h0+1, ...) of one token that share one KV head,
 * over positions lo..pos of its slot: the keys and values are read once for the
 * group. Every score and output element is the same sequence of operations as for
 * a head alone: score = (the `dot` sequence over the head dimension) * scale; the
 * softmax as below; out[d] = fmaf chain over positions in order. NH is a constant
 * at each call site (1..WS_ATT_GROUP), so the loops over heads unroll into
 * registers. F16 (a constant too) reads the keys and values as halves, converted
 * exactly to floats before the same arithmetic.
 */
static inline __attribute__((always_inline)) void
attend_group(ws_context *ctx, int ith, int slot, int layer, int lo, int pos, int t, int h0,
             const int NH, const int F16) {
    const ws_hparams *hp = &ctx->model->hp;
    const int hd = ctx->head_dim;
    const int kvh = h0 / (hp->n_head / hp->n_head_kv);
    const float *q[WS_ATT_GROUP];
    float *out[WS_ATT_GROUP], *sc[WS_ATT_GROUP];
    for (int h = 0; h < NH; h++) {
        q[h] = ctx->q + (size_t)t * ctx->q_dim + (size_t)(h0 + h) * hd;
        out[h] = ctx->att + (size_t)t * ctx->q_dim + (size_t)(h0 + h) * hd;
        sc[h] = ctx->scores + ((size_t)ith * WS_ATT_GROUP + (size_t)h) * ctx->params.n_ctx;
    }
    /* positions lo..pos: the key and value of position lo + j at row j */
    const uint8_t *k0 = kv_head(ctx, ctx->k_cache, slot, layer, kvh, lo);
    const uint8_t *v0 = kv_head(ctx, ctx->v_cache, slot, layer, kvh, lo);
    const size_t stride = (size_t)hd; /* positions of one KV head are contiguous */
    const float scale = ctx->attn_scale;
    const int n = pos + 1 - lo, n8 = n & ~7;
    float mx[WS_ATT_GROUP];
    for (int h = 0; h < NH; h++) mx[h] = -INFINITY;
    int j = 0;
    if ((hd & 7) == 0) {
        /* four keys at a time, each loaded once for the heads of the group */
        for (; j + 4 <= n; j += 4) {
            /* byte addresses of the four keys (element size 2 or 4, a constant here) */
            const size_t es = F16 ? 2 : 4;
            const uint8_t *kr[4] = {
                k0 + (size_t)j * stride * es, k0 + (size_t)(j + 1) * stride * es,
                k0 + (size_t)(j + 2) * stride * es, k0 + (size_t)(j + 3) * stride * es};
            lanes8 a[WS_ATT_GROUP][4];
            for (int h = 0; h < NH; h++)
                for (int i = 0; i < 4; i++) a[h][i] = l8_zero();
            for (int d = 0; d < hd; d += 8) {
                lanes8 kv[4];
                for (int i = 0; i < 4; i++) kv[i] = kv_l8(kr[i], (size_t)d, F16);
                for (int h = 0; h < NH; h++) {
                    const lanes8 qv = l8_load(q[h] + d);
                    for (int i = 0; i < 4; i++) a[h][i] = l8_fma(qv, kv[i], a[h][i]);
                }
            }
            for (int h = 0; h < NH; h++) {
                float s4[4];
                l8_sum4(a[h][0], a[h][1], a[h][2], a[h][3], s4);
                for (int i = 0; i < 4; i++) {
                    const float sv = s4[i] * scale;
                    sc[h][j + i] = sv;
                    if (sv > mx[h]) mx[h] = sv;
                }
            }
        }
    }
    for (; j < n; j++)
        for (int h = 0; h < NH; h++) {
            const float sv = dot_kv(q[h], k0, (size_t)j * stride, hd, F16) * scale;
            sc[h][j] = sv;
            if (sv > mx[h]) mx[h] = sv;
        }
    /* exponentials 8 at a time, summed in 8 lanes then a fixed tree, then the tail;
       the weights w_j = e_j / sum are stored in place of the scores */
    for (int h = 0; h < NH; h++) {
        float *s = sc[h];
        lanes8 acc = l8_zero();
        for (j = 0; j < n8; j += 8) {
            lanes8 e = l8_exp(l8_sub1(l8_load(s + j), mx[h]));
            l8_store(s + j, e);
            acc = l8_add(acc, e);
        }
        float sum = l8_sum(acc);
        for (j = n8; j < n; j++) {
            s[j] = ws_expf(s[j] - mx[h]);
            sum += s[j];
        }
        const float inv = 1.0f / sum;
        for (j = 0; j < n; j++) s[j] = s[j] * inv;
    }
    /* out[d] = sum over j of w_j * v_j[d], accumulated in j order with fmaf: 64 (16
       lanes) or 32 dimensions at a time in registers, each value row loaded once for
       the group (every lane its own chain: the width does not change the bits) */
    int d = 0;
#if WS_SIMD && defined(__AVX512F__)
    for (; d + 64 <= hd; d += 64) {
        __m512 o[WS_ATT_GROUP][4];
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) o[h][i] = _mm512_setzero_ps();
        for (j = 0; j < n; j++) {
            const size_t vj = (size_t)j * stride + (size_t)d;
            __m512 v[4];
            for (int i = 0; i < 4; i++)
                v[i] = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                 (const __m256i *)(const void *)(v0 + 2 * (vj + 16 * (size_t)i))))
                           : _mm512_loadu_ps((const float *)(const void *)v0 + vj + 16 * (size_t)i);
            for (int h = 0; h < NH; h++) {
                const __m512 w = _mm512_set1_ps(sc[h][j]);
                for (int i = 0; i < 4; i++) o[h][i] = _mm512_fmadd_ps(w, v[i], o[h][i]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(out[h] + d + 16 * i, o[h][i]);
    }
#endif
    for (; d + 32 <= hd; d += 32) {
        lanes8 o[WS_ATT_GROUP][4];
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) o[h][i] = l8_zero();
        for (j = 0; j < n; j++) {
            const size_t vj = (size_t)j * stride + (size_t)d;
            const lanes8 v[4] = {kv_l8(v0, vj, F16), kv_l8(v0, vj + 8, F16),
                                 kv_l8(v0, vj + 16, F16), kv_l8(v0, vj + 24, F16)};
            for (int h = 0; h < NH; h++) {
                const lanes8 w = l8_set1(sc[h][j]);
                for (int i = 0; i < 4; i++) o[h][i] = l8_fma(w, v[i], o[h][i]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) l8_store(out[h] + d + 8 * i, o[h][i]);
    }
    for (; d + 8 <= hd; d += 8)
        for (int h = 0; h < NH; h++) {
            lanes8 o = l8_zero();
            for (j = 0; j < n; j++)
                o = l8_fma(l8_set1(sc[h][j]), kv_l8(v0, (size_t)j * stride + (size_t)d, F16), o);
            l8_store(out[h] + d, o);
        }
    for (; d < hd; d++)
        for (int h = 0; h < NH; h++) {
            float o = 0.0f;
            for (j = 0; j < n; j++)
                o = fmaf(sc[h][j], kv_at(v0, (size_t)j * stride + (size_t)d, F16), o);
            out[h][d] = o;
        }
}

/* query heads [h, he) of one token, all of one KV head, in groups of at most
   WS_ATT_GROUP */
static inline __attribute__((always_inline)) void
attend_heads(ws_context *ctx, int ith, int slot, int layer, int lo, int pos, int t, int h, int he,
             const int F16) {
    while (h < he) {
        const int k = he - h < WS_ATT_GROUP ? he - h : WS_ATT_GROUP;
        switch (k) {
        case 1: attend_group(ctx, ith, slot, layer, lo, pos, t, h, 1, F16); break;
#if WS_ATT_GROUP >= 4
        case 3: attend_group(ctx, ith, slot, layer, lo, pos, t, h, 3, F16); break;
        case 4: attend_group(ctx, ith, slot, layer, lo, pos, t, h, 4, F16); break;
#endif
        default: attend_group(ctx, ith, slot, layer, lo, pos, t, h, 2, F16); break;
        }
        h += k;
    }
}

/* attention of query heads [h, he) of one token (any KV heads); a local layer attends
   to positions pos - n_swa + 1 .. pos only */
static void attend(ws_context *ctx, int ith, int slot, int layer, int pos, int t, int h,
                   int he) {
    const ws_hparams *hp = &ctx->model->hp;
    const int lo = ws_layer_is_local(hp, layer) && pos >= hp->n_swa ? pos - hp->n_swa + 1 : 0;
    const int rep = hp->n_head / hp->n_head_kv;
    while (h < he) {
        const int ge = (h / rep + 1) * rep < he ? (h / rep + 1) * rep : he; /* this KV head's */
        if (ctx->params.kv_type == WS_KV_F16)
            attend_heads(ctx, ith, slot, layer, lo, pos, t, h, ge, 1);
        else
            attend_heads(ctx, ith, slot, layer, lo, pos, t, h, ge, 0);
        h = ge;
    }
}

/* x[t] += rmsnorm(ybuf[t]) * w for this thread's tokens (whole rows: each row's
   operations do not depend on the split) */
static void add_normed(ws_context *ctx, const float *w, int ith, int nth, int nt) {
    const ws_hparams *hp = &ctx->model->hp;
    const int E = hp->n_embd;
    int a, b;
    split_range(nt, ith, nth, 1, &a, &b);
    rmsnorm_rows(ctx->ybuf, ctx->ybuf, w, E, hp->rms_eps, a, b);
    for (int t = a; t < b; t++) {
        float *xt = ctx->x + (size_t)t * E;
        const float *yt = ctx->ybuf + (size_t)t * E;
        for (int i = 0; i < E; i++) xt[i] += yt[i];
    }
}

static void forward_worker(ws_context *ctx, int ith) {
    const ws_model *m = ctx->model;
    const ws_hparams *hp = &m->hp;
    ws_pool *pool = &ctx->pool;
    const int nth = pool->n;
    /* read the job once: the caller may set up the next chunk as soon as the
       last barrier of this one opens */
    const int nt = ctx->job.nt;
    const int32_t *tslot = ctx->tok_slot, *tpos = ctx->tok_pos; /* [nt] */
    const int t0 = ctx->job.out_t0, on = ctx->job.out_nt;
    float *const logits = ctx->job.logits;
    const int E = hp->n_embd, F = hp->n_ff, Q = ctx->q_dim, KV = ctx->kv_dim;
    const int half = ctx->n_rot / 2, hd = ctx->head_dim;
    int a, b;

    /* every thread normalises the whole chunk into its own buffer: no barrier needed */
    float *xn = ctx->xn + (size_t)ith * (size_t)ctx->params.n_batch * (size_t)E; /* [nt][E] */
    float *wbuf = ctx->wbuf + (size_t)ith * 4 * (size_t)ctx->wbuf_cols; /* [4][cols] */
    const int n_units = hp->n_head + 2 * hp->n_head_kv;

    const int gemma = hp->arch == WS_ARCH_GEMMA3;
    for (int l = 0; l < hp->n_layer; l++) {
        const ws_layer_weights *L = &m->w.layers[l];
        const int local = ws_layer_is_local(hp, l);
        const float *rcos = local ? ctx->rope_cos_swa : ctx->rope_cos;
        const float *rsin = local ? ctx->rope_sin_swa : ctx->rope_sin;

        rmsnorm_rows(xn, ctx->x, L->attn_norm, E, hp->rms_eps, 0, nt);

        /* q, k, v projections split by whole heads, so each thread turns (RoPE)
           the q and k heads it computed without waiting for the others */
        split_range(n_units, ith, nth, 1, &a, &b);
        for (int u = a; u < b; u++) {
            const int is_q = u < hp->n_head, is_k = !is_q && u < hp->n_head + hp->n_head_kv;
            const int h = is_q ? u : is_k ? u - hp->n_head : u - hp->n_head - hp->n_head_kv;
            float *dst = is_q ? ctx->q : is_k ? ctx->kbuf : ctx->vbuf;
            const int ld = is_q ? Q : KV;
            const ws_tensor *w = is_q ? &L->wq : is_k ? &L->wk : &L->wv;
            ws_matmul(dst, ld, w, xn, E, h * hd, (h + 1) * hd, nt, 0, wbuf);
            for (int t = 0; t < nt; t++) {
                float *v = dst + (size_t)t * ld + (size_t)h * hd;
                if (gemma && (is_q || is_k)) {
                    /* QK-norm: each head normalised on its own, then NeoX RoPE */
                    rmsnorm_rows(v, v, is_q ? L->attn_q_norm : L->attn_k_norm, hd, hp->rms_eps,
                                 0, 1);
                    rope_apply_neox(v, rcos + (size_t)tpos[t] * half,
                                    rsin + (size_t)tpos[t] * half, half);
                } else if (is_q || is_k) {
                    rope_apply(v, ctx->rope_cos + (size_t)tpos[t] * half,
                               ctx->rope_sin + (size_t)tpos[t] * half, half);
                }
                if (!is_q) /* this head of the token's key / value into its slot's cache */
                    kv_store(ctx, kv_head(ctx, is_k ? ctx->k_cache : ctx->v_cache, tslot[t], l,
                                          h, tpos[t]), v, hd);
            }
        }
        pool_barrier(pool);

        /* attention: one task per (token, query head), split evenly over the threads;
           a thread's consecutive heads of one token and KV head run together */
        split_range(nt * hp->n_head, ith, nth, 1, &a, &b);
        for (int i = a; i < b;) {
            const int t = i / hp->n_head, h = i % hp->n_head;
            const int he = b - i < hp->n_head - h ? h + (b - i) : hp->n_head;
            attend(ctx, ith, tslot[t], l, tpos[t], t, h, he);
            i += he - h;
        }
        pool_barrier(pool);

        /* output projection added to the residual stream (gemma3: its post-norm first) */
        split_range(E, ith, nth, 4, &a, &b);
        if (gemma) {
            ws_matmul(ctx->ybuf, E, &L->wo, ctx->att, Q, a, b, nt, 0, wbuf);
            pool_barrier(pool);
            add_normed(ctx, L->post_attn_norm, ith, nth, nt);
        } else {
            ws_matmul(ctx->x, E, &L->wo, ctx->att, Q, a, b, nt, 1, wbuf);
        }
        pool_barrier(pool);

        rmsnorm_rows(xn, ctx->x, L->ffn_norm, E, hp->rms_eps, 0, nt);

        /* SwiGLU: hb = silu(gate x) * (up x) */
        split_range(F, ith, nth, 4, &a, &b);
        ws_matmul(ctx->hb, F, &L->w_gate, xn, E, a, b, nt, 0, wbuf);
        ws_matmul(ctx->hb2, F, &L->w_up, xn, E, a, b, nt, 0, wbuf);
        for (int t = 0; t < nt; t++) {
            float *g = ctx->hb + (size_t)t * F, *u = ctx->hb2 + (size_t)t * F;
            if (gemma) /* GeGLU */
                for (int i = a; i < b; i++) g[i] = ws_gelu_tanh(g[i]) * u[i];
            else
                for (int i = a; i < b; i++) g[i] = ws_silu(g[i]) * u[i];
        }
        pool_barrier(pool);

        split_range(E, ith, nth, 4, &a, &b);
        if (gemma) {
            ws_matmul(ctx->ybuf, E, &L->w_down, ctx->hb, F, a, b, nt, 0, wbuf);
            pool_barrier(pool);
            add_normed(ctx, L->post_ffn_norm, ith, nth, nt);
        } else {
            ws_matmul(ctx->x, E, &L->w_down, ctx->hb, F, a, b, nt, 1, wbuf);
        }
        pool_barrier(pool);
    }

    /* final norm and logits of the wanted tokens */
    if (on > 0) {
        rmsnorm_rows(xn + (size_t)t0 * E, ctx->x + (size_t)t0 * E, m->w.output_norm, E,
                     hp->rms_eps, 0, on);
        const ws_tensor *wout = m->w.output.data ? &m->w.output : &m->w.tok_embd;
        split_range(hp->n_vocab, ith, nth, 4, &a, &b);
        ws_matmul(logits, hp->n_vocab, wout, xn + (size_t)t0 * E, E, a, b, on, 0, wbuf);
        pool_barrier(pool);
    }
}

static void run_chunk(ws_context *ctx) {
    ws_pool *p = &ctx->pool;
    if (p->n > 1) {
        pthread_mutex_lock(&p->mu);
        atomic_fetch_add(&p->job, 1);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    forward_worker(ctx, 0);
}

/* ------------------------------------------------------------------------- */
/* public slot operations                                                      */

static ws_status check_slot(const ws_context *ctx, int32_t slot) {
    if (slot < 0 || slot >= ctx->params.n_slots)
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT, "slot %d out of range 0..%d", slot,
                        ctx->params.n_slots - 1);
    return WS_OK;
}

ws_status ws_slot_n_tokens(const ws_context *ctx, int32_t slot, int32_t *n_out) {
    if (!ctx || !n_out) return WS_ERR_INVALID_ARGUMENT;
    ws_status st = check_slot(ctx, slot);
    if (st != WS_OK) return st;
    *n_out = ctx->n_past[slot];
    return WS_OK;
}

ws_status ws_slot_tokens(const ws_context *ctx, int32_t slot, int32_t *out, size_t cap,
                         int32_t *n_out) {
    if (!ctx || !n_out || (!out && cap > 0)) return WS_ERR_INVALID_ARGUMENT;
    ws_status st = check_slot(ctx, slot);
    if (st != WS_OK) return st;
    const int32_t n = ctx->n_past[slot];
    *n_out = n;
    if (cap < (size_t)n)
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL, "token buffer holds %zu, slot has %d", cap,
                        n);
    memcpy(out, ctx->tokens + (size_t)slot * ctx->params.n_ctx, sizeof(int32_t) * (size_t)n);
    return WS_OK;
}

/* a token's embedding row (gemma3: times sqrt(n_embd), rounded to float as llama.cpp) */
static void embed(const ws_context *ctx, int32_t token, float *out) {
    const ws_hparams *hp = &ctx->model->hp;
    ws_row_f32(&ctx->model->w.tok_embd, token, out);
    if (hp->arch == WS_ARCH_GEMMA3) {
        const float scale = sqrtf((float)hp->n_embd);
        for (int i = 0; i < hp->n_embd; i++) out[i] *= scale;
    }
}

ws_status ws_decode(ws_context *ctx, int32_t slot, const int32_t *tokens, int32_t n_tokens,
                    int logits_all, float *logits, size_t logits_cap) {
    if (!ctx) return WS_ERR_INVALID_ARGUMENT;
    ws_status st = check_slot(ctx, slot);
    if (st != WS_OK) return st;
    const ws_hparams *hp = &ctx->model->hp;
    if (!tokens || n_tokens <= 0)
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT, "decode needs at least one token (got %d)",
                        n_tokens);
    const int32_t n_past = ctx->n_past[slot];
    if ((int64_t)n_past + n_tokens > ctx->params.n_ctx)
        return fail_ctx(ctx, WS_ERR_CONTEXT_FULL,
                        "slot %d holds %d tokens; %d more exceed its context of %d", slot, n_past,
                        n_tokens, ctx->params.n_ctx);
    for (int32_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                            "token %d at index %d is outside the vocabulary 0..%d", tokens[i], i,
                            hp->n_vocab - 1);
    const int want = !(logits == NULL && logits_cap == 0);
    const size_t need = want ? (size_t)(logits_all ? n_tokens : 1) * (size_t)hp->n_vocab : 0;
    if (want && (!logits || logits_cap < need))
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL,
                        "logits buffer holds %zu floats, %zu are needed", logits_cap, need);

    const int E = hp->n_embd;
    for (int32_t done = 0; done < n_tokens;) {
        int nt = n_tokens - done;
        if (nt > ctx->params.n_batch) nt = ctx->params.n_batch;
        const int last_chunk = done + nt == n_tokens;
        for (int t = 0; t < nt; t++)
            embed(ctx, tokens[done + t], ctx->x + (size_t)t * E);
        for (int t = 0; t < nt; t++) {
            ctx->tok_slot[t] = slot;
            ctx->tok_pos[t] = n_past + done + t;
        }
        ctx->job.nt = nt;
        if (!want) {
            ctx->job.out_t0 = 0;
            ctx->job.out_nt = 0;
            ctx->job.logits = NULL;
        } else if (logits_all) {
            ctx->job.out_t0 = 0;
            ctx->job.out_nt = nt;
            ctx->job.logits = logits + (size_t)done * hp->n_vocab;
        } else {
            ctx->job.out_t0 = nt - 1;
            ctx->job.out_nt = last_chunk ? 1 : 0;
            ctx->job.logits = logits;
        }
        run_chunk(ctx);
        done += nt;
    }
    memcpy(ctx->tokens + (size_t)slot * ctx->params.n_ctx + n_past, tokens,
           sizeof(int32_t) * (size_t)n_tokens);
    ctx->n_past[slot] = n_past + n_tokens;
    return WS_OK;
}

ws_status ws_decode_multi(ws_context *ctx, const int32_t *slots, const int32_t *tokens,
                          int32_t n, float *logits, size_t logits_cap) {
    if (!ctx) return WS_ERR_INVALID_ARGUMENT;
    const ws_hparams *hp = &ctx->model->hp;
    if (!slots || !tokens || n <= 0 || n > ctx->params.n_batch)
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                        "a multi-slot decode takes 1..%d tokens (got %d)", ctx->params.n_batch, n);
    for (int32_t i = 0; i < n; i++) {
        ws_status st = check_slot(ctx, slots[i]);
        if (st != WS_OK) return st;
        for (int32_t j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                                "slot %d appears twice in a multi-slot decode", slots[i]);
        if (ctx->n_past[slots[i]] + 1 > ctx->params.n_ctx)
            return fail_ctx(ctx, WS_ERR_CONTEXT_FULL, "slot %d is full (%d positions)", slots[i],
                            ctx->params.n_ctx);
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                            "token %d at index %d is outside the vocabulary 0..%d", tokens[i], i,
                            hp->n_vocab - 1);
    }
    const size_t need = (size_t)n * (size_t)hp->n_vocab;
    if (!logits || logits_cap < need)
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL,
                        "logits buffer holds %zu floats, %zu are needed", logits_cap, need);
    const int E = hp->n_embd;
    for (int32_t t = 0; t < n; t++) {
        embed(ctx, tokens[t], ctx->x + (size_t)t * E);
        ctx->tok_slot[t] = slots[t];
        ctx->tok_pos[t] = ctx->n_past[slots[t]];
    }
    ctx->job.nt = n;
    ctx->job.out_t0 = 0;
    ctx->job.out_nt = n;
    ctx->job.logits = logits;
    run_chunk(ctx);
    for (int32_t t = 0; t < n; t++) {
        ctx->tokens[(size_t)slots[t] * ctx->params.n_ctx + ctx->n_past[slots[t]]] = tokens[t];
        ctx->n_past[slots[t]]++;
    }
    return WS_OK;
}

ws_status ws_slot_truncate(ws_context *ctx, int32_t slot, int32_t n) {
    if (!ctx) return WS_ERR_INVALID_ARGUMENT;
    ws_status st = check_slot(ctx, slot);
    if (st != WS_OK) return st;
    if (n < 0 || n > ctx->n_past[slot])
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT, "cannot truncate slot %d of %d tokens to %d",
                        slot, ctx->n_past[slot], n);
    ctx->n_past[slot] = n;
    return WS_OK;
}

ws_status ws_slot_clear(ws_context *ctx, int32_t slot) { return ws_slot_truncate(ctx, slot, 0); }

/* ------------------------------------------------------------------------- */
/* slot state                                                                  */

#define WS_STATE_HEADER_BYTES 32u

static size_t state_bytes(const ws_context *ctx, size_t n_tokens) {
    return WS_STATE_HEADER_BYTES + sizeof(int32_t) * n_tokens +
           2 * ctx->kv_elem * (size_t)ctx->model->hp.n_layer * n_tokens * (size_t)ctx->kv_dim;
}

static const char *kv_type_name(uint32_t t) {
    return t == WS_KV_F32 ? "f32" : t == WS_KV_F16 ? "f16" : "unknown";
}

static void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

ws_status ws_slot_state_size(const ws_context *ctx, int32_t slot, size_t *size_out) {
    if (!ctx || !size_out) return WS_ERR_INVALID_ARGUMENT;
    ws_status st = check_slot(ctx, slot);
    if (st != WS_OK) return st;
    *size_out = state_bytes(ctx, (size_t)ctx->n_past[slot]);
    return WS_OK;
}

ws_status ws_slot_state_get(const ws_context *ctx, int32_t slot, uint8_t *buf, size_t cap,
                            size_t *written_out) {
    if (!ctx || !written_out) return WS_ERR_INVALID_ARGUMENT;
    *written_out = 0;
    ws_status st = check_slot(ctx, slot);
    if (st != WS_OK) return st;
    const size_t n = (size_t)ctx->n_past[slot];
    const size_t need = state_bytes(ctx, n);
    if (!buf || cap < need)
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL, "state buffer holds %zu bytes, %zu needed",
                        cap, need);
    const ws_hparams *hp = &ctx->model->hp;
    uint8_t *p = buf;
    put_u32(p + 0, WS_STATE_MAGIC);
    put_u32(p + 4, WS_STATE_VERSION);
    put_u32(p + 8, (uint32_t)hp->n_layer);
    put_u32(p + 12, (uint32_t)ctx->kv_dim);
    put_u32(p + 16, (uint32_t)ctx->kv_dim);
    put_u32(p + 20, (uint32_t)ctx->params.kv_type);
    put_u32(p + 24, (uint32_t)n);
    put_u32(p + 28, 0u);
    p += WS_STATE_HEADER_BYTES;
    memcpy(p, ctx->tokens + (size_t)slot * ctx->params.n_ctx, sizeof(int32_t) * n);
    p += sizeof(int32_t) * n;
    const size_t row = ctx->kv_elem * n * (size_t)ctx->kv_dim;
    for (int l = 0; l < hp->n_layer; l++) {
        kv_gather(ctx, ctx->k_cache, slot, l, (int)n, p);
        p += row;
        kv_gather(ctx, ctx->v_cache, slot, l, (int)n, p);
        p += row;
    }
    *written_out = need;
    return WS_OK;
}

/* Checks a state header against the context; *n_out: its token count. */
static ws_status state_header_check(ws_context *ctx, const uint8_t *buf, size_t len,
                                    uint32_t *n_out) {
    const ws_hparams *hp = &ctx->model->hp;
    if (!buf || len < WS_STATE_HEADER_BYTES)
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state of %zu bytes is shorter than its header",
                        len);
    if (get_u32(buf) != WS_STATE_MAGIC)
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state magic 0x%08x is not WSKV", get_u32(buf));
    const uint32_t version = get_u32(buf + 4);
    if (version < 1 || version > WS_STATE_VERSION)
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state version %u is not supported (1..%u)",
                        version, WS_STATE_VERSION);
    const uint32_t nl = get_u32(buf + 8), nk = get_u32(buf + 12), nv = get_u32(buf + 16);
    if (nl != (uint32_t)hp->n_layer || nk != (uint32_t)ctx->kv_dim || nv != (uint32_t)ctx->kv_dim)
        return fail_ctx(ctx, WS_ERR_BAD_STATE,
                        "state layout (%u layers, k %u, v %u) does not match the model (%d, %d, %d)",
                        nl, nk, nv, hp->n_layer, ctx->kv_dim, ctx->kv_dim);
    const uint32_t dtype = get_u32(buf + 20);
    /* version 1 knew f32 only */
    if ((dtype != WS_KV_F32 && (version < 2 || dtype != WS_KV_F16)) || get_u32(buf + 28) != 0u)
        return fail_ctx(ctx, WS_ERR_BAD_STATE,
                        "state dtype %u / reserved %u not supported by state version %u", dtype,
                        get_u32(buf + 28), version);
    if (dtype != (uint32_t)ctx->params.kv_type)
        return fail_ctx(ctx, WS_ERR_BAD_STATE,
                        "state holds an %s KV cache, this context keeps %s: restore it into a "
                        "context of KV type %s", kv_type_name(dtype),
                        kv_type_name((uint32_t)ctx->params.kv_type), kv_type_name(dtype));
    const uint32_t n = get_u32(buf + 24);
    if (n > (uint32_t)ctx->params.n_ctx)
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state holds %u tokens, the context only %d", n,
                        ctx->params.n_ctx);
    *n_out = n;
    return WS_OK;
}

/* Validates n tokens and their KV (layout of ws_slot_state_get), then loads them. */
static ws_status state_load(ws_context *ctx, int32_t slot, uint32_t n, const uint8_t *tokens,
                            const uint8_t *kv) {
    const ws_hparams *hp = &ctx->model->hp;
    for (uint32_t i = 0; i < n; i++) {
        int32_t tok;
        memcpy(&tok, tokens + 4 * (size_t)i, sizeof tok);
        if (tok < 0 || tok >= hp->n_vocab)
            return fail_ctx(ctx, WS_ERR_BAD_STATE, "state token %d at %u is outside 0..%d", tok, i,
                            hp->n_vocab - 1);
    }
    /* a NaN or infinity in the KV would poison every later token: refuse it */
    const size_t n_vals = 2 * (size_t)hp->n_layer * n * (size_t)ctx->kv_dim;
    for (size_t i = 0; i < n_vals; i++) {
        int finite;
        if (ctx->params.kv_type == WS_KV_F16) {
            const uint16_t h = (uint16_t)(kv[2 * i] | kv[2 * i + 1] << 8);
            finite = (h & 0x7c00u) != 0x7c00u;
        } else {
            float f;
            memcpy(&f, kv + 4 * i, sizeof f);
            finite = isfinite(f);
        }
        if (!finite)
            return fail_ctx(ctx, WS_ERR_BAD_STATE, "state KV value %zu is not finite", i);
    }
    if (n) memcpy(ctx->tokens + (size_t)slot * ctx->params.n_ctx, tokens, sizeof(int32_t) * n);
    const size_t row = ctx->kv_elem * n * (size_t)ctx->kv_dim;
    for (int l = 0; n && l < hp->n_layer; l++) {
        kv_scatter(ctx, ctx->k_cache, slot, l, (int)n, kv);
        kv += row;
        kv_scatter(ctx, ctx->v_cache, slot, l, (int)n, kv);
        kv += row;
    }
    ctx->n_past[slot] = (int32_t)n;
    return WS_OK;
}

/* The start of both state setters: arguments, slot, then the slot is emptied (any
 * failure from here on leaves it empty) and the header checked; *n_out: its tokens. */
static ws_status state_set_begin(ws_context *ctx, int32_t slot, const uint8_t *header,
                                 size_t header_len, size_t *read_out, uint32_t *n_out) {
    if (!ctx || !read_out) return WS_ERR_INVALID_ARGUMENT;
    *read_out = 0;
    ws_status st = check_slot(ctx, slot);
    if (st != WS_OK) return st;
    ctx->n_past[slot] = 0;
    return state_header_check(ctx, header, header_len, n_out);
}

ws_status ws_slot_state_set(ws_context *ctx, int32_t slot, const uint8_t *buf, size_t len,
                            size_t *read_out) {
    uint32_t n = 0;
    ws_status st = state_set_begin(ctx, slot, buf, len, read_out, &n);
    if (st != WS_OK) return st;
    const size_t need = state_bytes(ctx, n);
    if (len != need)
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state of %u tokens must be %zu bytes, got %zu", n,
                        need, len);
    const uint8_t *tokens = buf + WS_STATE_HEADER_BYTES;
    st = state_load(ctx, slot, n, tokens, tokens + sizeof(int32_t) * n);
    if (st != WS_OK) return st;
    *read_out = need;
    return WS_OK;
}

ws_status ws_slot_state_set_parts(ws_context *ctx, int32_t slot, const uint8_t *header,
                                  size_t header_len, const uint8_t *tokens, size_t tokens_len,
                                  const uint8_t *kv, size_t kv_len, size_t *read_out) {
    uint32_t n = 0;
    ws_status st = state_set_begin(ctx, slot, header, header_len, read_out, &n);
    if (st != WS_OK) return st;
    const size_t kv_need = state_bytes(ctx, n) - WS_STATE_HEADER_BYTES - sizeof(int32_t) * n;
    if (header_len != WS_STATE_HEADER_BYTES || tokens_len != sizeof(int32_t) * n ||
        kv_len != kv_need)
        return fail_ctx(ctx, WS_ERR_BAD_STATE,
                        "state of %u tokens needs parts of %u, %zu and %zu bytes, got %zu, %zu "
                        "and %zu", n, WS_STATE_HEADER_BYTES, sizeof(int32_t) * n, kv_need,
                        header_len, tokens_len, kv_len);
    if ((n && !tokens) || (kv_need && !kv))
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state part missing (NULL pointer)");
    st = state_load(ctx, slot, n, tokens, kv);
    if (st != WS_OK) return st;
    *read_out = header_len + tokens_len + kv_len;
    return WS_OK;
}
