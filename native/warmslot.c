/*
 * warmslot.c - the decoding core (see warmslot.h).
 *
 * Layout follows llama2.c's run.c: the model (config + borrowed weights), the
 * context (KV cache, scratch buffers, thread pool) and one forward pass that
 * reads top to bottom. Every buffer carries a shape comment.
 */
#define _GNU_SOURCE
#include "warmslot.h"
#include "ws_error.h"
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
    const int head = w->fc.data != NULL;
    if (head && (hp->arch != WS_ARCH_LLAMA || !w->output.data || w->tok_embd.rows < 1))
        return fail_global(WS_ERR_INVALID_ARGUMENT,
                           "a feature head needs the llama architecture, its own output "
                           "and its target's token embedding");
    /* a head's token embedding is its target's: any number of rows */
    ws_status st = check_tensor(&w->tok_embd, "token_embd", -1,
                                head ? w->tok_embd.rows : hp->n_vocab, hp->n_embd);
    if (st == WS_OK && w->output.data)
        st = check_tensor(&w->output, "output", -1, hp->n_vocab, hp->n_embd);
    if (st == WS_OK && head) st = check_tensor(&w->fc, "fc", -1, hp->n_embd, 2 * hp->n_embd);
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

    /* KV cache: [n_slots][n_layer][n_head_kv][layer_cap[l]] head rows, each the
       head_dim values of one position of one KV head in params.kv_type (floats, IEEE
       half bits, or q8_0 blocks), kv_row bytes; position p of layer l at row
       p % layer_cap[l] (a global layer: n_ctx rows, p itself; a sliding-window layer:
       a ring of n_ring rows) */
    void *k_cache;
    void *v_cache;
    size_t kv_row;                   /* bytes of one head row                     */
    int layer_cap[WS_MAX_LAYERS];    /* rows of layer l                           */
    size_t layer_off[WS_MAX_LAYERS]; /* head rows before layer l within a slot    */
    size_t slot_rows;                /* head rows of one slot (K or V)            */
    int n_ring;        /* rows of a sliding-window layer: n_ctx when swa_full or no
                          such layer, else min(n_ctx, n_swa + WS_SWA_SPARE)        */
    int has_ring;      /* some layer keeps fewer rows than n_ctx                   */
    int32_t *tokens;   /* [n_slots][n_ctx] */
    int32_t *n_past;   /* [n_slots]        */
    int32_t *ring_lo;  /* [n_slots] oldest position every ring still holds         */

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

    float *fin;        /* [n_batch][2 * n_embd] a feature head's inputs: embedding, feature */
    int n_tok;         /* token ids a decode accepts: the rows of tok_embd          */
    int32_t *out_rows; /* [n_batch] chunk tokens whose logits are wanted, in order  */
    int32_t *tok_slot; /* [n_batch] slot of each token of the chunk     */
    int32_t *tok_pos;  /* [n_batch] position of each token in its slot  */
    float *kbuf;       /* [n_batch][kv_dim] new keys before the cache   */
    float *vbuf;       /* [n_batch][kv_dim] new values before the cache */
    /* a sliding-window layer's new keys and values in the cache's type, read by the
       chunk's attention and written into the ring after it: a chunk's later
       positions would otherwise overwrite ring rows its earlier tokens still read */
    void *kstage;      /* [n_batch][n_head_kv] head rows of kv_row bytes */
    void *vstage;      /* [n_batch][n_head_kv]                           */
    int32_t *tok_first; /* [n_batch] first position of the token's slot in the chunk */
    int32_t *tok_last;  /* [n_batch] last position of the token's slot in the chunk  */
    const uint8_t **rows; /* [n_threads][2][n_ctx] key and value row of each attended
                             position                                                 */
    float *wbuf;       /* [n_threads][WS_MATMUL_SCRATCH_BYTES(wbuf_cols) / 4] ws_matmul's scratch */
    int wbuf_cols;     /* the longest weight row: max(n_embd, n_ff, q_dim)       */

    /* the current chunk, read by every thread of the pool */
    struct {
        int nt;               /* tokens in chunk (slot, pos: tok_slot/tok_pos) */
        int out_t0, out_nt;   /* tokens whose logits are wanted         */
        float *logits;        /* [out_nt][n_vocab]                      */
        int rows_listed;      /* 1: the wanted tokens are out_rows[0..out_nt) */
        float *hidden;        /* [nt][n_embd] hidden states out, or NULL */
        int kv_only;          /* the last layer stops after its keys and values */
    } job;

    ws_pool pool;
    int pool_started;
    char last_error[256];
};

WS_DEFINE_FAIL(fail_ctx, ws_context)

const char *ws_context_last_error(const ws_context *ctx) { return ctx ? ctx->last_error : ""; }

ws_context_params ws_context_default_params(void) {
    ws_context_params p = {.n_slots = 1, .n_ctx = 4096, .n_threads = 2, .n_batch = 512,
                           .kv_type = WS_KV_F16};
    return p;
}

ws_context_params ws_context_get_params(const ws_context *ctx) { return ctx->params; }

const ws_model *ws_context_model(const ws_context *ctx) { return ctx ? ctx->model : NULL; }

int ws_context_is_head(const ws_context *ctx) { return ctx && ctx->model->w.fc.data != NULL; }

size_t ws_context_kv_bytes(const ws_context *ctx) {
    return 2 * ctx->kv_row * ctx->slot_rows * (size_t)ctx->params.n_slots;
}

const char *ws_kv_type_name(int32_t kv_type) {
    switch (kv_type) {
    case WS_KV_F32: return "f32";
    case WS_KV_F16: return "f16";
    case WS_KV_Q8_0: return "q8_0";
    default: return NULL;
    }
}

size_t ws_kv_type_bytes(int32_t kv_type, int64_t n) {
    if (n < 0 || (uint64_t)n > SIZE_MAX / sizeof(float)) return 0;
    switch (kv_type) {
    case WS_KV_F32: return (size_t)n * sizeof(float);
    case WS_KV_F16: return (size_t)n * sizeof(uint16_t);
    case WS_KV_Q8_0:
        return n % WS_Q8_BLOCK ? 0 : (size_t)(n / WS_Q8_BLOCK) * WS_Q8_BLOCK_BYTES;
    default: return 0;
    }
}

/* the KV type is one the core knows and holds a head row of this model: q8_0 needs a
   head_dim of whole blocks (a block never spans two heads) */
static ws_status kv_type_check(const ws_hparams *hp, int32_t kv_type) {
    if (!ws_kv_type_name(kv_type))
        return fail_global(WS_ERR_INVALID_ARGUMENT,
                           "kv_type %d is not f32 (%d), f16 (%d) or q8_0 (%d)", kv_type,
                           WS_KV_F32, WS_KV_F16, WS_KV_Q8_0);
    if (ws_kv_type_bytes(kv_type, ws_head_dim(hp)) == 0)
        return fail_global(WS_ERR_INVALID_ARGUMENT,
                           "a %s KV cache needs a head_dim that is a multiple of %d; this "
                           "model's is %d", ws_kv_type_name(kv_type), WS_Q8_BLOCK,
                           ws_head_dim(hp));
    return WS_OK;
}

/* rows per slot of a sliding-window layer: a ring of its window plus WS_SWA_SPARE
   spare rows (they let a slot drop its last tokens, a speculative rollback, and still
   continue), or n_ctx when swa_full or when the ring would be no shorter */
static int32_t ring_rows(const ws_hparams *hp, ws_context_params params) {
    if (!params.swa_full && hp->arch == WS_ARCH_GEMMA3 && hp->n_swa > 0 &&
        (int64_t)hp->n_swa + WS_SWA_SPARE < params.n_ctx)
        return hp->n_swa + WS_SWA_SPARE;
    return params.n_ctx;
}

/* rows per slot of layer l: a sliding-window layer its ring, any other n_ctx */
static int32_t layer_rows(const ws_hparams *hp, ws_context_params params, int layer) {
    return ws_layer_is_local(hp, layer) ? ring_rows(hp, params) : params.n_ctx;
}

/* the bytes of the KV cache (K and V, every layer's rows, every slot) of a context of
   these parameters; a double, so that sizes past SIZE_MAX can be refused */
static double kv_cache_bytes(const ws_hparams *hp, ws_context_params params) {
    double rows = 0.0;
    for (int l = 0; l < hp->n_layer; l++) rows += (double)layer_rows(hp, params, l);
    const double row = (double)ws_kv_type_bytes(params.kv_type, ws_head_dim(hp));
    return 2.0 * row * rows * (double)hp->n_head_kv * (double)params.n_slots;
}

ws_status ws_context_kv_bytes_needed(const ws_model *model, ws_context_params params,
                                     uint64_t *out) {
    if (!model || !out)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "ws_context_kv_bytes_needed: NULL argument");
    *out = 0;
    /* sizes ws_context_init refuses with its own message: nothing to allocate */
    if (params.n_ctx < 1 || params.n_slots < 1) return WS_OK;
    TRY(kv_type_check(&model->hp, params.kv_type));
    const double bytes = kv_cache_bytes(&model->hp, params);
    if (!(bytes >= 0.0) || bytes > (double)(SIZE_MAX / 4))
        return fail_global(WS_ERR_OUT_OF_MEMORY, "KV cache of %.0f bytes is too large", bytes);
    *out = (uint64_t)bytes;
    return WS_OK;
}

/*
 * The KV caches are head-major: [slot][layer][KV head][position][head_dim], so the
 * keys (or values) of one KV head are one contiguous run of positions, which the
 * attention loop streams. The state format (ws_slot_state_get) stays position-major
 * per layer ([position][kv_dim]); get and set gather and scatter between the two.
 * The values are kept in the context's kv_type (a head row of kv_row bytes): the
 * address of a head's position is a byte address, read by the attention's loaders of
 * that type.
 */
static uint8_t *kv_head(const ws_context *ctx, void *cache, int slot, int layer, int kvh,
                        int pos) {
    const int cap = ctx->layer_cap[layer];
    const size_t row = (size_t)kvh * (size_t)cap + (size_t)(pos % cap);
    return (uint8_t *)cache +
           ((size_t)slot * ctx->slot_rows + ctx->layer_off[layer] + row) * ctx->kv_row;
}

/* One head's new key or value (hd floats) into the cache: copied, rounded to half, or
   quantized to q8_0 blocks (once: the cache never holds its floats). */
static void kv_store(const ws_context *ctx, uint8_t *dst, const float *v, int hd) {
    if (ctx->params.kv_type == WS_KV_F16)
        ws_fp16_from_fp32(v, (uint16_t *)(void *)dst, (size_t)hd);
    else if (ctx->params.kv_type == WS_KV_Q8_0)
        for (int b = 0; b < hd / WS_Q8_BLOCK; b++)
            q8_quantize_block(v + (size_t)b * WS_Q8_BLOCK, dst + (size_t)b * WS_Q8_BLOCK_BYTES);
    else
        memcpy(dst, v, sizeof(float) * (size_t)hd);
}

/* positions [p0, p0 + n) of one layer of a slot between the cache and a [n][kv_dim]
   buffer of the same element type (the state holds the cache's values as they are) */
static void kv_gather(const ws_context *ctx, void *cache, int slot, int layer, int p0, int n,
                      uint8_t *out) {
    const int nkv = ctx->model->hp.n_head_kv;
    const size_t row = ctx->kv_row;
    for (int h = 0; h < nkv; h++)
        for (int j = 0; j < n; j++)
            memcpy(out + row * ((size_t)j * (size_t)nkv + (size_t)h),
                   kv_head(ctx, cache, slot, layer, h, p0 + j), row);
}

static void kv_scatter(ws_context *ctx, void *cache, int slot, int layer, int p0, int n,
                       const uint8_t *in) {
    const int nkv = ctx->model->hp.n_head_kv;
    const size_t row = ctx->kv_row;
    for (int h = 0; h < nkv; h++)
        for (int j = 0; j < n; j++)
            memcpy(kv_head(ctx, cache, slot, layer, h, p0 + j),
                   in + row * ((size_t)j * (size_t)nkv + (size_t)h), row);
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
    void *owned[] = {ctx->k_cache, ctx->v_cache, ctx->tokens,   ctx->n_past,  ctx->ring_lo,
                     ctx->kstage,  ctx->vstage,  ctx->tok_first, ctx->tok_last, ctx->rows,  ctx->rope_cos,
                     ctx->rope_sin, ctx->rope_cos_swa, ctx->rope_sin_swa, ctx->ybuf,
                     ctx->x,        ctx->xn,      ctx->q,        ctx->att,     ctx->hb,
                     ctx->hb2,      ctx->scores,  ctx->tok_slot, ctx->tok_pos, ctx->kbuf,
                     ctx->vbuf,     ctx->wbuf,    ctx->fin,      ctx->out_rows, ctx};
    for (size_t i = 0; i < sizeof owned / sizeof *owned; i++) free(owned[i]);
}

ws_status ws_context_init(const ws_model *model, ws_context_params params, ws_context **out) {
    if (!out) return fail_global(WS_ERR_INVALID_ARGUMENT, "ws_context_init: out is NULL");
    *out = NULL;
    if (!model) return fail_global(WS_ERR_INVALID_ARGUMENT, "ws_context_init: model is NULL");
    if (params.n_slots < 1 || params.n_slots > WS_MAX_SLOTS)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_slots %d out of range 1..%d",
                           params.n_slots, WS_MAX_SLOTS);
    if (params.n_ctx < 1 || params.n_ctx > (1 << 20))
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_ctx %d out of range 1..1048576",
                           params.n_ctx);
    if (params.n_threads < 1 || params.n_threads > WS_MAX_THREADS)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_threads %d out of range 1..%d",
                           params.n_threads, WS_MAX_THREADS);
    if (params.n_batch < 1 || params.n_batch > 65536)
        return fail_global(WS_ERR_INVALID_ARGUMENT, "n_batch %d out of range 1..65536",
                           params.n_batch);
    const ws_hparams *hp = &model->hp;
    TRY(kv_type_check(hp, params.kv_type));
    ws_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return fail_global(WS_ERR_OUT_OF_MEMORY, "out of memory allocating the context");
    ctx->model = model;
    ctx->params = params;
    ctx->head_dim = ws_head_dim(hp);
    ctx->q_dim = hp->n_head * ctx->head_dim;
    ctx->kv_dim = hp->n_head_kv * ctx->head_dim;
    ctx->n_rot = hp->n_rot;
    ctx->attn_scale = (float)(1.0 / sqrt((double)ctx->head_dim));
    ctx->kv_row = ws_kv_type_bytes(params.kv_type, ctx->head_dim);
    if (params.swa_full != 0 && params.swa_full != 1) {
        free(ctx);
        return fail_global(WS_ERR_INVALID_ARGUMENT, "swa_full %d is not 0 or 1", params.swa_full);
    }
    /* rows per layer: a sliding-window layer its ring, any other n_ctx (the sizes
       ws_context_kv_bytes_needed reports, from the same functions) */
    ctx->n_ring = ring_rows(hp, params);
    double rows_per_slot = 0.0;
    for (int l = 0; l < hp->n_layer; l++) {
        ctx->layer_cap[l] = layer_rows(hp, params, l);
        ctx->has_ring |= ctx->layer_cap[l] < params.n_ctx;
        ctx->layer_off[l] = (size_t)rows_per_slot * (size_t)hp->n_head_kv;
        rows_per_slot += (double)ctx->layer_cap[l];
    }

    /* KV cache size: refuse sizes that overflow or that the machine cannot hold */
    const double kv_bytes = kv_cache_bytes(hp, params);
    if (kv_bytes > (double)(SIZE_MAX / 4)) {
        free(ctx);
        return fail_global(WS_ERR_OUT_OF_MEMORY, "KV cache of %.0f bytes is too large", kv_bytes);
    }
    ctx->slot_rows = (size_t)rows_per_slot * (size_t)hp->n_head_kv;
    int ok = 1;
    const size_t nb = (size_t)params.n_batch;
    const size_t kv_all = ctx->slot_rows * (size_t)params.n_slots; /* head rows */
    /* calloc: the pages of a large cache are committed only when used, unless reserved */
    ctx->k_cache = calloc(kv_all ? kv_all : 1, ctx->kv_row);
    ctx->v_cache = calloc(kv_all ? kv_all : 1, ctx->kv_row);
    ok = ctx->k_cache && ctx->v_cache;
    if (ok && params.reserve_kv) {
        touch_pages(ctx->k_cache, kv_all * ctx->kv_row);
        touch_pages(ctx->v_cache, kv_all * ctx->kv_row);
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
    /* staging rows (floats: room for any KV type) only for a model with local layers */
    const size_t n_stage = hp->arch == WS_ARCH_GEMMA3 && hp->n_swa > 0 ? nb * (size_t)ctx->kv_dim
                                                                       : 1;
    ctx->kstage = alloc_floats(n_stage, &ok);
    ctx->vstage = alloc_floats(n_stage, &ok);
    ctx->vbuf = alloc_floats(nb * (size_t)ctx->kv_dim, &ok);
    ctx->wbuf_cols = hp->n_embd > hp->n_ff ? hp->n_embd : hp->n_ff;
    if (ctx->q_dim > ctx->wbuf_cols) ctx->wbuf_cols = ctx->q_dim;
    const int is_head = model->w.fc.data != NULL;
    if (is_head && 2 * hp->n_embd > ctx->wbuf_cols) ctx->wbuf_cols = 2 * hp->n_embd;
    ctx->fin = alloc_floats(is_head ? nb * 2 * (size_t)hp->n_embd : 1, &ok);
    ctx->n_tok = model->w.tok_embd.rows;
    ctx->wbuf = alloc_floats((size_t)params.n_threads * (WS_MATMUL_SCRATCH_BYTES(ctx->wbuf_cols) /
                                                         sizeof(float)), &ok);
    if (ok) {
        ctx->tokens = calloc((size_t)params.n_slots * (size_t)params.n_ctx, sizeof(int32_t));
        ctx->n_past = calloc((size_t)params.n_slots, sizeof(int32_t));
        ctx->tok_slot = calloc(nb, sizeof(int32_t));
        ctx->tok_pos = calloc(nb, sizeof(int32_t));
        ctx->out_rows = calloc(nb, sizeof(int32_t));
        ctx->ring_lo = calloc((size_t)params.n_slots, sizeof(int32_t));
        ctx->tok_first = calloc(nb, sizeof(int32_t));
        ctx->tok_last = calloc(nb, sizeof(int32_t));
        ctx->rows = calloc((size_t)params.n_threads * 2 * (size_t)params.n_ctx,
                           sizeof(const uint8_t *));
        ok = ctx->tokens && ctx->n_past && ctx->tok_slot && ctx->tok_pos && ctx->ring_lo &&
             ctx->out_rows &&
             ctx->tok_first && ctx->tok_last && ctx->rows;
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

/* The KV readers take the row's type KVT (ws_kv_type, a constant at each call site)
   and give every value as the same float in every build: an f32 as it is, a half's
   exact value, a q8_0 value's exact d * q. The attention's arithmetic after them is
   the f32 path's. */

/* the q8_0 block of value i of a row */
static inline const uint8_t *q8_block(const uint8_t *base, size_t i) {
    return base + (i / WS_Q8_BLOCK) * WS_Q8_BLOCK_BYTES;
}

/* element i of a KV row as floats: 8 at a time (i % 8 == 0), or one */
static inline lanes8 kv_l8(const uint8_t *base, size_t i, const int KVT) {
    if (KVT == WS_KV_Q8_0) {
        const uint8_t *b = q8_block(base, i);
        return l8_load_q8(b, (int)(i % WS_Q8_BLOCK), q8_scale(b));
    }
    return KVT == WS_KV_F16 ? l8_load_h((const uint16_t *)(const void *)base + i)
                            : l8_load((const float *)(const void *)base + i);
}

static inline float kv_at(const uint8_t *base, size_t i, const int KVT) {
    if (KVT == WS_KV_Q8_0) {
        const uint8_t *b = q8_block(base, i);
        return (float)(int8_t)b[2 + i % WS_Q8_BLOCK] * q8_scale(b);
    }
    return KVT == WS_KV_F16 ? float_from_half(((const uint16_t *)(const void *)base)[i])
                            : ((const float *)(const void *)base)[i];
}

/* dot(q, key) over the n values of a key row: the `dot` sequence */
static inline float dot_kv(const float *q, const uint8_t *key, int n, const int KVT) {
    if (KVT == WS_KV_F32) return dot(q, (const float *)(const void *)key, n);
    const int n8 = n & ~7;
    lanes8 a = l8_zero();
    for (int k = 0; k < n8; k += 8) a = l8_fma(l8_load(q + k), kv_l8(key, (size_t)k, KVT), a);
    float acc = l8_sum(a);
    for (int k = n8; k < n; k++) acc = fmaf(q[k], kv_at(key, (size_t)k, KVT), acc);
    return acc;
}

/* WS_LANES elements of a KV row from element i (i % WS_LANES == 0), as floats */
static inline lanes kv_lanes(const uint8_t *base, size_t i, const int KVT) {
    if (KVT == WS_KV_Q8_0) {
        const uint8_t *b = q8_block(base, i);
        return ln_load_q8(b, (int)(i % WS_Q8_BLOCK), q8_scale(b));
    }
    return KVT == WS_KV_F16 ? ln_load_h((const uint16_t *)(const void *)base + i)
                            : ln_load((const float *)(const void *)base + i);
}

/* out[h][d .. d + NV * WS_LANES) of the NH heads: out = sum over the n positions j of
   sc[h][j] * vrow[j][..], one fmaf chain per element in j order from zero; each value
   row's NV vectors are loaded once for the heads. NH, NV (1..4) and KVT are constants
   at each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
attend_values(float *const *out, float *const *sc, const uint8_t *const *vrow, int n, int d,
              const int NH, const int NV, const int KVT) {
    lanes o[WS_ATT_GROUP][4];
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < NV; i++) o[h][i] = ln_zero();
    for (int j = 0; j < n; j++) {
        lanes v[4];
        for (int i = 0; i < NV; i++)
            v[i] = kv_lanes(vrow[j], (size_t)d + (size_t)(WS_LANES * i), KVT);
        for (int h = 0; h < NH; h++) {
            const lanes w = ln_set1(sc[h][j]);
            for (int i = 0; i < NV; i++) o[h][i] = ln_fma(w, v[i], o[h][i]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < NV; i++) ln_store(out[h] + d + WS_LANES * i, o[h][i]);
}

/*
 * Attention of NH query heads (h0, h0+1, ...) of one token that share one KV head,
 * over n positions whose key and value rows are kr[j] and vr[j] (in position order,
 * wherever each row lives: the cache, a ring, the chunk's staging rows): the keys and
 * values are read once for the group. Every score and output element is the same sequence of operations as for
 * a head alone: score = (the `dot` sequence over the head dimension) * scale; the
 * softmax as below; out[d] = fmaf chain over positions in order. NH is a constant
 * at each call site (1..WS_ATT_GROUP), so the loops over heads unroll into
 * registers. KVT (a constant too) is the cache's type: its values are read as exact
 * floats (kv_l8) before the same arithmetic, so the bits do not depend on the build.
 */
static inline __attribute__((always_inline)) void
attend_group(ws_context *ctx, int ith, const uint8_t *const *krow, const uint8_t *const *vrow,
             int n, int t, int h0, const int NH, const int KVT) {
    const int hd = ctx->head_dim;
    const float *q[WS_ATT_GROUP];
    float *out[WS_ATT_GROUP], *sc[WS_ATT_GROUP];
    for (int h = 0; h < NH; h++) {
        q[h] = ctx->q + (size_t)t * ctx->q_dim + (size_t)(h0 + h) * hd;
        out[h] = ctx->att + (size_t)t * ctx->q_dim + (size_t)(h0 + h) * hd;
        sc[h] = ctx->scores + ((size_t)ith * WS_ATT_GROUP + (size_t)h) * ctx->params.n_ctx;
    }
    const float scale = ctx->attn_scale;
    const int n8 = n & ~7;
    float mx[WS_ATT_GROUP];
    for (int h = 0; h < NH; h++) mx[h] = -INFINITY;
    int j = 0;
    if ((hd & 7) == 0) {
        /* four keys at a time, each loaded once for the heads of the group */
        for (; j + 4 <= n; j += 4) {
            const uint8_t *kr[4] = {krow[j], krow[j + 1], krow[j + 2], krow[j + 3]};
            lanes8 a[WS_ATT_GROUP][4];
            for (int h = 0; h < NH; h++)
                for (int i = 0; i < 4; i++) a[h][i] = l8_zero();
            if (KVT == WS_KV_Q8_0) {
                /* a block's scale read once per key: the same values as kv_l8, 8 at a
                   time in d order */
                for (int d0 = 0; d0 < hd; d0 += WS_Q8_BLOCK) {
                    const uint8_t *bk[4];
                    float ds[4];
                    for (int i = 0; i < 4; i++) {
                        bk[i] = q8_block(kr[i], (size_t)d0);
                        ds[i] = q8_scale(bk[i]);
                    }
                    for (int u = 0; u < WS_Q8_BLOCK; u += 8) {
                        lanes8 kv[4];
                        for (int i = 0; i < 4; i++) kv[i] = l8_load_q8(bk[i], u, ds[i]);
                        for (int h = 0; h < NH; h++) {
                            const lanes8 qv = l8_load(q[h] + d0 + u);
                            for (int i = 0; i < 4; i++) a[h][i] = l8_fma(qv, kv[i], a[h][i]);
                        }
                    }
                }
            } else {
                for (int d = 0; d < hd; d += 8) {
                    lanes8 kv[4];
                    for (int i = 0; i < 4; i++) kv[i] = kv_l8(kr[i], (size_t)d, KVT);
                    for (int h = 0; h < NH; h++) {
                        const lanes8 qv = l8_load(q[h] + d);
                        for (int i = 0; i < 4; i++) a[h][i] = l8_fma(qv, kv[i], a[h][i]);
                    }
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
            const float sv = dot_kv(q[h], krow[j], hd, KVT) * scale;
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
    /* out[d] = sum over j of w_j * v_j[d], accumulated in j order with fmaf: four
       vectors of the widest lanes at a time (with 16 lanes, then two for a rest of 32
       dimensions), then 8, then one (every lane its own chain: the bits do not depend
       on the width) */
    int d = 0;
    for (; d + 4 * WS_LANES <= hd; d += 4 * WS_LANES)
        attend_values(out, sc, vrow, n, d, NH, 4, KVT);
    if (WS_LANES > 8 && d + 32 <= hd) {
        attend_values(out, sc, vrow, n, d, NH, 32 / WS_LANES, KVT);
        d += 32;
    }
    for (; d + 8 <= hd; d += 8)
        for (int h = 0; h < NH; h++) {
            lanes8 o = l8_zero();
            for (j = 0; j < n; j++)
                o = l8_fma(l8_set1(sc[h][j]), kv_l8(vrow[j], (size_t)d, KVT), o);
            l8_store(out[h] + d, o);
        }
    for (; d < hd; d++)
        for (int h = 0; h < NH; h++) {
            float o = 0.0f;
            for (j = 0; j < n; j++)
                o = fmaf(sc[h][j], kv_at(vrow[j], (size_t)d, KVT), o);
            out[h][d] = o;
        }
}

/* row of KV head kvh of the chunk's token t in a staging buffer */
static const uint8_t *stage_row(const ws_context *ctx, const void *stage, int t, int kvh) {
    return (const uint8_t *)stage +
           ((size_t)t * (size_t)ctx->model->hp.n_head_kv + (size_t)kvh) * ctx->kv_row;
}

/* query heads [h, he) of one token, all of one KV head, over the n key and value rows
   kr, vr, in groups of at most WS_ATT_GROUP */
static inline __attribute__((always_inline)) void
attend_heads(ws_context *ctx, int ith, const uint8_t *const *kr, const uint8_t *const *vr, int n,
             int t, int h, int he, const int KVT) {
    while (h < he) {
        const int k = he - h < WS_ATT_GROUP ? he - h : WS_ATT_GROUP;
        switch (k) {
        case 1: attend_group(ctx, ith, kr, vr, n, t, h, 1, KVT); break;
#if WS_ATT_GROUP >= 4
        case 3: attend_group(ctx, ith, kr, vr, n, t, h, 3, KVT); break;
        case 4: attend_group(ctx, ith, kr, vr, n, t, h, 4, KVT); break;
#endif
        default: attend_group(ctx, ith, kr, vr, n, t, h, 2, KVT); break;
        }
        h += k;
    }
}

/* the key and value rows of KV head kvh that token t of the chunk attends to, in
   position order, into kr, vr; their count. A local layer attends to positions
   pos - n_swa + 1 .. pos only; its positions of this chunk are in the staging rows
   (the token of position q is t - (pos - q)), the older ones in its ring. */
static int attend_rows(ws_context *ctx, int slot, int layer, int pos, int t, int kvh,
                       const uint8_t **kr, const uint8_t **vr) {
    const ws_hparams *hp = &ctx->model->hp;
    const int local = ws_layer_is_local(hp, layer);
    const int lo = local && pos >= hp->n_swa ? pos - hp->n_swa + 1 : 0;
    const int n = pos + 1 - lo;
    const int staged = local ? ctx->tok_first[t] : pos + 1; /* first staged position */
    int j = 0;
    if (staged > lo) {
        /* one KV head's rows are consecutive up to the end of the layer's rows */
        const int cap = ctx->layer_cap[layer];
        const size_t step = ctx->kv_row;
        const int end = staged < pos + 1 ? staged : pos + 1;
        for (int p = lo; p < end;) {
            const uint8_t *k = kv_head(ctx, ctx->k_cache, slot, layer, kvh, p);
            const uint8_t *v = kv_head(ctx, ctx->v_cache, slot, layer, kvh, p);
            const int run_end = end < p - p % cap + cap ? end : p - p % cap + cap;
            for (; p < run_end; p++, j++, k += step, v += step) {
                kr[j] = k;
                vr[j] = v;
            }
        }
    }
    for (; j < n; j++) {
        const int p = lo + j, tq = t - (pos - p);
        kr[j] = stage_row(ctx, ctx->kstage, tq, kvh);
        vr[j] = stage_row(ctx, ctx->vstage, tq, kvh);
    }
    return n;
}

/* attention of query heads [h, he) of one token (any KV heads): for each KV head its
   rows once, then its query heads in groups */
static void attend(ws_context *ctx, int ith, int slot, int layer, int pos, int t, int h,
                   int he) {
    const ws_hparams *hp = &ctx->model->hp;
    const int rep = hp->n_head / hp->n_head_kv;
    const uint8_t **kr = ctx->rows + (size_t)ith * 2 * (size_t)ctx->params.n_ctx; /* [n] */
    const uint8_t **vr = kr + ctx->params.n_ctx;                                   /* [n] */
    while (h < he) {
        const int kvh = h / rep;
        const int ge = (kvh + 1) * rep < he ? (kvh + 1) * rep : he; /* this KV head's */
        const int n = attend_rows(ctx, slot, layer, pos, t, kvh, kr, vr);
        switch (ctx->params.kv_type) {
        case WS_KV_F16: attend_heads(ctx, ith, kr, vr, n, t, h, ge, WS_KV_F16); break;
        case WS_KV_Q8_0: attend_heads(ctx, ith, kr, vr, n, t, h, ge, WS_KV_Q8_0); break;
        default: attend_heads(ctx, ith, kr, vr, n, t, h, ge, WS_KV_F32); break;
        }
        h = ge;
    }
}

/* A local layer's staged keys and values of this thread's share of the chunk's tokens
   into its ring, once the chunk's attention is done: the positions among the last
   layer_cap of their slot's run in the chunk (earlier ones would be overwritten by
   later ones of the same chunk). */
static void ring_commit(ws_context *ctx, int layer, int ith, int nth, int nt) {
    const int nkv = ctx->model->hp.n_head_kv, cap = ctx->layer_cap[layer];
    const size_t row = ctx->kv_row;
    int a, b;
    split_range(nt, ith, nth, 1, &a, &b);
    for (int t = a; t < b; t++) {
        const int pos = ctx->tok_pos[t];
        if (pos <= ctx->tok_last[t] - cap) continue;
        for (int h = 0; h < nkv; h++) {
            memcpy(kv_head(ctx, ctx->k_cache, ctx->tok_slot[t], layer, h, pos),
                   stage_row(ctx, ctx->kstage, t, h), row);
            memcpy(kv_head(ctx, ctx->v_cache, ctx->tok_slot[t], layer, h, pos),
                   stage_row(ctx, ctx->vstage, t, h), row);
        }
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

/* the residual stream x += w . in for this thread's share of the rows (in: [nt][n_in]);
   gemma3 normalises w . in by post_norm first (through ybuf, a barrier between) */
static void add_projection(ws_context *ctx, const ws_tensor *w, const float *in, int n_in,
                           const float *post_norm, int ith, int nth, int nt, float *wbuf) {
    const int E = ctx->model->hp.n_embd;
    int a, b;
    split_range(E, ith, nth, 4, &a, &b);
    if (post_norm) {
        ws_matmul(ctx->ybuf, E, w, in, n_in, a, b, nt, 0, wbuf);
        pool_barrier(&ctx->pool);
        add_normed(ctx, post_norm, ith, nth, nt);
    } else {
        ws_matmul(ctx->x, E, w, in, n_in, a, b, nt, 1, wbuf);
    }
    pool_barrier(&ctx->pool);
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
    float *wbuf = ctx->wbuf + (size_t)ith * (WS_MATMUL_SCRATCH_BYTES(ctx->wbuf_cols) / sizeof(float));
    const int n_units = hp->n_head + 2 * hp->n_head_kv;

    const int gemma = hp->arch == WS_ARCH_GEMMA3;
    if (m->w.fc.data) {
        /* a feature head's input: x = fc . concat(embedding, feature), split by rows */
        split_range(E, ith, nth, 4, &a, &b);
        ws_matmul(ctx->x, E, &m->w.fc, ctx->fin, 2 * E, a, b, nt, 0, wbuf);
        pool_barrier(pool);
    }
    const int kv_only = ctx->job.kv_only;
    for (int l = 0; l < hp->n_layer; l++) {
        const ws_layer_weights *L = &m->w.layers[l];
        const int local = ws_layer_is_local(hp, l);
        const float *rcos = local ? ctx->rope_cos_swa : ctx->rope_cos;
        const float *rsin = local ? ctx->rope_sin_swa : ctx->rope_sin;

        rmsnorm_rows(xn, ctx->x, L->attn_norm, E, hp->rms_eps, 0, nt);

        /* q, k, v projections split by whole heads, so each thread turns (RoPE)
           the q and k heads it computed without waiting for the others */
        /* the last layer of a keys-and-values-only pass skips its queries */
        const int last_kv = kv_only && l == hp->n_layer - 1;
        split_range(last_kv ? 2 * hp->n_head_kv : n_units, ith, nth, 1, &a, &b);
        if (last_kv) {
            a += hp->n_head;
            b += hp->n_head;
        }
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
                if (is_q) continue;
                /* this head of the token's key / value into its slot's cache (a local
                   layer: into the staging rows, the ring follows after the attention) */
                if (local)
                    kv_store(ctx, (uint8_t *)stage_row(ctx, is_k ? ctx->kstage : ctx->vstage, t,
                                                       h), v, hd);
                else
                    kv_store(ctx, kv_head(ctx, is_k ? ctx->k_cache : ctx->v_cache, tslot[t], l,
                                          h, tpos[t]), v, hd);
            }
        }
        pool_barrier(pool);
        if (last_kv) {
            if (local) ring_commit(ctx, l, ith, nth, nt);
            if (local) pool_barrier(pool);
            return; /* the keys and values are stored: nothing else was asked */
        }

        /* attention. A chunk of many tokens (a prefill) deals its tokens out in turn, so
           that the threads share its later tokens' longer contexts alike (contiguous
           halves would give one thread three quarters of a causal prefill's work). A few
           tokens (decode, verification): one task per (token, query head), split evenly
           over the threads, a thread's consecutive heads of one token and KV head run
           together. Which thread runs a task does not change its arithmetic. */
        if (nt >= 4 * nth) {
            for (int t = ith; t < nt; t += nth)
                attend(ctx, ith, tslot[t], l, tpos[t], t, 0, hp->n_head);
        } else {
            split_range(nt * hp->n_head, ith, nth, 1, &a, &b);
            for (int i = a; i < b;) {
                const int t = i / hp->n_head, h = i % hp->n_head;
                const int he = b - i < hp->n_head - h ? h + (b - i) : hp->n_head;
                attend(ctx, ith, tslot[t], l, tpos[t], t, h, he);
                i += he - h;
            }
        }
        pool_barrier(pool);
        if (local) ring_commit(ctx, l, ith, nth, nt);

        /* output projection added to the residual stream (gemma3: its post-norm first) */
        add_projection(ctx, &L->wo, ctx->att, Q, gemma ? L->post_attn_norm : NULL, ith, nth, nt,
                       wbuf);

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

        add_projection(ctx, &L->w_down, ctx->hb, F, gemma ? L->post_ffn_norm : NULL, ith, nth, nt,
                       wbuf);
    }

    /* the hidden states (the residual stream before output_norm): the caller's copy,
       by the caller's thread (nothing writes x any more) */
    if (ith == 0 && ctx->job.hidden)
        memcpy(ctx->job.hidden, ctx->x, sizeof(float) * (size_t)nt * (size_t)E);
    /* final norm and logits of the wanted tokens: t0 .. t0 + on, or the listed ones
       packed into the first rows of xn (each row's products do not depend on where
       it sits) */
    if (on > 0) {
        const float *xin;
        if (ctx->job.rows_listed) {
            for (int i = 0; i < on; i++)
                rmsnorm_rows(xn + (size_t)i * E, ctx->x + (size_t)ctx->out_rows[i] * E,
                             m->w.output_norm, E, hp->rms_eps, 0, 1);
            xin = xn;
        } else {
            rmsnorm_rows(xn + (size_t)t0 * E, ctx->x + (size_t)t0 * E, m->w.output_norm, E,
                         hp->rms_eps, 0, on);
            xin = xn + (size_t)t0 * E;
        }
        const ws_tensor *wout = m->w.output.data ? &m->w.output : &m->w.tok_embd;
        split_range(hp->n_vocab, ith, nth, 4, &a, &b);
        ws_matmul(logits, hp->n_vocab, wout, xin, E, a, b, on, 0, wbuf);
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

/* an accessor's arguments: the handle and its output are set, the slot exists */
static ws_status check_slot_out(const ws_context *ctx, int32_t slot, const void *out) {
    if (!ctx || !out) return WS_ERR_INVALID_ARGUMENT;
    return check_slot(ctx, slot);
}

ws_status ws_slot_n_tokens(const ws_context *ctx, int32_t slot, int32_t *n_out) {
    TRY(check_slot_out(ctx, slot, n_out));
    *n_out = ctx->n_past[slot];
    return WS_OK;
}

ws_status ws_slot_tokens(const ws_context *ctx, int32_t slot, int32_t *out, size_t cap,
                         int32_t *n_out) {
    if (!ctx || !n_out || (!out && cap > 0)) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(ctx, slot));
    const int32_t n = ctx->n_past[slot];
    *n_out = n;
    if (cap < (size_t)n)
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL, "token buffer holds %zu, slot has %d", cap,
                        n);
    memcpy(out, ctx->tokens + (size_t)slot * ctx->params.n_ctx, sizeof(int32_t) * (size_t)n);
    return WS_OK;
}

static int32_t keep_min(const ws_context *ctx, int32_t slot) {
    const int32_t lo = ctx->ring_lo[slot];
    return lo == 0 ? 0 : lo + ctx->model->hp.n_swa - 1;
}

/* after a slot grew: a ring of R rows now holds its last R positions only */
static void ring_advance(ws_context *ctx, int32_t slot) {
    const int32_t gone = ctx->n_past[slot] - ctx->n_ring;
    if (ctx->has_ring && gone > ctx->ring_lo[slot]) ctx->ring_lo[slot] = gone;
}

/* the rings hold the window of the slot's next position (kept so by truncate and
   state set; checked again before a decode writes anything) */
static ws_status check_window(const ws_context *ctx, int32_t slot) {
    const int32_t n = ctx->n_past[slot];
    if (n > 0 && n < keep_min(ctx, slot))
        return fail_ctx(ctx, WS_ERR_BAD_STATE,
                        "slot %d: the window of position %d is no longer in its rings", slot, n);
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
    TRY(check_slot(ctx, slot));
    const ws_hparams *hp = &ctx->model->hp;
    if (!tokens || n_tokens <= 0)
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT, "decode needs at least one token (got %d)",
                        n_tokens);
    const int32_t n_past = ctx->n_past[slot];
    TRY(check_window(ctx, slot));
    if ((int64_t)n_past + n_tokens > ctx->params.n_ctx)
        return fail_ctx(ctx, WS_ERR_CONTEXT_FULL,
                        "slot %d holds %d tokens; %d more exceed its context of %d", slot, n_past,
                        n_tokens, ctx->params.n_ctx);
    if (ws_context_is_head(ctx))
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                        "a feature head decodes tokens paired with features (ws_decode_ex)");
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
            ctx->tok_first[t] = n_past + done;
            ctx->tok_last[t] = n_past + done + nt - 1;
        }
        ctx->job.nt = nt;
        ctx->job.rows_listed = 0;
        ctx->job.hidden = NULL;
        ctx->job.kv_only = 0;
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
    ring_advance(ctx, slot);
    return WS_OK;
}

ws_status ws_decode_ex(ws_context *ctx, int32_t n_seq, const int32_t *slots,
                       const int32_t *n_tokens, const int32_t *tokens, const ws_decode_io *io) {
    if (!ctx) return WS_ERR_INVALID_ARGUMENT;
    const ws_hparams *hp = &ctx->model->hp;
    if (!slots || !n_tokens || !tokens || !io || n_seq <= 0 || n_seq > ctx->params.n_slots)
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                        "a batch decode takes 1..%d slots (got %d)", ctx->params.n_slots, n_seq);
    int64_t total = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        ws_status st = check_slot(ctx, slots[i]);
        if (st != WS_OK) return st;
        for (int32_t j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                                "slot %d appears twice in a multi-slot decode", slots[i]);
        TRY(check_window(ctx, slots[i]));
        if (n_tokens[i] < 1 || n_tokens[i] > ctx->params.n_ctx)
            return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                            "slot %d: a batch decode takes 1..%d tokens per slot (got %d)",
                            slots[i], ctx->params.n_ctx, n_tokens[i]);
        if ((int64_t)ctx->n_past[slots[i]] + n_tokens[i] > ctx->params.n_ctx)
            return fail_ctx(ctx, WS_ERR_CONTEXT_FULL,
                            "slot %d is full: it holds %d tokens, %d more exceed its context of %d",
                            slots[i], ctx->n_past[slots[i]], n_tokens[i], ctx->params.n_ctx);
        total += n_tokens[i];
    }
    for (int64_t t = 0; t < total; t++)
        if (tokens[t] < 0 || tokens[t] >= ctx->n_tok)
            return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                            "token %d at index %lld is outside the vocabulary 0..%d", tokens[t],
                            (long long)t, ctx->n_tok - 1);
    const int E = hp->n_embd;
    const int head = ws_context_is_head(ctx);
    if (head != (io->features != NULL))
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                        head ? "a feature head decodes tokens paired with features"
                             : "a language model takes no features");
    if (head && io->features_cap < (size_t)total * (size_t)E)
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL,
                        "features buffer holds %zu floats, %zu are needed", io->features_cap,
                        (size_t)total * (size_t)E);
    int64_t n_want = 0;
    const int want_logits = !(io->logits == NULL && io->logits_cap == 0);
    if (want_logits) {
        if (!io->want) n_want = total;
        else
            for (int64_t t = 0; t < total; t++) n_want += io->want[t] != 0;
    }
    const size_t need = (size_t)n_want * (size_t)hp->n_vocab;
    if (want_logits && (!io->logits || io->logits_cap < need))
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL,
                        "logits buffer holds %zu floats, %zu are needed", io->logits_cap, need);
    const int want_hidden = !(io->hidden == NULL && io->hidden_cap == 0);
    if (want_hidden && (!io->hidden || io->hidden_cap < (size_t)total * (size_t)E))
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL,
                        "hidden buffer holds %zu floats, %zu are needed", io->hidden_cap,
                        (size_t)total * (size_t)E);
    if (io->kv_only && (want_logits || want_hidden))
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                        "a keys-and-values-only decode computes no logits or hidden states");
    /* chunks of at most n_batch tokens; a slot's tokens stay in order, so a token in a
       later chunk attends to the keys and values an earlier chunk stored */
    int32_t seq = 0, in_seq = 0;
    size_t rows_done = 0; /* logits rows written by earlier chunks */
    for (int64_t done = 0; done < total;) {
        int nt = (int)(total - done < ctx->params.n_batch ? total - done : ctx->params.n_batch);
        int on = 0;
        for (int t = 0; t < nt; t++) {
            while (in_seq == n_tokens[seq]) {
                seq++;
                in_seq = 0;
            }
            if (head) {
                float *in = ctx->fin + (size_t)t * 2 * (size_t)E;
                embed(ctx, tokens[done + t], in);
                memcpy(in + E, io->features + (size_t)(done + t) * (size_t)E,
                       sizeof(float) * (size_t)E);
            } else {
                embed(ctx, tokens[done + t], ctx->x + (size_t)t * E);
            }
            ctx->tok_slot[t] = slots[seq];
            ctx->tok_pos[t] = ctx->n_past[slots[seq]] + in_seq;
            if (want_logits && (!io->want || io->want[done + t])) ctx->out_rows[on++] = t;
            in_seq++;
        }
        /* a local layer's attention reads the chunk's own positions of a slot from its
           staging rows: the first and last position of each slot's run in this chunk */
        for (int t = 0, r0 = 0; t <= nt; t++) {
            if (t < nt && ctx->tok_slot[t] == ctx->tok_slot[r0]) continue;
            for (int u = r0; u < t; u++) {
                ctx->tok_first[u] = ctx->tok_pos[r0];
                ctx->tok_last[u] = ctx->tok_pos[t - 1];
            }
            r0 = t;
        }
        ctx->job.nt = nt;
        ctx->job.out_t0 = 0;
        ctx->job.out_nt = on;
        ctx->job.rows_listed = io->want != NULL;
        ctx->job.logits = on ? io->logits + rows_done * (size_t)hp->n_vocab : NULL;
        ctx->job.hidden = want_hidden ? io->hidden + (size_t)done * (size_t)E : NULL;
        ctx->job.kv_only = io->kv_only != 0;
        run_chunk(ctx);
        rows_done += (size_t)on;
        done += nt;
    }
    const int32_t *tk = tokens;
    for (int32_t i = 0; i < n_seq; i++) {
        const int32_t sl = slots[i];
        memcpy(ctx->tokens + (size_t)sl * ctx->params.n_ctx + ctx->n_past[sl], tk,
               sizeof(int32_t) * (size_t)n_tokens[i]);
        ctx->n_past[sl] += n_tokens[i];
        ring_advance(ctx, sl);
        tk += n_tokens[i];
    }
    return WS_OK;
}

ws_status ws_decode_batch(ws_context *ctx, int32_t n_seq, const int32_t *slots,
                          const int32_t *n_tokens, const int32_t *tokens, float *logits,
                          size_t logits_cap) {
    if (!ctx) return WS_ERR_INVALID_ARGUMENT;
    if (!logits)
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL, "a batch decode writes every token's logits");
    const ws_decode_io io = {.logits = logits, .logits_cap = logits_cap};
    return ws_decode_ex(ctx, n_seq, slots, n_tokens, tokens, &io);
}

ws_status ws_decode_multi(ws_context *ctx, const int32_t *slots, const int32_t *tokens,
                          int32_t n, float *logits, size_t logits_cap) {
    if (!ctx) return WS_ERR_INVALID_ARGUMENT;
    if (!slots || !tokens || n <= 0 || n > ctx->params.n_slots)
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                        "a multi-slot decode takes 1..%d tokens (got %d)", ctx->params.n_slots, n);
    int32_t ones[WS_MAX_SLOTS]; /* n <= n_slots <= WS_MAX_SLOTS */
    for (int32_t i = 0; i < n; i++) ones[i] = 1;
    return ws_decode_batch(ctx, n, slots, ones, tokens, logits, logits_cap);
}

ws_status ws_slot_keep_min(const ws_context *ctx, int32_t slot, int32_t *n_out) {
    if (!ctx || !n_out) return WS_ERR_INVALID_ARGUMENT;
    ws_status st = check_slot(ctx, slot);
    if (st != WS_OK) return st;
    *n_out = keep_min(ctx, slot);
    return WS_OK;
}

ws_status ws_slot_truncate(ws_context *ctx, int32_t slot, int32_t n) {
    if (!ctx) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(ctx, slot));
    if (n < 0 || n > ctx->n_past[slot])
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT, "cannot truncate slot %d of %d tokens to %d",
                        slot, ctx->n_past[slot], n);
    if (n > 0 && n < keep_min(ctx, slot))
        return fail_ctx(ctx, WS_ERR_INVALID_ARGUMENT,
                        "cannot truncate slot %d to %d tokens: its sliding-window layers hold "
                        "positions from %d only, the window of position %d starts before; keep "
                        "0 or at least %d", slot, n, ctx->ring_lo[slot], n, keep_min(ctx, slot));
    ctx->n_past[slot] = n;
    if (n == 0) ctx->ring_lo[slot] = 0;
    return WS_OK;
}

ws_status ws_slot_clear(ws_context *ctx, int32_t slot) { return ws_slot_truncate(ctx, slot, 0); }

/* ------------------------------------------------------------------------- */
/* slot state                                                                  */

/* positions a state stores for layer l: n_tokens, or n_window for a local layer */
static size_t state_layer_rows(const ws_context *ctx, int l, size_t n_tokens, size_t n_window) {
    return ws_layer_is_local(&ctx->model->hp, l) ? n_window : n_tokens;
}

/* bytes of the KV part of a state */
static size_t state_kv_bytes(const ws_context *ctx, size_t n_tokens, size_t n_window) {
    size_t rows = 0;
    for (int l = 0; l < ctx->model->hp.n_layer; l++)
        rows += state_layer_rows(ctx, l, n_tokens, n_window);
    return 2 * ctx->kv_row * rows * (size_t)ctx->model->hp.n_head_kv;
}

static size_t state_bytes(const ws_context *ctx, size_t n_tokens, size_t n_window) {
    return WS_STATE_HEADER_BYTES + sizeof(int32_t) * n_tokens +
           state_kv_bytes(ctx, n_tokens, n_window);
}

/* positions the slot's sliding-window layers still hold: its last n_past - ring_lo */
static size_t slot_window(const ws_context *ctx, int32_t slot) {
    return (size_t)(ctx->n_past[slot] - ctx->ring_lo[slot]);
}

static int kv_type_name_known(uint32_t t) {
    return t <= (uint32_t)INT32_MAX && ws_kv_type_name((int32_t)t) != NULL;
}

static const char *kv_type_name(uint32_t t) {
    const char *name = t <= (uint32_t)INT32_MAX ? ws_kv_type_name((int32_t)t) : NULL;
    return name ? name : "unknown";
}

static void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

ws_status ws_slot_state_size(const ws_context *ctx, int32_t slot, size_t *size_out) {
    TRY(check_slot_out(ctx, slot, size_out));
    *size_out = state_bytes(ctx, (size_t)ctx->n_past[slot], slot_window(ctx, slot));
    return WS_OK;
}

ws_status ws_slot_state_get(const ws_context *ctx, int32_t slot, uint8_t *buf, size_t cap,
                            size_t *written_out) {
    if (!ctx || !written_out) return WS_ERR_INVALID_ARGUMENT;
    *written_out = 0;
    TRY(check_slot(ctx, slot));
    const size_t n = (size_t)ctx->n_past[slot], nw = slot_window(ctx, slot);
    const size_t need = state_bytes(ctx, n, nw);
    if (!buf || cap < need)
        return fail_ctx(ctx, WS_ERR_BUFFER_TOO_SMALL, "state buffer holds %zu bytes, %zu needed",
                        cap, need);
    const ws_hparams *hp = &ctx->model->hp;
    uint8_t *p = buf;
    put_u32(p + 0, WS_STATE_MAGIC);
    put_u32(p + 4, nw < n ? 3u : 2u); /* version 2: every layer holds every position */
    put_u32(p + 8, (uint32_t)hp->n_layer);
    put_u32(p + 12, (uint32_t)ctx->kv_dim);
    put_u32(p + 16, (uint32_t)ctx->kv_dim);
    put_u32(p + 20, (uint32_t)ctx->params.kv_type);
    put_u32(p + 24, (uint32_t)n);
    put_u32(p + 28, nw < n ? (uint32_t)nw : 0u);
    p += WS_STATE_HEADER_BYTES;
    memcpy(p, ctx->tokens + (size_t)slot * ctx->params.n_ctx, sizeof(int32_t) * n);
    p += sizeof(int32_t) * n;
    for (int l = 0; l < hp->n_layer; l++) {
        const size_t rows = state_layer_rows(ctx, l, n, nw);
        const size_t bytes = ctx->kv_row * rows * (size_t)hp->n_head_kv;
        kv_gather(ctx, ctx->k_cache, slot, l, (int)(n - rows), (int)rows, p);
        p += bytes;
        kv_gather(ctx, ctx->v_cache, slot, l, (int)(n - rows), (int)rows, p);
        p += bytes;
    }
    *written_out = need;
    return WS_OK;
}

/* Checks a state header against the context; *n_out: its token count, *nw_out: the
   positions its sliding-window layers hold. */
static ws_status state_header_check(ws_context *ctx, const uint8_t *buf, size_t len,
                                    uint32_t *n_out, uint32_t *nw_out) {
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
    /* version 1 knew f32 only; word 7 is reserved (0) before version 3 */
    if ((dtype != WS_KV_F32 && (version < 2 || !kv_type_name_known(dtype))) ||
        (version < 3 && get_u32(buf + 28) != 0u))
        return fail_ctx(ctx, WS_ERR_BAD_STATE,
                        "state dtype %u / reserved %u not supported by state version %u", dtype,
                        get_u32(buf + 28), version);
    if (dtype != (uint32_t)ctx->params.kv_type)
        return fail_ctx(ctx, WS_ERR_BAD_STATE,
                        "state holds %s %s KV cache, this context keeps %s: restore it into a "
                        "context of KV type %s", dtype == WS_KV_Q8_0 ? "a" : "an", kv_type_name(dtype),
                        kv_type_name((uint32_t)ctx->params.kv_type), kv_type_name(dtype));
    const uint32_t n = get_u32(buf + 24);
    if (n > (uint32_t)ctx->params.n_ctx)
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state holds %u tokens, the context only %d", n,
                        ctx->params.n_ctx);
    uint32_t nw = n;
    if (version >= 3) {
        /* the window must hold what the next token reads: its last n_swa - 1 positions */
        nw = get_u32(buf + 28);
        const int has_local = hp->arch == WS_ARCH_GEMMA3 && hp->n_swa > 0;
        const uint32_t least = has_local && (uint32_t)hp->n_swa - 1 < n ? (uint32_t)hp->n_swa - 1
                                                                          : n;
        if (nw > n || nw < least)
            return fail_ctx(ctx, WS_ERR_BAD_STATE,
                            "state of %u tokens holds %u positions of its sliding-window layers, "
                            "needs %u..%u", n, nw, least, n);
    }
    *n_out = n;
    *nw_out = nw;
    return WS_OK;
}

/* Validates n tokens and their KV (layout of ws_slot_state_get, local layers nw
   positions), then loads them: a ring takes the last positions it has rows for. */
static ws_status state_load(ws_context *ctx, int32_t slot, uint32_t n, uint32_t nw,
                            const uint8_t *tokens, const uint8_t *kv) {
    const ws_hparams *hp = &ctx->model->hp;
    for (uint32_t i = 0; i < n; i++) {
        int32_t tok;
        memcpy(&tok, tokens + 4 * (size_t)i, sizeof tok);
        if (tok < 0 || tok >= ctx->n_tok)
            return fail_ctx(ctx, WS_ERR_BAD_STATE, "state token %d at %u is outside 0..%d", tok, i,
                            ctx->n_tok - 1);
    }
    /* a NaN or infinity in the KV would poison every later token: refuse it (q8_0:
       in a block's scale; its int8 values are finite) */
    const int q8 = ctx->params.kv_type == WS_KV_Q8_0;
    const size_t stride = q8 ? WS_Q8_BLOCK_BYTES : ctx->params.kv_type == WS_KV_F16 ? 2 : 4;
    const size_t n_vals = state_kv_bytes(ctx, n, nw) / stride;
    for (size_t i = 0; i < n_vals; i++) {
        int finite;
        if (q8 || ctx->params.kv_type == WS_KV_F16) {
            const uint16_t h = (uint16_t)(kv[stride * i] | kv[stride * i + 1] << 8);
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
    const size_t vrow = ctx->kv_row * (size_t)hp->n_head_kv; /* one position of one layer */
    uint32_t held = n; /* positions every layer now holds (a ring: at most its rows) */
    for (int l = 0; n && l < hp->n_layer; l++) {
        const size_t rows = state_layer_rows(ctx, l, n, nw);
        const size_t keep = rows < (size_t)ctx->layer_cap[l] ? rows : (size_t)ctx->layer_cap[l];
        if (keep < held) held = (uint32_t)keep;
        const size_t skip = (rows - keep) * vrow;
        kv_scatter(ctx, ctx->k_cache, slot, l, (int)(n - keep), (int)keep, kv + skip);
        kv += rows * vrow;
        kv_scatter(ctx, ctx->v_cache, slot, l, (int)(n - keep), (int)keep, kv + skip);
        kv += rows * vrow;
    }
    ctx->n_past[slot] = (int32_t)n;
    ctx->ring_lo[slot] = (int32_t)(n - held);
    return WS_OK;
}

/* The start of both state setters: arguments, slot, then the slot is emptied (any
 * failure from here on leaves it empty) and the header checked; *n_out: its tokens. */
static ws_status state_set_begin(ws_context *ctx, int32_t slot, const uint8_t *header,
                                 size_t header_len, size_t *read_out, uint32_t *n_out,
                                 uint32_t *nw_out) {
    if (!ctx || !read_out) return WS_ERR_INVALID_ARGUMENT;
    *read_out = 0;
    TRY(check_slot(ctx, slot));
    ctx->n_past[slot] = 0;
    ctx->ring_lo[slot] = 0;
    return state_header_check(ctx, header, header_len, n_out, nw_out);
}

ws_status ws_slot_state_set(ws_context *ctx, int32_t slot, const uint8_t *buf, size_t len,
                            size_t *read_out) {
    uint32_t n = 0, nw = 0;
    ws_status st = state_set_begin(ctx, slot, buf, len, read_out, &n, &nw);
    if (st != WS_OK) return st;
    const size_t need = state_bytes(ctx, n, nw);
    if (len != need)
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state of %u tokens must be %zu bytes, got %zu", n,
                        need, len);
    const uint8_t *tokens = buf + WS_STATE_HEADER_BYTES;
    st = state_load(ctx, slot, n, nw, tokens, tokens + sizeof(int32_t) * n);
    if (st != WS_OK) return st;
    *read_out = need;
    return WS_OK;
}

ws_status ws_slot_state_set_parts(ws_context *ctx, int32_t slot, const uint8_t *header,
                                  size_t header_len, const uint8_t *tokens, size_t tokens_len,
                                  const uint8_t *kv, size_t kv_len, size_t *read_out) {
    uint32_t n = 0, nw = 0;
    ws_status st = state_set_begin(ctx, slot, header, header_len, read_out, &n, &nw);
    if (st != WS_OK) return st;
    const size_t kv_need = state_kv_bytes(ctx, n, nw);
    if (header_len != WS_STATE_HEADER_BYTES || tokens_len != sizeof(int32_t) * n ||
        kv_len != kv_need)
        return fail_ctx(ctx, WS_ERR_BAD_STATE,
                        "state of %u tokens needs parts of %u, %zu and %zu bytes, got %zu, %zu "
                        "and %zu", n, WS_STATE_HEADER_BYTES, sizeof(int32_t) * n, kv_need,
                        header_len, tokens_len, kv_len);
    if ((n && !tokens) || (kv_need && !kv))
        return fail_ctx(ctx, WS_ERR_BAD_STATE, "state part missing (NULL pointer)");
    st = state_load(ctx, slot, n, nw, tokens, kv);
    if (st != WS_OK) return st;
    *read_out = header_len + tokens_len + kv_len;
    return WS_OK;
}
