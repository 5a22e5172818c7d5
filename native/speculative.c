/*
 * speculative.c - speculative decoding over a target and a draft context
 * (see the ws_spec section of warmslot.h). Uses only the public context API.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "warmslot.h"
#include "ws_error.h"
#include "ws_math.h"
#include "ws_mem.h"

#define LP_ROW (1 + WS_SPEC_MAX_LOGPROBS)
#define LP_SLOT ((WS_SPEC_MAX_DRAFT + 1) * LP_ROW)

/* one slot's part of a (batched) speculative step */
struct step_member {
    int32_t slot, n0;     /* the slot and its target KV length before the step           */
    int32_t k_max, k;     /* proposals allowed, proposals made                           */
    int drafting;         /* still proposing in the current round                        */
    int lookup;           /* the proposals are the lookup drafter's                      */
    int head;             /* the feature head drafts (k_max is its allowance)            */
    int32_t nh;           /* penalties' history length before the step (0: no penalties) */
    int32_t acc;          /* proposals accepted                                          */
    size_t seg;           /* first token of its segment in the verification pass         */
    int32_t drafts[WS_SPEC_MAX_DRAFT];
};

/* one slot's speculative state; the part after `rng` is what a draft state saves */
typedef struct {
    int32_t pending;      /* sampled, not yet decoded; -1: none                  */
    int32_t d_off;        /* target position of the draft's position 0           */
    int32_t lag_ok;       /* generated (not prompt) tokens the draft has not seen yet */
    uint64_t rng[4];      /* xoshiro256**                                         */
    ws_spec_counters c;
    int32_t h_ok;         /* the head: h_last holds the hidden state of the last KV token */
    int32_t head_stale;   /* the head lacks pairs it cannot rebuild: no drafting         */
} spec_slot;

struct ws_spec {
    ws_context *tgt;
    ws_context *dft;      /* NULL: target only */
    int n_slots, n_ctx, n_vocab;
    spec_slot *slots;     /* [n_slots] */
    float *t_logits;      /* [n_vocab] (grown: [tokens of a step][n_vocab]) target rows */
    size_t t_cap;         /* floats in t_logits                                         */
    float *d_logits;      /* [n_vocab] (grown: [slots of a step][n_vocab]) draft logits  */
    size_t d_cap;
    float *q;             /* grown: [slots][WS_SPEC_MAX_DRAFT][n_vocab] draft dists      */
    size_t q_cap;
    float *r_logits;      /* grown: [slots][n_vocab] rows of one batched draft decode    */
    size_t r_cap;
    int32_t *b_slots;     /* [n_slots]                        slots of a batched pass   */
    int32_t *b_ntok;      /* [n_slots]                        tokens per slot of it     */
    int32_t *b_idx;       /* [n_slots]                        step member of each slot  */
    int32_t *b_toks;      /* [n_slots][WS_SPEC_MAX_DRAFT + 1] tokens of it              */
    int32_t *b_out;       /* [n_slots][WS_SPEC_MAX_DRAFT + 1] output of a multi step    */
    struct step_member *b_mem; /* [n_slots]                   per-slot plan of a step   */
    float *p;             /* [n_vocab]                        a target distribution    */
    int32_t *cand;        /* [n_vocab]                        candidate ids            */
    int32_t *toks;        /* [n_ctx + 1]                      token scratch            */
    /* penalties: each slot's sequence before the sampled positions, counts, logits */
    int32_t *hist;        /* [n_slots][HIST_LEN]              S and the drafts         */
    int32_t *cnt;         /* [n_vocab]                        zero between uses        */
    float *pen;           /* [n_vocab]                        penalized logits         */
    /* logprobs of each slot's last returned tokens: rows of 1 + WS_SPEC_MAX_LOGPROBS */
    int32_t *lp_ids;      /* [n_slots][WS_SPEC_MAX_DRAFT + 1][LP_ROW]                  */
    float *lp_vals;       /* [n_slots][WS_SPEC_MAX_DRAFT + 1][LP_ROW]                  */
    int32_t *lp_n;        /* [n_slots]                        rows of the last call    */
    int32_t *lp_top;      /* [n_slots]                        alternatives per row     */
    /* the feature head (ws_spec_set_head) */
    ws_context *head;     /* NULL: none                                                  */
    int32_t *head_ids;    /* [head_k] vocabulary token of each readout row               */
    int32_t head_k, n_embd;
    float *h_last;        /* [n_slots][n_embd] target hidden state of each slot's last token */
    float *hbuf;          /* grown: [tokens of a target pass][n_embd] its hidden states   */
    size_t hbuf_cap;
    float *fbuf;          /* grown: [pairs of a head pass][n_embd] its features          */
    size_t fbuf_cap;
    float *hg;            /* [n_slots][n_embd] the head's predicted hidden states         */
    float *hl;            /* [n_slots][head_k] the head's logits of a round               */
    int32_t *hb_slots, *hb_toks, *hb_ntok, *hb_idx; /* [n_slots] a head round's batch      */
    int32_t *hf_toks;     /* [hf_cap] tokens of a head catch-up pass                     */
    size_t hf_cap;        /* max(n_batch + 1, n_slots * (WS_SPEC_MAX_DRAFT + 2))          */
    uint8_t *want;        /* [n_batch] logits flags of a target piece                    */
    int32_t *hf_at, *hf_cnt; /* [n_slots] a step's head_follow arguments                  */
    const int32_t **hf_tokp;
    const float **hf_hidp;
    char last_error[256];
};

WS_DEFINE_FAIL(fail, ws_spec)

/* a failed context call: keep its message */
static ws_status fail_from(ws_spec *s, ws_context *ctx, ws_status st, const char *what) {
    return fail(s, st, "%s: %s", what, ws_context_last_error(ctx));
}

const char *ws_spec_last_error(const ws_spec *s) { return s ? s->last_error : ""; }

/* ------------------------------------------------------------------------- */
/* RNG: xoshiro256** seeded by splitmix64                                      */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t *s) {
    const uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* uniform in [0, 1) with 53 random bits */
static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

static void rng_seed(uint64_t *s, uint64_t seed) {
    for (int i = 0; i < 4; i++) s[i] = splitmix64(&seed);
}

/* ------------------------------------------------------------------------- */
/* sampling: temperature, top-k, min-p, top-p, in that order                   */

static int32_t argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int is_greedy(const ws_sampling_params *sp) { return !(sp->temperature > 0.0f); }

/* descending value, ascending id: a strict order, so selection and sorting are deterministic */
static int before(const float *v, int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); }

static void select_top_k(const float *v, int32_t *ids, int n, int k) {
    /* quickselect: afterwards ids[0..k) are the k first in `before` order (unordered) */
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int32_t pivot = ids[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (before(v, ids[i], pivot)) i++;
            while (before(v, pivot, ids[j])) j--;
            if (i <= j) {
                int32_t t = ids[i]; ids[i] = ids[j]; ids[j] = t;
                i++; j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* heap sort of ids by `before` on v (no recursion, no global comparator state) */
static void sift_down(const float *v, int32_t *ids, int root, int n) {
    for (;;) {
        int child = 2 * root + 1;
        if (child >= n) return;
        /* a max-heap on "comes later", so the array ends up in `before` order */
        if (child + 1 < n && before(v, ids[child], ids[child + 1])) child++;
        if (!before(v, ids[root], ids[child])) return;
        int32_t t = ids[root]; ids[root] = ids[child]; ids[child] = t;
        root = child;
    }
}

static void sort_before(const float *v, int32_t *ids, int n) {
    for (int i = n / 2 - 1; i >= 0; i--) sift_down(v, ids, i, n);
    for (int end = n - 1; end > 0; end--) {
        int32_t t = ids[0]; ids[0] = ids[end]; ids[end] = t;
        sift_down(v, ids, 0, end);
    }
}

/* fills probs (dense, n floats) with the sampling distribution of `logits` */
static void build_dist(ws_spec *s, const float *logits, const ws_sampling_params *sp, float *probs) {
    const int n = s->n_vocab;
    int32_t *ids = s->cand;
    int m = n;
    for (int i = 0; i < n; i++) ids[i] = i;
    if (sp->top_k > 0 && sp->top_k < n) {
        select_top_k(logits, ids, n, sp->top_k);
        m = sp->top_k;
    }
    /* candidates in ascending id order, so every sum below runs in one fixed order:
       mark the selected ids in probs (zeroed here, refilled below) and collect them
       with one pass over the vocabulary, O(n_vocab) whatever top_k is */
    if (m < n) {
        memset(probs, 0, sizeof(float) * (size_t)n);
        for (int i = 0; i < m; i++) probs[ids[i]] = 1.0f;
        int c = 0;
        for (int32_t id = 0; id < n; id++)
            if (probs[id] != 0.0f) ids[c++] = id;
    }
    float mx = -INFINITY;
    for (int i = 0; i < m; i++) mx = logits[ids[i]] > mx ? logits[ids[i]] : mx;
    const float inv_t = 1.0f / sp->temperature;
    memset(probs, 0, sizeof(float) * (size_t)n);
    double sum = 0.0;
    for (int i = 0; i < m; i++) {
        float e = ws_expf((logits[ids[i]] - mx) * inv_t);
        probs[ids[i]] = e;
        sum += e;
    }
    float pmax = 0.0f;
    for (int i = 0; i < m; i++) {
        probs[ids[i]] = (float)(probs[ids[i]] / sum);
        pmax = probs[ids[i]] > pmax ? probs[ids[i]] : pmax;
    }
    if (sp->min_p > 0.0f) {
        const float thr = sp->min_p * pmax;
        int k = 0;
        sum = 0.0;
        for (int i = 0; i < m; i++) {
            if (probs[ids[i]] >= thr) {
                ids[k++] = ids[i];
                sum += probs[ids[i]];
            } else {
                probs[ids[i]] = 0.0f;
            }
        }
        m = k;
        for (int i = 0; i < m; i++) probs[ids[i]] = (float)(probs[ids[i]] / sum);
    }
    if (sp->top_p < 1.0f && m > 1) {
        sort_before(probs, ids, m);
        double cum = 0.0;
        int k = 0;
        while (k < m) {
            cum += probs[ids[k++]];
            if (cum >= sp->top_p) break;
        }
        for (int i = k; i < m; i++) probs[ids[i]] = 0.0f;
        sum = 0.0;
        for (int i = 0; i < n; i++) sum += probs[i];
        for (int i = 0; i < n; i++) probs[i] = (float)(probs[i] / sum);
    }
}

/* draws from an unnormalised dense distribution; total is its sum */
static int32_t sample_dense(const float *w, int n, double total, uint64_t *rng) {
    const double u = rng_uniform(rng) * total;
    double cum = 0.0;
    int32_t last = -1;
    for (int i = 0; i < n; i++) {
        if (w[i] <= 0.0f) continue;
        cum += w[i];
        last = i;
        if (u < cum) return i;
    }
    return last >= 0 ? last : 0; /* rounding at the very top */
}

static double dense_sum(const float *w, int n) {
    double t = 0.0;
    for (int i = 0; i < n; i++) t += w[i];
    return t;
}

static int penalties_on(const ws_sampling_params *sp) {
    return sp->repeat_last_n > 0 && ((sp->repeat_penalty != 0.0f && sp->repeat_penalty != 1.0f) ||
                                     sp->presence_penalty != 0.0f || sp->frequency_penalty != 0.0f);
}

/* logits with the penalties of the last repeat_last_n of the n tokens hist[0..n) applied:
   s->pen, or logits itself when the parameters ask for none */
static const float *penalize(ws_spec *s, const float *logits, const ws_sampling_params *sp,
                             const int32_t *hist, int32_t n) {
    if (!penalties_on(sp)) return logits;
    memcpy(s->pen, logits, sizeof(float) * (size_t)s->n_vocab);
    const int32_t from = n > sp->repeat_last_n ? n - sp->repeat_last_n : 0;
    for (int32_t i = from; i < n; i++) s->cnt[hist[i]]++;
    const int rp = sp->repeat_penalty != 0.0f && sp->repeat_penalty != 1.0f;
    for (int32_t i = from; i < n; i++) {
        const int32_t t = hist[i];
        const int32_t c = s->cnt[t];
        if (c == 0) continue; /* already penalized: its count was cleared */
        float x = s->pen[t];
        if (rp) x = x <= 0.0f ? x * sp->repeat_penalty : x / sp->repeat_penalty;
        x -= (float)c * sp->frequency_penalty + sp->presence_penalty;
        s->pen[t] = x;
        s->cnt[t] = 0;
    }
    return s->pen;
}

/* the next token from target logits (penalized already): argmax when greedy, else a draw */
static int32_t sample_logits(ws_spec *s, spec_slot *ss, const float *logits,
                             const ws_sampling_params *sp) {
    if (is_greedy(sp)) return argmax(logits, s->n_vocab);
    build_dist(s, logits, sp, s->p);
    return sample_dense(s->p, s->n_vocab, dense_sum(s->p, s->n_vocab), ss->rng);
}

/* the slot's own history buffer: its tokens, then the drafts of a step */
static int32_t *hist_of(const ws_spec *s, int32_t slot) {
    return s->hist + (size_t)slot * ((size_t)s->n_ctx + WS_SPEC_MAX_DRAFT + 1);
}

/* the slot's target tokens then, when there is one, its pending token into its history,
   when the penalties need them; the count */
static int32_t load_hist(ws_spec *s, int32_t slot, const ws_sampling_params *sp) {
    if (!penalties_on(sp)) return 0;
    int32_t n = 0;
    int32_t *h = hist_of(s, slot);
    ws_slot_tokens(s->tgt, slot, h, (size_t)s->n_ctx, &n);
    if (s->slots[slot].pending >= 0) h[n++] = s->slots[slot].pending;
    return n;
}

/* row `row` of the slot's logprobs: the token's and the n_logprobs most likely tokens'
   log-softmax of the raw logits (in double: max, then the sum of exp in id order) */
static void record_logprobs(ws_spec *s, int32_t slot, int row, const float *logits,
                            int32_t token, const ws_sampling_params *sp) {
    const int n = s->n_vocab, k = sp->n_logprobs;
    s->lp_top[slot] = k;
    s->lp_n[slot] = row + 1;
    if (k <= 0) {
        s->lp_n[slot] = 0;
        return;
    }
    double mx = logits[argmax(logits, n)];
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - mx);
    const double lse = mx + log(sum);
    int32_t *ids = s->lp_ids + (size_t)slot * LP_SLOT + (size_t)row * LP_ROW;
    float *vals = s->lp_vals + (size_t)slot * LP_SLOT + (size_t)row * LP_ROW;
    ids[0] = token;
    vals[0] = (float)((double)logits[token] - lse);
    int32_t *cand = s->cand;
    for (int i = 0; i < n; i++) cand[i] = i;
    const int m = k < n ? k : n;
    if (m < n) select_top_k(logits, cand, n, m);
    sort_before(logits, cand, m);
    for (int i = 0; i < m; i++) {
        ids[1 + i] = cand[i];
        vals[1 + i] = (float)((double)logits[cand[i]] - lse);
    }
}

ws_status ws_spec_logprobs(const ws_spec *s, int32_t slot, int32_t *ids, float *lps,
                           size_t cap, int32_t *n_rows, int32_t *n_top) {
    if (!s || !n_rows || !n_top) return WS_ERR_INVALID_ARGUMENT;
    *n_rows = *n_top = 0;
    if (slot < 0 || slot >= s->n_slots)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "slot %d out of range 0..%d", slot, s->n_slots - 1);
    const int32_t n = s->lp_n[slot];
    if (n > 0 && (!ids || !lps || cap < (size_t)n))
        return fail(s, WS_ERR_BUFFER_TOO_SMALL, "logprob buffers hold %zu rows, %d needed", cap, n);
    const size_t len = (size_t)n * LP_ROW;
    if (n > 0) {
        memcpy(ids, s->lp_ids + (size_t)slot * LP_SLOT, sizeof(int32_t) * len);
        memcpy(lps, s->lp_vals + (size_t)slot * LP_SLOT, sizeof(float) * len);
    }
    *n_rows = n;
    *n_top = s->lp_top[slot];
    return WS_OK;
}


/* top probability of a softmax at temperature 1 (greedy drafting's confidence) */
static float top_prob(const float *logits, int n) {
    const int32_t a = argmax(logits, n);
    const float mx = logits[a];
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += ws_expf(logits[i] - mx);
    return (float)(1.0 / sum);
}

/* ------------------------------------------------------------------------- */
/* lifecycle                                                                   */

void ws_spec_free(ws_spec *s) {
    if (!s) return;
    WS_FREE_ALL(s->slots, s->t_logits, s->d_logits, s->q, s->r_logits, s->b_slots, s->b_ntok,
                s->b_idx, s->b_toks, s->b_out, s->b_mem, s->hist, s->cnt, s->pen, s->lp_ids,
                s->lp_vals, s->lp_n, s->lp_top, s->p, s->cand, s->toks, s->head_ids, s->h_last,
                s->hbuf, s->fbuf, s->hg, s->hl, s->hb_slots, s->hb_toks, s->hb_ntok, s->hb_idx,
                s->hf_toks, s->want, s->hf_at, s->hf_cnt, (void *)s->hf_tokp, (void *)s->hf_hidp,
                s);
}

ws_status ws_spec_init(ws_context *tgt, ws_context *dft, ws_spec **out) {
    if (!out) return WS_ERR_INVALID_ARGUMENT;
    *out = NULL;
    if (!tgt) return WS_ERR_INVALID_ARGUMENT;
    ws_spec *s = calloc(1, sizeof *s);
    if (!s) return WS_ERR_OUT_OF_MEMORY;
    const ws_context_params tp = ws_context_get_params(tgt);
    const ws_hparams *th = ws_model_hparams(ws_context_model(tgt));
    s->tgt = tgt;
    s->dft = dft;
    s->n_slots = tp.n_slots;
    s->n_ctx = tp.n_ctx;
    s->n_vocab = th->n_vocab;
    s->n_embd = th->n_embd;
    *out = s; /* from here on errors are reported through s and it is freed by the caller */
    if (dft) {
        const ws_context_params dp = ws_context_get_params(dft);
        const ws_hparams *dh = ws_model_hparams(ws_context_model(dft));
        if (dh->n_vocab != th->n_vocab) {
            ws_status st = fail(s, WS_ERR_INVALID_ARGUMENT,
                                "the draft's vocabulary (%d tokens) differs from the target's (%d)",
                                dh->n_vocab, th->n_vocab);
            return st;
        }
        if (dp.n_slots != tp.n_slots || dp.n_ctx != tp.n_ctx)
            return fail(s, WS_ERR_INVALID_ARGUMENT,
                        "the draft context (%d slots x %d) must match the target's (%d x %d)",
                        dp.n_slots, dp.n_ctx, tp.n_slots, tp.n_ctx);
    }
    const size_t nv = (size_t)s->n_vocab;
    s->slots = calloc((size_t)s->n_slots, sizeof(spec_slot));
    s->t_logits = malloc(sizeof(float) * nv);
    s->t_cap = nv;
    s->p = malloc(sizeof(float) * nv);
    s->cand = malloc(sizeof(int32_t) * nv);
    s->toks = malloc(sizeof(int32_t) * ((size_t)s->n_ctx + 1));
    const size_t ns = (size_t)s->n_slots, per = WS_SPEC_MAX_DRAFT + 1;
    s->b_slots = malloc(sizeof(int32_t) * ns);
    s->b_ntok = malloc(sizeof(int32_t) * ns);
    s->b_idx = malloc(sizeof(int32_t) * ns);
    s->b_toks = malloc(sizeof(int32_t) * ns * per);
    s->b_out = malloc(sizeof(int32_t) * ns * per);
    s->b_mem = malloc(sizeof(struct step_member) * ns);
    s->hist = malloc(sizeof(int32_t) * ns * ((size_t)s->n_ctx + WS_SPEC_MAX_DRAFT + 1));
    s->cnt = calloc(nv, sizeof(int32_t));
    s->pen = malloc(sizeof(float) * nv);
    s->lp_ids = malloc(sizeof(int32_t) * LP_SLOT * ns);
    s->lp_vals = malloc(sizeof(float) * LP_SLOT * ns);
    s->lp_n = calloc(ns, sizeof(int32_t));
    s->lp_top = calloc(ns, sizeof(int32_t));
    if (!s->slots || !s->t_logits || !s->p || !s->cand || !s->toks || !s->b_slots ||
        !s->b_ntok || !s->b_idx || !s->b_toks || !s->b_out || !s->b_mem ||
        !s->hist || !s->cnt || !s->pen || !s->lp_ids || !s->lp_vals || !s->lp_n || !s->lp_top)
        return fail(s, WS_ERR_OUT_OF_MEMORY, "out of memory allocating speculative buffers");
    for (int i = 0; i < s->n_slots; i++) {
        s->slots[i].pending = -1;
        rng_seed(s->slots[i].rng, (uint64_t)i);
    }
    return WS_OK;
}

ws_status ws_spec_check_params(const ws_spec *s, const ws_sampling_params *sp,
                               const ws_spec_params *pp) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    if (sp) {
        if (isnan(sp->temperature) || sp->temperature < 0.0f || sp->temperature > 100.0f)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "temperature %g outside [0, 100]",
                        (double)sp->temperature);
        if (sp->top_k < 0)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "top_k %d is negative", sp->top_k);
        if (!(sp->top_p > 0.0f && sp->top_p <= 1.0f))
            return fail(s, WS_ERR_INVALID_ARGUMENT, "top_p %g outside (0, 1]", (double)sp->top_p);
        if (!(sp->min_p >= 0.0f && sp->min_p < 1.0f))
            return fail(s, WS_ERR_INVALID_ARGUMENT, "min_p %g outside [0, 1)", (double)sp->min_p);
        if (!(sp->repeat_penalty >= 0.0f && sp->repeat_penalty <= 10.0f))
            return fail(s, WS_ERR_INVALID_ARGUMENT, "repeat_penalty %g outside [0, 10]",
                        (double)sp->repeat_penalty);
        if (sp->repeat_last_n < 0 || sp->repeat_last_n > WS_SPEC_MAX_PENALTY_LAST_N)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "repeat_last_n %d outside 0..%d",
                        sp->repeat_last_n, WS_SPEC_MAX_PENALTY_LAST_N);
        if (!(sp->presence_penalty >= -2.0f && sp->presence_penalty <= 2.0f))
            return fail(s, WS_ERR_INVALID_ARGUMENT, "presence_penalty %g outside [-2, 2]",
                        (double)sp->presence_penalty);
        if (!(sp->frequency_penalty >= -2.0f && sp->frequency_penalty <= 2.0f))
            return fail(s, WS_ERR_INVALID_ARGUMENT, "frequency_penalty %g outside [-2, 2]",
                        (double)sp->frequency_penalty);
        if (sp->n_logprobs < 0 || sp->n_logprobs > WS_SPEC_MAX_LOGPROBS)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "n_logprobs %d outside 0..%d", sp->n_logprobs,
                        WS_SPEC_MAX_LOGPROBS);
    }
    if (pp) {
        if (pp->n_max < 0 || pp->n_max > WS_SPEC_MAX_DRAFT)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "n_max %d outside 0..%d", pp->n_max,
                        WS_SPEC_MAX_DRAFT);
        if (pp->n_min < 0 || pp->n_min > pp->n_max)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "n_min %d outside 0..n_max (%d)", pp->n_min,
                        pp->n_max);
        if (!(pp->p_min >= 0.0f && pp->p_min <= 1.0f))
            return fail(s, WS_ERR_INVALID_ARGUMENT, "p_min %g outside [0, 1]", (double)pp->p_min);
        for (int m = 1; m <= WS_SPEC_LOOKUP_MAX_MATCH; m++)
            if (pp->lookup_k[m] < 0 || pp->lookup_k[m] > WS_SPEC_MAX_DRAFT)
                return fail(s, WS_ERR_INVALID_ARGUMENT, "lookup_k[%d] = %d outside 0..%d", m,
                            pp->lookup_k[m], WS_SPEC_MAX_DRAFT);
        if (pp->head_n_max < 0 || pp->head_n_max > WS_SPEC_MAX_DRAFT)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "head_n_max %d outside 0..%d",
                        pp->head_n_max, WS_SPEC_MAX_DRAFT);
    }
    return WS_OK;
}

static ws_status check_slot(const ws_spec *s, int32_t slot) {
    if (slot < 0 || slot >= s->n_slots)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "slot %d out of range 0..%d", slot, s->n_slots - 1);
    return WS_OK;
}

/* an accessor's arguments: the handle and its output are set, the slot exists */
static ws_status check_slot_out(const ws_spec *s, int32_t slot, const void *out) {
    if (!s || !out) return WS_ERR_INVALID_ARGUMENT;
    return check_slot(s, slot);
}

static int32_t kv_len(const ws_context *ctx, int32_t slot) {
    int32_t n = 0;
    ws_slot_n_tokens(ctx, slot, &n);
    return n;
}

ws_status ws_spec_seed(ws_spec *s, int32_t slot, uint64_t seed) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(s, slot));
    rng_seed(s->slots[slot].rng, seed);
    return WS_OK;
}

ws_status ws_spec_n_tokens(const ws_spec *s, int32_t slot, int32_t *n_out) {
    TRY(check_slot_out(s, slot, n_out));
    *n_out = kv_len(s->tgt, slot) + (s->slots[slot].pending >= 0);
    return WS_OK;
}

ws_status ws_spec_tokens(const ws_spec *s, int32_t slot, int32_t *out, size_t cap,
                         int32_t *n_out) {
    if (!out && cap > 0) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot_out(s, slot, n_out));
    /* the target's tokens (ws_slot_tokens), then the sampled token not yet decoded */
    const int32_t pending = s->slots[slot].pending;
    *n_out = kv_len(s->tgt, slot) + (pending >= 0);
    if (cap < (size_t)*n_out)
        return fail(s, WS_ERR_BUFFER_TOO_SMALL, "token buffer holds %zu, slot has %d", cap, *n_out);
    int32_t n = 0;
    if (*n_out > (pending >= 0)) TRY(ws_slot_tokens(s->tgt, slot, out, cap, &n));
    if (pending >= 0) out[n] = pending;
    return WS_OK;
}

ws_status ws_spec_draft_n_tokens(const ws_spec *s, int32_t slot, int32_t *n_out) {
    TRY(check_slot_out(s, slot, n_out));
    *n_out = s->dft ? kv_len(s->dft, slot) : 0;
    return WS_OK;
}

ws_status ws_spec_draft_offset(const ws_spec *s, int32_t slot, int32_t *offset_out) {
    TRY(check_slot_out(s, slot, offset_out));
    *offset_out = s->slots[slot].d_off;
    return WS_OK;
}

ws_status ws_spec_counters_get(const ws_spec *s, int32_t slot, ws_spec_counters *out) {
    TRY(check_slot_out(s, slot, out));
    *out = s->slots[slot].c;
    return WS_OK;
}

/* ------------------------------------------------------------------------- */
/* the feature head                                                            */

static ws_status grow_floats(ws_spec *s, float **buf, size_t *cap, size_t need);

ws_status ws_spec_set_head(ws_spec *s, ws_context *head, const int32_t *token_ids, int32_t k) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    if (s->head) return fail(s, WS_ERR_INVALID_ARGUMENT, "the speculative decoder has a head");
    if (!head || !token_ids || !ws_context_is_head(head))
        return fail(s, WS_ERR_INVALID_ARGUMENT, "ws_spec_set_head needs a feature head context "
                                                "and its token ids");
    const ws_hparams *hh = ws_model_hparams(ws_context_model(head));
    const ws_context_params hp = ws_context_get_params(head);
    if (hh->n_embd != s->n_embd || hh->n_vocab != k || hp.n_slots != s->n_slots ||
        hp.n_ctx != s->n_ctx)
        return fail(s, WS_ERR_INVALID_ARGUMENT,
                    "the head (width %d, %d readout rows, %d slots x %d) does not fit the target "
                    "(width %d, %d ids, %d slots x %d)", hh->n_embd, hh->n_vocab, hp.n_slots,
                    hp.n_ctx, s->n_embd, k, s->n_slots, s->n_ctx);
    for (int32_t i = 0; i < k; i++)
        if (token_ids[i] < 0 || token_ids[i] >= s->n_vocab)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "head token id %d at %d is outside 0..%d",
                        token_ids[i], i, s->n_vocab - 1);
    for (int32_t i = 0; i < s->n_slots; i++)
        if (kv_len(s->tgt, i) > 0 || s->slots[i].pending >= 0)
            return fail(s, WS_ERR_BAD_STATE, "a head is set while every slot is empty (slot %d "
                                             "is not)", i);
    const size_t ns = (size_t)s->n_slots, E = (size_t)s->n_embd;
    s->head_ids = malloc(sizeof(int32_t) * (size_t)k);
    s->h_last = calloc(ns * E, sizeof(float));
    s->hg = malloc(sizeof(float) * ns * E);
    s->hl = malloc(sizeof(float) * ns * (size_t)k);
    s->hb_slots = malloc(sizeof(int32_t) * ns);
    s->hb_toks = malloc(sizeof(int32_t) * ns);
    s->hb_ntok = malloc(sizeof(int32_t) * ns);
    s->hb_idx = malloc(sizeof(int32_t) * ns);
    const size_t nb = (size_t)ws_context_get_params(s->tgt).n_batch;
    s->hf_cap = nb + 1 > ns * (WS_SPEC_MAX_DRAFT + 2) ? nb + 1 : ns * (WS_SPEC_MAX_DRAFT + 2);
    s->hf_toks = malloc(sizeof(int32_t) * s->hf_cap);
    s->want = malloc(nb);
    s->hf_at = malloc(sizeof(int32_t) * ns);
    s->hf_cnt = malloc(sizeof(int32_t) * ns);
    s->hf_tokp = malloc(sizeof(int32_t *) * ns);
    s->hf_hidp = malloc(sizeof(float *) * ns);
    if (!s->hf_at || !s->hf_cnt || !s->hf_tokp || !s->hf_hidp)
        return fail(s, WS_ERR_OUT_OF_MEMORY, "out of memory allocating the head's buffers");
    if (!s->head_ids || !s->h_last || !s->hg || !s->hl || !s->hb_slots || !s->hb_toks ||
        !s->hb_ntok || !s->hb_idx || !s->hf_toks || !s->want)
        return fail(s, WS_ERR_OUT_OF_MEMORY, "out of memory allocating the head's buffers");
    memcpy(s->head_ids, token_ids, sizeof(int32_t) * (size_t)k);
    s->head_k = k;
    for (int32_t i = 0; i < s->n_slots; i++) {
        ws_slot_clear(head, i);
        s->slots[i].h_ok = 0;
        s->slots[i].head_stale = 0;
    }
    s->head = head;
    return WS_OK;
}

/* the head can draft for a slot of n0 target tokens: level, h_{n0-1} kept */
static int head_ready(const ws_spec *s, int32_t slot, int32_t n0) {
    const spec_slot *ss = &s->slots[slot];
    return s->head && !ss->head_stale && n0 >= 1 && ss->h_ok && kv_len(s->head, slot) == n0 - 1;
}

ws_status ws_spec_head_status(const ws_spec *s, int32_t slot, int32_t *n_pairs, int *ready) {
    if (!s || !n_pairs || !ready) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(s, slot));
    *n_pairs = s->head ? kv_len(s->head, slot) : 0;
    *ready = head_ready(s, slot, kv_len(s->tgt, slot));
    return WS_OK;
}

/* the head of a slot that lost pairs it cannot rebuild: empty, no drafting until cleared */
static void head_stale(ws_spec *s, int32_t slot) {
    ws_slot_clear(s->head, slot);
    s->slots[slot].head_stale = 1;
    s->slots[slot].h_ok = 0;
}

/*
 * After the target decoded, for each of the n slots slots[i], the cnt[i] tokens
 * toks[i] at positions at[i] .. at[i] + cnt[i] - 1 with hidden states hid[i]
 * ([cnt][n_embd]; the KV keeps them): the head computes the pairs it lacks up to
 * position at + cnt - 2 (keys and values only, one pass for all slots) and keeps
 * h_{at + cnt - 1}. A pair at - 1 takes the kept h_last.
 */
static ws_status head_follow(ws_spec *s, int32_t n, const int32_t *slots, const int32_t *at,
                             const int32_t *cnt, const int32_t *const *toks,
                             const float *const *hid) {
    if (!s->head) return WS_OK;
    const size_t E = (size_t)s->n_embd;
    size_t total = 0;
    int32_t nseg = 0;
    for (int32_t i = 0; i < n; i++) { /* sizes first: the slots that can follow */
        const spec_slot *ss = &s->slots[slots[i]];
        const int32_t L = kv_len(s->head, slots[i]), a = at[i];
        const int32_t end = a + cnt[i] - 1; /* pairs [L, end) */
        if (ss->head_stale || L < a - 1 || (L == a - 1 && a > 0 && !ss->h_ok)) continue;
        if (end > L) total += (size_t)(end - L);
    }
    if (total) TRY(grow_floats(s, &s->fbuf, &s->fbuf_cap, total * E));
    /* the pass's tokens: a piece of a prefill (n_batch + 1 pairs at most) or a step's */
    int32_t *tks = s->hf_toks;
    if (total > s->hf_cap)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "head catch-up of %zu pairs exceeds %zu", total,
                    s->hf_cap);
    size_t done = 0;
    int32_t *ntok = s->hb_ntok, *sl = s->hb_slots;
    for (int32_t i = 0; i < n; i++) {
        const int32_t slot = slots[i];
        spec_slot *ss = &s->slots[slot];
        if (ss->head_stale) continue;
        int32_t L = kv_len(s->head, slot);
        const int32_t a = at[i], end = a + cnt[i] - 1;
        if (L > end) { /* ahead of the target (cannot happen): drop the extra pairs */
            ws_slot_truncate(s->head, slot, end);
            L = end;
        }
        if (L < a - 1 || (L == a - 1 && a > 0 && !ss->h_ok)) {
            head_stale(s, slot);
            continue;
        }
        for (int32_t p = L; p < end; p++) {
            const float *h = p == a - 1 ? s->h_last + (size_t)slot * E
                                        : hid[i] + (size_t)(p - a) * E;
            memcpy(s->fbuf + (done + (size_t)(p - L)) * E, h, sizeof(float) * E);
            tks[done + (size_t)(p - L)] = toks[i][p + 1 - a];
        }
        if (end > L) {
            sl[nseg] = slot;
            ntok[nseg++] = end - L;
            done += (size_t)(end - L);
        }
        memcpy(s->h_last + (size_t)slot * E, hid[i] + (size_t)(cnt[i] - 1) * E,
               sizeof(float) * E);
        ss->h_ok = 1;
    }
    if (nseg == 0) return WS_OK;
    const ws_decode_io io = {.features = s->fbuf, .features_cap = done * E, .kv_only = 1};
    ws_status st = ws_decode_ex(s->head, nseg, sl, ntok, tks, &io);
    if (st != WS_OK) return fail_from(s, s->head, st, "head catch-up");
    return WS_OK;
}

/* The target decodes n tokens for one slot (its next positions); with a head, in
 * pieces of at most n_batch tokens that keep their hidden states for the head to
 * follow. logits: the last token's, or NULL. */
static ws_status target_decode(ws_spec *s, int32_t slot, const int32_t *toks, int32_t n,
                               float *logits, const char *what) {
    if (!s->head) {
        ws_status st = ws_decode(s->tgt, slot, toks, n, 0, logits, logits ? (size_t)s->n_vocab : 0);
        return st == WS_OK ? WS_OK : fail_from(s, s->tgt, st, what);
    }
    const int32_t piece = ws_context_get_params(s->tgt).n_batch;
    const size_t E = (size_t)s->n_embd;
    /* what the core would refuse, refused before the first piece changes anything */
    const int32_t tn = kv_len(s->tgt, slot);
    if (n < 1 || (int64_t)tn + n > s->n_ctx)
        return fail(s, n < 1 ? WS_ERR_INVALID_ARGUMENT : WS_ERR_CONTEXT_FULL,
                    "%s: slot %d holds %d tokens; %d more exceed its context of %d", what, slot,
                    tn, n, s->n_ctx);
    for (int32_t i = 0; i < n; i++)
        if (toks[i] < 0 || toks[i] >= s->n_vocab)
            return fail(s, WS_ERR_INVALID_ARGUMENT,
                        "%s: token %d at index %d is outside the vocabulary 0..%d", what, toks[i],
                        i, s->n_vocab - 1);
    TRY(grow_floats(s, &s->hbuf, &s->hbuf_cap, (size_t)(n < piece ? n : piece) * E));
    for (int32_t done = 0; done < n;) {
        const int32_t m = n - done < piece ? n - done : piece;
        const int last = done + m == n;
        const int32_t at = kv_len(s->tgt, slot);
        ws_decode_io io = {.hidden = s->hbuf, .hidden_cap = (size_t)m * E};
        if (last && logits) {
            /* only the last token's logits: a flag per token, the last one set */
            memset(s->want, 0, (size_t)m);
            s->want[m - 1] = 1;
            io.want = s->want;
            io.logits = logits;
            io.logits_cap = (size_t)s->n_vocab;
        }
        ws_status st = ws_decode_ex(s->tgt, 1, &slot, &m, toks + done, &io);
        if (st != WS_OK) return fail_from(s, s->tgt, st, what);
        const int32_t *tp = toks + done;
        const float *hp = s->hbuf;
        TRY(head_follow(s, 1, &slot, &at, &m, &tp, &hp));
        done += m;
    }
    return WS_OK;
}

/* ------------------------------------------------------------------------- */
/* the draft's catch-up: decode target tokens [d_off + dn, upto) into the draft */

static ws_status draft_catch_up(ws_spec *s, int32_t slot, int32_t upto, float *logits,
                                int32_t *n_done) {
    spec_slot *ss = &s->slots[slot];
    const int32_t dn = kv_len(s->dft, slot);
    const int32_t from = ss->d_off + dn;
    *n_done = 0;
    if (from >= upto) return WS_OK;
    int32_t got = 0;
    const int32_t tn = kv_len(s->tgt, slot);
    if (tn > 0) ws_slot_tokens(s->tgt, slot, s->toks, (size_t)s->n_ctx + 1, &got);
    if (upto == tn + 1) s->toks[tn] = ss->pending; /* the pending token rides along */
    ws_status st = ws_decode(s->dft, slot, s->toks + from, upto - from, 0, logits,
                             logits ? (size_t)s->n_vocab : 0);
    if (st != WS_OK) return fail_from(s, s->dft, st, "draft decode");
    *n_done = upto - from;
    return WS_OK;
}

ws_status ws_spec_draft_sync(ws_spec *s, int32_t slot, int32_t *n_out) {
    TRY(check_slot_out(s, slot, n_out));
    *n_out = 0;
    if (!s->dft) return WS_OK;
    spec_slot *ss = &s->slots[slot];
    int32_t n = 0;
    TRY(draft_catch_up(s, slot, kv_len(s->tgt, slot), NULL, &n));
    ss->c.n_draft_prefill += (uint64_t)(n > ss->lag_ok ? n - ss->lag_ok : 0);
    ss->lag_ok = 0;
    *n_out = n;
    return WS_OK;
}

/* At most max_tokens of the draft's lag behind the target's KV. The last lag_ok
 * tokens of the lag were generated, not prompt: they do not count as draft prefill. */
static ws_status catch_up_bounded(ws_spec *s, int32_t slot, int32_t max_tokens, int32_t *n_done,
                                  int32_t *n_left) {
    *n_done = 0;
    *n_left = 0;
    if (!s->dft) return WS_OK;
    spec_slot *ss = &s->slots[slot];
    const int32_t tn = kv_len(s->tgt, slot);
    const int32_t from = ss->d_off + kv_len(s->dft, slot);
    if (ss->d_off > tn || from >= tn) return WS_OK;
    const int32_t lag = tn - from;
    const int32_t n = lag < max_tokens ? lag : max_tokens;
    int32_t done = 0;
    TRY(draft_catch_up(s, slot, from + n, NULL, &done));
    const int32_t ok_from = tn - (ss->lag_ok < lag ? ss->lag_ok : lag);
    int32_t in_ok = from + done > ok_from ? from + done - ok_from : 0;
    if (in_ok > done) in_ok = done;
    ss->c.n_draft_prefill += (uint64_t)(done - in_ok);
    ss->lag_ok = done == lag ? 0 : ss->lag_ok - in_ok;
    *n_done = done;
    *n_left = lag - done;
    return WS_OK;
}

ws_status ws_spec_draft_catch_up(ws_spec *s, int32_t slot, int32_t max_tokens, int32_t *n_done,
                                 int32_t *n_left) {
    if (!s || !n_done || !n_left) return WS_ERR_INVALID_ARGUMENT;
    *n_done = 0;
    *n_left = 0;
    TRY(check_slot(s, slot));
    if (max_tokens < 1)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "max_tokens %d must be >= 1", max_tokens);
    return catch_up_bounded(s, slot, max_tokens, n_done, n_left);
}

ws_status ws_spec_prefill_chunk(ws_spec *s, int32_t slot, const int32_t *tokens, int32_t n_tokens,
                                int with_draft) {
    if (!s || !tokens || n_tokens < 1) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(s, slot));
    spec_slot *ss = &s->slots[slot];
    const int pend = ss->pending >= 0;
    const int32_t n = n_tokens + pend;
    const int32_t tn = kv_len(s->tgt, slot);
    if (n > s->n_ctx - tn)
        return fail(s, WS_ERR_CONTEXT_FULL, "%d tokens after %d exceed the context of %d", n, tn,
                    s->n_ctx);
    int32_t *seq = s->toks;
    if (pend) seq[0] = ss->pending;
    memcpy(seq + pend, tokens, sizeof(int32_t) * (size_t)n_tokens);
    TRY(target_decode(s, slot, seq, n, NULL, "prefill chunk"));
    ss->pending = -1;
    ss->lag_ok += pend; /* the pending token was generated, not prompt */
    if (with_draft) {
        int32_t done = 0, left = 0;
        TRY(catch_up_bounded(s, slot, n, &done, &left));
    }
    return WS_OK;
}

ws_status ws_spec_draft_reset(ws_spec *s, int32_t slot, int32_t offset) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(s, slot));
    const int32_t tn = kv_len(s->tgt, slot);
    if (offset < 0 || offset > tn)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "draft offset %d outside 0..%d", offset, tn);
    if (s->dft) ws_slot_clear(s->dft, slot);
    s->slots[slot].d_off = offset;
    s->slots[slot].lag_ok = 0;
    return WS_OK;
}

/* ------------------------------------------------------------------------- */
/* prefill, step, commit, truncate                                             */

ws_status ws_spec_prefill(ws_spec *s, int32_t slot, const int32_t *tokens, int32_t n_tokens,
                          const ws_sampling_params *sp, int with_draft, int32_t *token_out) {
    if (!s || !token_out || !sp || (n_tokens > 0 && !tokens) || n_tokens < 0)
        return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(s, slot));
    TRY(ws_spec_check_params(s, sp, NULL));
    spec_slot *ss = &s->slots[slot];
    const int pend = ss->pending >= 0;
    const int32_t n = n_tokens + pend;
    if (n == 0) return fail(s, WS_ERR_INVALID_ARGUMENT, "prefill needs at least one token");
    if (n > s->n_ctx) return fail(s, WS_ERR_CONTEXT_FULL, "%d tokens exceed the context of %d", n, s->n_ctx);
    int32_t *seq = s->toks;
    if (pend) seq[0] = ss->pending;
    if (n_tokens > 0) memcpy(seq + pend, tokens, sizeof(int32_t) * (size_t)n_tokens);
    TRY(target_decode(s, slot, seq, n, s->t_logits, "prefill"));
    ss->pending = -1;
    ss->lag_ok += pend; /* the pending token was generated, not prompt */
    if (with_draft && s->dft) {
        int32_t done = 0;
        TRY(draft_catch_up(s, slot, kv_len(s->tgt, slot), NULL, &done));
        ss->c.n_draft_prefill += (uint64_t)(done > ss->lag_ok ? done - ss->lag_ok : 0);
        ss->lag_ok = 0;
    }
    const int32_t nh = load_hist(s, slot, sp);
    ss->pending = sample_logits(s, ss, penalize(s, s->t_logits, sp, hist_of(s, slot), nh), sp);
    record_logprobs(s, slot, 0, s->t_logits, ss->pending, sp);
    *token_out = ss->pending;
    return WS_OK;
}

/* a scratch buffer of at least `need` floats (grown, never shrunk) */
static ws_status grow_floats(ws_spec *s, float **buf, size_t *cap, size_t need) {
    if (*cap >= need) return WS_OK;
    float *nb = realloc(*buf, sizeof(float) * need);
    if (!nb) return fail(s, WS_ERR_OUT_OF_MEMORY, "out of memory for %zu floats of logits", need);
    *buf = nb;
    *cap = need;
    return WS_OK;
}

/* the proposals a step has room for: within max_new and the context */
static int32_t step_room(const ws_spec *s, int32_t max_new, int32_t n0) {
    const int32_t room = max_new - 1 < s->n_ctx - n0 - 1 ? max_new - 1 : s->n_ctx - n0 - 1;
    return room < WS_SPEC_MAX_DRAFT ? room : WS_SPEC_MAX_DRAFT;
}

/* the draft model's proposals allowed to a slot this step: n_max within the room */
static int32_t step_k_max(const ws_spec *s, const ws_spec_params *pp, int32_t max_new,
                          int32_t n0) {
    const int32_t room = step_room(s, max_new, n0);
    const int32_t k_max = pp && s->dft ? pp->n_max : 0;
    return k_max < room ? k_max : room;
}

/* the length (0: none) of the longest suffix of toks[0..n), at most
   WS_SPEC_LOOKUP_MAX_MATCH tokens, that occurs earlier, and in *end the end
   (exclusive) of its most recent earlier occurrence. O(n) compares. */
static int32_t lookup_match(const int32_t *toks, int32_t n, int32_t *end) {
    int32_t best_m = 0;
    *end = -1;
    if (n < 2) return 0;
    const int32_t last = toks[n - 1];
    /* e: the end (exclusive) of an earlier occurrence; toks[e] follows it */
    for (int32_t e = n - 1; e >= 1 && best_m < WS_SPEC_LOOKUP_MAX_MATCH; e--) {
        if (toks[e - 1] != last) continue;
        int32_t m = 1;
        while (m < WS_SPEC_LOOKUP_MAX_MATCH && m < e && toks[e - 1 - m] == toks[n - 1 - m]) m++;
        if (m > best_m) { /* strictly longer: the most recent of equal matches stays */
            best_m = m;
            *end = e;
        }
    }
    return best_m;
}

/* the k tokens that follow position end of toks[0..n), going on with its own
   proposals once the continuation reaches the end of toks */
static void lookup_continue(const int32_t *toks, int32_t n, int32_t end, int32_t k,
                            int32_t *drafts) {
    for (int32_t j = 0; j < k; j++) {
        const int32_t i = end + j;
        drafts[j] = i < n ? toks[i] : drafts[i - n];
    }
}

ws_status ws_spec_lookup(const int32_t *toks, int32_t n, int32_t min_match, int32_t k,
                         int32_t *drafts, int32_t *n_out) {
    if (!n_out) return WS_ERR_INVALID_ARGUMENT;
    *n_out = 0;
    if (n < 0 || k < 0 || k > WS_SPEC_MAX_DRAFT || min_match < 1 ||
        min_match > WS_SPEC_LOOKUP_MAX_MATCH || (n > 0 && !toks) || (k > 0 && !drafts))
        return WS_ERR_INVALID_ARGUMENT;
    int32_t end = -1;
    if (k > 0 && lookup_match(toks, n, &end) >= min_match) {
        lookup_continue(toks, n, end, k, drafts);
        *n_out = k;
    }
    return WS_OK;
}

/* whether the params turn the lookup drafter on */
static int lookup_on(const ws_spec_params *pp) {
    if (!pp) return 0;
    for (int m = 1; m <= WS_SPEC_LOOKUP_MAX_MATCH; m++)
        if (pp->lookup_k[m] > 0) return 1;
    return 0;
}

/* the lookup drafter's proposals for a slot's S (its target tokens and pending
   token), within room; their count; *match: the longest match found */
static int32_t lookup_step(ws_spec *s, int32_t slot, const ws_spec_params *pp, int32_t room,
                           int32_t *drafts, int32_t *match) {
    *match = 0;
    if (!lookup_on(pp) || room <= 0) return 0;
    int32_t n = 0, end = -1;
    ws_slot_tokens(s->tgt, slot, s->toks, (size_t)s->n_ctx, &n);
    s->toks[n++] = s->slots[slot].pending;
    *match = lookup_match(s->toks, n, &end);
    const int32_t k = *match ? (pp->lookup_k[*match] < room ? pp->lookup_k[*match] : room) : 0;
    lookup_continue(s->toks, n, end, k, drafts);
    return k;
}

/*
 * One drafting round of the head for nh slots: slot hb_slots[j] (step member
 * hb_idx[j]) decodes the pair (feature, hb_toks[j]) at its next position, the feature
 * its kept h_last in the first round, else the head's own last prediction (hg of the
 * member). The member's draft logits (d_logits, a dense vocabulary row) become the
 * head's over its token_ids, -inf elsewhere; its prediction goes to hg.
 */
static ws_status head_round(ws_spec *s, int32_t nh, int first) {
    const size_t E = (size_t)s->n_embd, K = (size_t)s->head_k, nv = (size_t)s->n_vocab;
    TRY(grow_floats(s, &s->fbuf, &s->fbuf_cap, (size_t)nh * E));
    TRY(grow_floats(s, &s->hbuf, &s->hbuf_cap, (size_t)nh * E));
    for (int32_t j = 0; j < nh; j++) {
        const float *f = first ? s->h_last + (size_t)s->hb_slots[j] * E
                               : s->hg + (size_t)s->hb_idx[j] * E;
        memcpy(s->fbuf + (size_t)j * E, f, sizeof(float) * E);
        s->hb_ntok[j] = 1;
    }
    const ws_decode_io io = {.features = s->fbuf, .features_cap = (size_t)nh * E,
                             .logits = s->hl, .logits_cap = (size_t)nh * K,
                             .hidden = s->hbuf, .hidden_cap = (size_t)nh * E};
    ws_status st = ws_decode_ex(s->head, nh, s->hb_slots, s->hb_ntok, s->hb_toks, &io);
    if (st != WS_OK) return fail_from(s, s->head, st, "head draft");
    for (int32_t j = 0; j < nh; j++) {
        const int32_t i = s->hb_idx[j];
        memcpy(s->hg + (size_t)i * E, s->hbuf + (size_t)j * E, sizeof(float) * E);
        float *row = s->d_logits + (size_t)i * nv;
        for (size_t v = 0; v < nv; v++) row[v] = -INFINITY;
        const float *hl = s->hl + (size_t)j * K;
        for (size_t k = 0; k < K; k++) row[s->head_ids[k]] = hl[k];
    }
    return WS_OK;
}

ws_status ws_spec_step_batch(ws_spec *s, int32_t n, const int32_t *slots,
                             const ws_sampling_params *sps, const ws_spec_params *pps,
                             const int32_t *max_new, int32_t *out, ws_spec_step_info *info) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    if (!slots || !sps || !out || !info || n <= 0 || n > s->n_slots)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "a multi-slot step takes 1..%d slots (got %d)",
                    s->n_slots, n);
    /* everything is checked before anything is decoded */
    for (int32_t i = 0; i < n; i++) {
        TRY(check_slot(s, slots[i]));
        for (int32_t j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return fail(s, WS_ERR_INVALID_ARGUMENT,
                            "slot %d appears twice in a multi-slot step", slots[i]);
        TRY(ws_spec_check_params(s, &sps[i], pps ? &pps[i] : NULL));
        if (s->slots[slots[i]].pending < 0)
            return fail(s, WS_ERR_BAD_STATE, "slot %d has no pending token: prefill it first",
                        slots[i]);
        if (max_new && max_new[i] < 1)
            return fail(s, WS_ERR_INVALID_ARGUMENT, "max_new %d must be >= 1", max_new[i]);
        if (kv_len(s->tgt, slots[i]) + 1 > s->n_ctx)
            return fail(s, WS_ERR_CONTEXT_FULL, "slot %d is full (%d positions)", slots[i],
                        s->n_ctx);
    }
    const int nv = s->n_vocab;
    const size_t per = WS_SPEC_MAX_DRAFT + 1;
    int any_draft = 0, any_sampled_draft = 0;
    struct step_member *mem = s->b_mem;
    for (int32_t i = 0; i < n; i++) {
        struct step_member *m = &mem[i];
        m->slot = slots[i];
        m->n0 = kv_len(s->tgt, slots[i]);
        const ws_spec_params *pp = pps ? &pps[i] : NULL;
        const int32_t mn = max_new ? max_new[i] : WS_SPEC_MAX_DRAFT + 1;
        m->drafting = 0;
        m->nh = load_hist(s, slots[i], &sps[i]); /* S and the pending token */
        /* the lookup drafter first: where it finds a match the draft model sits out */
        m->k = lookup_step(s, slots[i], pp, step_room(s, mn, m->n0), m->drafts, &info[i].match);
        m->lookup = m->k > 0;
        m->head = 0;
        m->acc = 0;
        if (m->lookup) {
            m->k_max = 0;
        } else if (pp && pp->head_n_max > 0 && head_ready(s, slots[i], m->n0)) {
            /* the feature head drafts instead of the draft model */
            const int32_t room = step_room(s, mn, m->n0);
            m->k_max = pp->head_n_max < room ? pp->head_n_max : room;
            m->head = m->k_max > 0;
        } else {
            m->k_max = step_k_max(s, pp, mn, m->n0);
        }
        if (m->nh)
            for (int32_t j = 0; j < m->k; j++) hist_of(s, slots[i])[m->nh + j] = m->drafts[j];
        any_draft |= m->k_max > 0;
        any_sampled_draft |= m->k_max > 0 && !is_greedy(&sps[i]);
    }
    if (any_draft) {
        TRY(grow_floats(s, &s->d_logits, &s->d_cap, (size_t)n * nv));
        TRY(grow_floats(s, &s->r_logits, &s->r_cap, (size_t)n * nv));
    }
    if (any_sampled_draft)
        TRY(grow_floats(s, &s->q, &s->q_cap, (size_t)n * WS_SPEC_MAX_DRAFT * nv));

    /* 1a. the head's first round: each head-drafting slot's pair (h_{n0-1}, pending) */
    int32_t nhd = 0;
    for (int32_t i = 0; i < n; i++) {
        struct step_member *m = &mem[i];
        if (!m->head) continue;
        s->hb_slots[nhd] = m->slot;
        s->hb_toks[nhd] = s->slots[m->slot].pending;
        s->hb_idx[nhd++] = i;
        m->drafting = 1;
    }
    if (nhd) TRY(head_round(s, nhd, 1));

    /* 1. each drafting slot's draft catches up with its pending token */
    for (int32_t i = 0; i < n; i++) {
        struct step_member *m = &mem[i];
        spec_slot *ss = &s->slots[m->slot];
        if (!(m->k_max > 0 && !m->head && ss->d_off <= m->n0)) continue;
        const int32_t dn = kv_len(s->dft, m->slot);
        int32_t done = 0;
        TRY(draft_catch_up(s, m->slot, m->n0 + 1, s->d_logits + (size_t)i * nv, &done));
        if (done == 0) m->k_max = 0; /* cannot happen while the draft lags the pending token */
        const int32_t behind = m->n0 - (ss->d_off + dn);
        if (behind > ss->lag_ok) ss->c.n_draft_prefill += (uint64_t)(behind - ss->lag_ok);
        ss->lag_ok = 0;
        m->drafting = m->k_max > 0;
    }

    /* 2. the drafts propose, one token per drafting slot per round; the drafts of a
          round are decoded together (one draft pass for all slots) */
    for (int r = 0; r < WS_SPEC_MAX_DRAFT; r++) {
        int32_t nd = 0;
        nhd = 0;
        for (int32_t i = 0; i < n; i++) {
            struct step_member *m = &mem[i];
            if (!m->drafting) continue;
            const ws_sampling_params *sp = &sps[i];
            const ws_spec_params *pp = &pps[i];
            spec_slot *ss = &s->slots[m->slot];
            int32_t *hist = hist_of(s, m->slot);
            /* the penalties see S, the pending token and this slot's proposals so far */
            const float *dl = penalize(s, s->d_logits + (size_t)i * nv, sp, hist,
                                       m->nh ? m->nh + m->k : 0);
            int32_t x;
            if (is_greedy(sp)) {
                if (pp->p_min > 0.0f && r >= pp->n_min && top_prob(dl, nv) < pp->p_min) {
                    m->drafting = 0;
                    continue;
                }
                x = argmax(dl, nv);
            } else {
                float *q = s->q + ((size_t)i * WS_SPEC_MAX_DRAFT + (size_t)r) * nv;
                build_dist(s, dl, sp, q);
                if (pp->p_min > 0.0f && r >= pp->n_min && q[argmax(q, nv)] < pp->p_min) {
                    m->drafting = 0;
                    continue;
                }
                x = sample_dense(q, nv, dense_sum(q, nv), ss->rng);
            }
            if (m->nh) hist[m->nh + m->k] = x;
            m->drafts[m->k++] = x;
            if (r + 1 < m->k_max && m->head) {
                s->hb_slots[nhd] = m->slot;
                s->hb_toks[nhd] = x;
                s->hb_idx[nhd++] = i;
            } else if (r + 1 < m->k_max) {
                s->b_slots[nd] = m->slot;
                s->b_toks[nd] = x;
                s->b_idx[nd] = i;
                nd++;
            } else {
                m->drafting = 0;
            }
        }
        if (nd == 0 && nhd == 0) break;
        if (nd) {
            ws_status st = ws_decode_multi(s->dft, s->b_slots, s->b_toks, nd, s->r_logits,
                                           (size_t)nd * nv);
            if (st != WS_OK) return fail_from(s, s->dft, st, "draft decode");
            for (int32_t j = 0; j < nd; j++)
                memcpy(s->d_logits + (size_t)s->b_idx[j] * nv, s->r_logits + (size_t)j * nv,
                       sizeof(float) * (size_t)nv);
        }
        if (nhd) TRY(head_round(s, nhd, 0));
    }

    /* 3. the target verifies every slot's pending token and proposals in one batch */
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        const struct step_member *m = &mem[i];
        int32_t *seg = s->b_toks + total;
        seg[0] = s->slots[m->slot].pending;
        memcpy(seg + 1, m->drafts, sizeof(int32_t) * (size_t)m->k);
        s->b_slots[i] = m->slot;
        s->b_ntok[i] = m->k + 1;
        mem[i].seg = total;
        total += (size_t)m->k + 1;
    }
    TRY(grow_floats(s, &s->t_logits, &s->t_cap, total * (size_t)nv));
    ws_decode_io io = {.logits = s->t_logits, .logits_cap = total * (size_t)nv};
    if (s->head) { /* the hidden states of every token, for the head to follow */
        TRY(grow_floats(s, &s->hbuf, &s->hbuf_cap, total * (size_t)s->n_embd));
        io.hidden = s->hbuf;
        io.hidden_cap = total * (size_t)s->n_embd;
    }
    ws_status st = ws_decode_ex(s->tgt, n, s->b_slots, s->b_ntok, s->b_toks, &io);
    if (st != WS_OK) return fail_from(s, s->tgt, st, "target decode");

    /* 4. per slot: accept the longest agreeing prefix, then one token of the target's */
    const float *rows = s->t_logits;
    for (int32_t i = 0; i < n; i++) {
        struct step_member *m = &mem[i];
        const ws_sampling_params *sp = &sps[i];
        const int32_t slot = m->slot, n0 = m->n0, k = m->k;
        spec_slot *ss = &s->slots[slot];
        const int32_t *hist = hist_of(s, slot);
        const int32_t nh = m->nh;
        int a = 0;
        int32_t bonus = -1;
        for (; a < k; a++) {
            const float *row = penalize(s, rows + (size_t)a * nv, sp, hist, nh ? nh + a : 0);
            if (is_greedy(sp)) {
                const int32_t t = argmax(row, nv);
                if (t != m->drafts[a]) {
                    bonus = t;
                    break;
                }
            } else if (m->lookup) {
                /* a certain proposal (q = 1): kept with probability p(x), else a draw
                   from p without x */
                build_dist(s, row, sp, s->p);
                const int32_t x = m->drafts[a];
                if (rng_uniform(ss->rng) < (double)s->p[x]) continue;
                s->p[x] = 0.0f;
                double tot = dense_sum(s->p, nv);
                if (tot <= 0.0) { /* p(x) == 1 was kept above: cannot happen */
                    build_dist(s, row, sp, s->p);
                    tot = dense_sum(s->p, nv);
                }
                bonus = sample_dense(s->p, nv, tot, ss->rng);
                break;
            } else {
                const float *q = s->q + ((size_t)i * WS_SPEC_MAX_DRAFT + (size_t)a) * nv;
                build_dist(s, row, sp, s->p);
                const int32_t x = m->drafts[a];
                const double ratio = q[x] > 0.0f ? (double)s->p[x] / (double)q[x] : 0.0;
                if (rng_uniform(ss->rng) < ratio) continue;
                double tot = 0.0;
                for (int v = 0; v < nv; v++) {
                    const float d = s->p[v] - q[v];
                    s->p[v] = d > 0.0f ? d : 0.0f;
                    tot += s->p[v];
                }
                if (tot <= 0.0) { /* p == q: the residual is empty, draw from p */
                    build_dist(s, row, sp, s->p);
                    tot = dense_sum(s->p, nv);
                }
                bonus = sample_dense(s->p, nv, tot, ss->rng);
                break;
            }
        }
        if (a == k)
            bonus = sample_logits(s, ss, penalize(s, rows + (size_t)k * nv, sp, hist,
                                                  nh ? nh + k : 0), sp);
        for (int j = 0; j <= a; j++)  /* logprobs of the raw target rows */
            record_logprobs(s, slot, j, rows + (size_t)j * nv, j < a ? m->drafts[j] : bonus, sp);
        rows += (size_t)(k + 1) * nv;

        /* roll both caches back to the accepted length */
        ws_slot_truncate(s->tgt, slot, n0 + 1 + a);
        m->acc = a;
        /* the head keeps its true pair n0 - 1 (h_{n0-1}, pending), not its drafted ones */
        if (m->head) ws_slot_truncate(s->head, slot, n0);
        if (s->dft && k > 0 && !m->lookup && !m->head) {
            const int32_t dlen = kv_len(s->dft, slot); /* holds up to d_off + dlen = n0 + k */
            const int32_t keep = n0 + 1 + a - ss->d_off;
            if (dlen > keep) ws_slot_truncate(s->dft, slot, keep);
            ss->lag_ok = (n0 + 1 + a) - (ss->d_off + kv_len(s->dft, slot));
        } else if (s->dft && (m->k_max == 0 || m->head)) {
            ss->lag_ok += a + 1; /* the draft sat this step out: generated tokens to see */
        }
        int32_t *o = out + (size_t)i * per;
        for (int j = 0; j < a; j++) o[j] = m->drafts[j];
        o[a] = bonus;
        ss->pending = bonus;
        ss->c.n_steps++;
        ss->c.n_drafted += (uint64_t)k;
        ss->c.n_accepted += (uint64_t)a;
        for (int j = 0; j < k; j++) ss->c.drafted_at[j]++;
        for (int j = 0; j < a; j++) ss->c.accepted_at[j]++;
        info[i].n_out = a + 1;
        info[i].n_drafted = k;
        info[i].drafter = k == 0 ? WS_DRAFTER_NONE : m->lookup ? WS_DRAFTER_LOOKUP
                          : m->head ? WS_DRAFTER_HEAD : WS_DRAFTER_MODEL;
    }
    /* 5. the head follows the accepted tokens: their pairs from the true hidden states */
    if (s->head) {
        for (int32_t i = 0; i < n; i++) {
            s->hf_at[i] = mem[i].n0;
            s->hf_cnt[i] = mem[i].acc + 1;
            s->hf_tokp[i] = s->b_toks + mem[i].seg;
            s->hf_hidp[i] = s->hbuf + mem[i].seg * (size_t)s->n_embd;
        }
        TRY(head_follow(s, n, slots, s->hf_at, s->hf_cnt, s->hf_tokp, s->hf_hidp));
    }
    return WS_OK;
}

ws_status ws_spec_step(ws_spec *s, int32_t slot, const ws_sampling_params *sp,
                       const ws_spec_params *pp, int32_t max_new, int32_t *out, size_t cap,
                       int32_t *n_out) {
    if (!s || !sp || !pp || !out || !n_out) return WS_ERR_INVALID_ARGUMENT;
    *n_out = 0;
    TRY(check_slot(s, slot));
    TRY(ws_spec_check_params(s, sp, pp));
    if (s->slots[slot].pending < 0)
        return fail(s, WS_ERR_BAD_STATE, "slot %d has no pending token: prefill it first", slot);
    if (max_new < 1) return fail(s, WS_ERR_INVALID_ARGUMENT, "max_new %d must be >= 1", max_new);
    const int32_t n0 = kv_len(s->tgt, slot);
    if (n0 + 1 > s->n_ctx)
        return fail(s, WS_ERR_CONTEXT_FULL, "slot %d is full (%d positions)", slot, s->n_ctx);
    const int32_t k_model = step_k_max(s, pp, max_new, n0);
    const int32_t k_head = s->head && pp->head_n_max > 0 ? step_room(s, max_new, n0) : 0;
    const int32_t k_max = lookup_on(pp) ? step_room(s, max_new, n0)
                                        : k_model > k_head ? k_model : k_head;
    if (cap < (size_t)(k_max + 1))
        return fail(s, WS_ERR_BUFFER_TOO_SMALL, "output buffer holds %zu tokens, %d needed", cap,
                    k_max + 1);
    ws_spec_step_info info;
    TRY(ws_spec_step_batch(s, 1, &slot, sp, pp, &max_new, s->b_out, &info));
    memcpy(out, s->b_out, sizeof(int32_t) * (size_t)info.n_out);
    *n_out = info.n_out;
    return WS_OK;
}

ws_status ws_spec_step_multi(ws_spec *s, const int32_t *slots, const ws_sampling_params *sps,
                             int32_t n, int32_t *out) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    if (!out) return fail(s, WS_ERR_INVALID_ARGUMENT, "a multi-slot step needs an output buffer");
    ws_spec_step_info info[WS_MAX_SLOTS]; /* n <= n_slots <= WS_MAX_SLOTS, checked by the step */
    TRY(ws_spec_step_batch(s, n, slots, sps, NULL, NULL, s->b_out, info));
    for (int32_t i = 0; i < n; i++) out[i] = s->b_out[(size_t)i * (WS_SPEC_MAX_DRAFT + 1)];
    return WS_OK;
}

ws_status ws_spec_commit(ws_spec *s, int32_t slot) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(s, slot));
    spec_slot *ss = &s->slots[slot];
    if (ss->pending < 0) return WS_OK;
    const int32_t n0 = kv_len(s->tgt, slot);
    if (n0 + 1 > s->n_ctx)
        return fail(s, WS_ERR_CONTEXT_FULL, "slot %d is full (%d positions)", slot, s->n_ctx);
    /* a draft that only lags by drafting work follows; one further behind waits for a prefill */
    int follow = 0;
    if (s->dft) {
        const int32_t behind = n0 - (ss->d_off + kv_len(s->dft, slot));
        follow = ss->d_off <= n0 && behind <= ss->lag_ok;
    }
    TRY(target_decode(s, slot, &ss->pending, 1, NULL, "commit"));
    ss->pending = -1;
    if (follow) {
        int32_t done = 0;
        TRY(draft_catch_up(s, slot, n0 + 1, NULL, &done));
        ss->lag_ok = 0;
    } else if (s->dft) {
        ss->lag_ok += 1;
    }
    return WS_OK;
}

ws_status ws_spec_truncate(ws_spec *s, int32_t slot, int32_t n) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(s, slot));
    spec_slot *ss = &s->slots[slot];
    const int32_t tn = kv_len(s->tgt, slot);
    const int32_t len = tn + (ss->pending >= 0);
    if (n < 0 || n > len)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "cannot truncate slot %d of %d tokens to %d", slot,
                    len, n);
    if (n == len) return WS_OK;
    /* with a head, a cut into the KV keeps n - 1 tokens and the n-th as the pending
       token: its decode gives back h_{n-1}, which the head needs and no slot keeps */
    const int keep_last = s->head && n > 0 && n < tn;
    int32_t last = -1;
    if (keep_last) ws_slot_tokens(s->tgt, slot, s->toks, (size_t)s->n_ctx + 1, &last);
    if (keep_last) last = s->toks[n - 1];
    if (n < tn) { /* first, so a refusal (a window the rings lost) changes nothing */
        ws_status st = ws_slot_truncate(s->tgt, slot, keep_last ? n - 1 : n);
        if (st != WS_OK) return fail_from(s, s->tgt, st, "truncate");
    }
    ss->pending = last;
    if (s->head) {
        if (n == 0) {
            ws_slot_clear(s->head, slot);
            ss->head_stale = 0;
            ss->h_ok = 0;
        } else if (keep_last) {
            /* the pairs 0..n-2 stay (true ones); h_{n-1} comes with the pending decode */
            if (kv_len(s->head, slot) > n - 1) ws_slot_truncate(s->head, slot, n - 1);
            ss->h_ok = 0;
        }
    }
    if (s->dft) {
        const int32_t nk = keep_last ? n - 1 : n; /* the target's KV tokens now */
        int32_t dmin = 0;
        ws_slot_keep_min(s->dft, slot, &dmin);
        if (nk < ss->d_off || (nk - ss->d_off > 0 && nk - ss->d_off < dmin)) {
            /* before the draft's start, or a window its rings lost: it starts empty here */
            ws_slot_clear(s->dft, slot);
            ss->d_off = nk;
        } else if (kv_len(s->dft, slot) > nk - ss->d_off) {
            ws_slot_truncate(s->dft, slot, nk - ss->d_off);
        }
        const int32_t behind = nk - (ss->d_off + kv_len(s->dft, slot));
        if (behind < ss->lag_ok) ss->lag_ok = behind;
    }
    return WS_OK;
}

ws_status ws_spec_clear(ws_spec *s, int32_t slot) {
    if (!s) return WS_ERR_INVALID_ARGUMENT;
    TRY(check_slot(s, slot));
    s->slots[slot].pending = -1;
    ws_slot_clear(s->tgt, slot);
    if (s->dft) ws_slot_clear(s->dft, slot);
    if (s->head) ws_slot_clear(s->head, slot);
    s->slots[slot].h_ok = 0;
    s->slots[slot].head_stale = 0;
    s->slots[slot].d_off = 0;
    s->slots[slot].lag_ok = 0;
    return WS_OK;
}

/* ------------------------------------------------------------------------- */
/* draft state: spec header then the draft context's slot state                */

#define SPEC_HEADER_BYTES WS_SPEC_STATE_HEADER_BYTES
_Static_assert(SPEC_HEADER_BYTES == 4u * 4u + 8u * 4u + 8u * (4u + 2u * WS_SPEC_MAX_DRAFT),
               "WS_SPEC_STATE_HEADER_BYTES is the size of the fields ws_spec_state_get writes");

static void put32(uint8_t **p, uint32_t v) {
    for (int i = 0; i < 4; i++) (*p)[i] = (uint8_t)(v >> (8 * i));
    *p += 4;
}
static void put64(uint8_t **p, uint64_t v) {
    for (int i = 0; i < 8; i++) (*p)[i] = (uint8_t)(v >> (8 * i));
    *p += 8;
}
static uint32_t get32(const uint8_t **p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)(*p)[i] << (8 * i);
    *p += 4;
    return v;
}
static uint64_t get64(const uint8_t **p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)(*p)[i] << (8 * i);
    *p += 8;
    return v;
}

/* the head's part of a version-2 draft state: h_last, then the head's slot state */
#define SPEC_EXT_BYTES WS_SPEC_STATE_EXT_BYTES
#define SPEC_PART_DRAFT 1u
#define SPEC_PART_HEAD 2u

ws_status ws_spec_state_size(const ws_spec *s, int32_t slot, size_t *size_out) {
    TRY(check_slot_out(s, slot, size_out));
    if (!s->dft && !s->head)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "no draft model or head: there is no draft state");
    size_t kv = 0, hk = 0;
    if (s->dft) {
        ws_status st = ws_slot_state_size(s->dft, slot, &kv);
        if (st != WS_OK) return fail_from((ws_spec *)s, s->dft, st, "draft state");
    }
    if (!s->head) {
        *size_out = SPEC_HEADER_BYTES + kv;
        return WS_OK;
    }
    ws_status st = ws_slot_state_size(s->head, slot, &hk);
    if (st != WS_OK) return fail_from((ws_spec *)s, s->head, st, "head state");
    *size_out = SPEC_HEADER_BYTES + SPEC_EXT_BYTES + kv + sizeof(float) * (size_t)s->n_embd + hk;
    return WS_OK;
}

ws_status ws_spec_state_get(const ws_spec *s, int32_t slot, uint8_t *buf, size_t cap,
                            size_t *written_out) {
    if (!s || !written_out) return WS_ERR_INVALID_ARGUMENT;
    *written_out = 0;
    size_t need = 0;
    TRY(ws_spec_state_size(s, slot, &need));
    if (!buf || cap < need)
        return fail(s, WS_ERR_BUFFER_TOO_SMALL, "state buffer holds %zu bytes, %zu needed", cap,
                    need);
    const spec_slot *ss = &s->slots[slot];
    uint8_t *p = buf;
    put32(&p, WS_SPEC_STATE_MAGIC);
    put32(&p, s->head ? WS_SPEC_STATE_VERSION : 1u); /* version 1 without a head */
    put32(&p, (uint32_t)ss->d_off);
    put32(&p, (uint32_t)ss->lag_ok);
    for (int i = 0; i < 4; i++) put64(&p, ss->rng[i]);
    put64(&p, ss->c.n_steps);
    put64(&p, ss->c.n_drafted);
    put64(&p, ss->c.n_accepted);
    put64(&p, ss->c.n_draft_prefill);
    for (int i = 0; i < WS_SPEC_MAX_DRAFT; i++) put64(&p, ss->c.drafted_at[i]);
    for (int i = 0; i < WS_SPEC_MAX_DRAFT; i++) put64(&p, ss->c.accepted_at[i]);
    size_t kv = 0, hk = 0;
    if (s->dft) ws_slot_state_size(s->dft, slot, &kv);
    if (s->head) {
        ws_slot_state_size(s->head, slot, &hk);
        const int head_ok = !ss->head_stale;
        put32(&p, (s->dft ? SPEC_PART_DRAFT : 0u) | (head_ok ? SPEC_PART_HEAD : 0u));
        put32(&p, (uint32_t)(head_ok && ss->h_ok));
        put64(&p, kv);
        put64(&p, head_ok ? sizeof(float) * (size_t)s->n_embd + hk : 0u);
        put32(&p, (uint32_t)s->head_k);
        put32(&p, (uint32_t)s->n_embd);
        if (!head_ok) need -= sizeof(float) * (size_t)s->n_embd + hk;
    }
    if (s->dft) {
        size_t w = 0;
        ws_status st = ws_slot_state_get(s->dft, slot, p, kv, &w);
        if (st != WS_OK) return fail_from((ws_spec *)s, s->dft, st, "draft state");
        p += kv;
    }
    if (s->head && !ss->head_stale) {
        memcpy(p, s->h_last + (size_t)slot * (size_t)s->n_embd,
               sizeof(float) * (size_t)s->n_embd);
        p += sizeof(float) * (size_t)s->n_embd;
        size_t w = 0;
        ws_status st = ws_slot_state_get(s->head, slot, p, hk, &w);
        if (st != WS_OK) return fail_from((ws_spec *)s, s->head, st, "head state");
    }
    *written_out = need;
    return WS_OK;
}

/* The draft context's part of a draft state (len bytes at p): loaded, and checked to
 * hold target positions [d_off, d_off + dn) of the slot's tokens; on failure the draft
 * slot is left empty. */
static ws_status load_draft_kv(ws_spec *s, int32_t slot, const uint8_t *p, size_t len,
                               int32_t d_off, size_t *read) {
    const int32_t tn = kv_len(s->tgt, slot);
    ws_status st = ws_slot_state_set(s->dft, slot, p, len, read);
    if (st != WS_OK) return fail_from(s, s->dft, st, "draft state");
    const int32_t dn = kv_len(s->dft, slot);
    int32_t got = 0;
    if (d_off + dn > tn) {
        ws_slot_clear(s->dft, slot);
        return fail(s, WS_ERR_BAD_STATE, "draft state holds %d tokens past offset %d, the target %d",
                    dn, d_off, tn);
    }
    if (tn > 0) ws_slot_tokens(s->tgt, slot, s->toks, (size_t)s->n_ctx + 1, &got);
    int32_t *dt = malloc(sizeof(int32_t) * (size_t)(dn > 0 ? dn : 1));
    if (!dt) {
        ws_slot_clear(s->dft, slot);
        return fail(s, WS_ERR_OUT_OF_MEMORY, "out of memory checking the draft state");
    }
    if (dn > 0) ws_slot_tokens(s->dft, slot, dt, (size_t)dn, &got);
    const int same = dn == 0 || memcmp(dt, s->toks + d_off, sizeof(int32_t) * (size_t)dn) == 0;
    free(dt);
    if (!same) {
        ws_slot_clear(s->dft, slot);
        return fail(s, WS_ERR_BAD_STATE, "draft state tokens are not the target's tokens");
    }
    return WS_OK;
}

/* The head's part of a version-2 draft state (h_last, then the head's slot state, len
 * bytes at p): it must hold the pairs 0..n-2 of the slot's n target tokens (its tokens
 * the target's from position 1), and h_last finite. On failure the head is stale. */
static ws_status load_head_kv(ws_spec *s, int32_t slot, const uint8_t *p, size_t len,
                              uint32_t h_ok) {
    const size_t E = (size_t)s->n_embd;
    const int32_t tn = kv_len(s->tgt, slot);
    float *hl = s->h_last + (size_t)slot * E;
    if (len < sizeof(float) * E)
        return fail(s, WS_ERR_BAD_STATE, "head state of %zu bytes is shorter than its h", len);
    memcpy(hl, p, sizeof(float) * E);
    for (size_t i = 0; i < E; i++)
        if (!isfinite(hl[i]))
            return fail(s, WS_ERR_BAD_STATE, "head state hidden value %zu is not finite", i);
    size_t read = 0;
    ws_status st = ws_slot_state_set(s->head, slot, p + sizeof(float) * E,
                                     len - sizeof(float) * E, &read);
    if (st != WS_OK) {
        head_stale(s, slot);
        return fail_from(s, s->head, st, "head state");
    }
    const int32_t hn = kv_len(s->head, slot);
    int32_t got = 0;
    if (hn != (tn > 0 ? tn - 1 : 0) || (tn > 0 && !h_ok)) {
        head_stale(s, slot);
        return fail(s, WS_ERR_BAD_STATE, "head state holds %d pairs, a slot of %d tokens %d",
                    hn, tn, tn > 0 ? tn - 1 : 0);
    }
    if (hn > 0) {
        int32_t *ht = malloc(sizeof(int32_t) * (size_t)hn);
        if (!ht) {
            head_stale(s, slot);
            return fail(s, WS_ERR_OUT_OF_MEMORY, "out of memory checking the head state");
        }
        ws_slot_tokens(s->tgt, slot, s->toks, (size_t)s->n_ctx + 1, &got);
        ws_slot_tokens(s->head, slot, ht, (size_t)hn, &got);
        const int same = memcmp(ht, s->toks + 1, sizeof(int32_t) * (size_t)hn) == 0;
        free(ht);
        if (!same) {
            head_stale(s, slot);
            return fail(s, WS_ERR_BAD_STATE, "head state tokens are not the target's tokens");
        }
    }
    s->slots[slot].h_ok = tn > 0;
    s->slots[slot].head_stale = 0;
    return WS_OK;
}

ws_status ws_spec_state_set(ws_spec *s, int32_t slot, const uint8_t *buf, size_t len,
                            size_t *read_out) {
    if (!s || !read_out) return WS_ERR_INVALID_ARGUMENT;
    *read_out = 0;
    TRY(check_slot(s, slot));
    if (!s->dft && !s->head)
        return fail(s, WS_ERR_INVALID_ARGUMENT, "no draft model or head: there is no draft state");
    spec_slot *ss = &s->slots[slot];
    const int32_t tn = kv_len(s->tgt, slot);
    /* any failure below leaves the draft empty and a head stale (unless the slot is empty) */
    if (s->dft) ws_slot_clear(s->dft, slot);
    if (s->head) {
        ws_slot_clear(s->head, slot);
        ss->h_ok = 0;
        ss->head_stale = tn > 0;
    }
    ss->d_off = tn;
    ss->lag_ok = 0;
    if (!buf || len < SPEC_HEADER_BYTES)
        return fail(s, WS_ERR_BAD_STATE, "draft state of %zu bytes is shorter than its header", len);
    const uint8_t *p = buf;
    const uint32_t magic = get32(&p), version = get32(&p);
    if (magic != WS_SPEC_STATE_MAGIC)
        return fail(s, WS_ERR_BAD_STATE, "draft state magic 0x%08x is not WSSP", magic);
    if (version < 1 || version > WS_SPEC_STATE_VERSION)
        return fail(s, WS_ERR_BAD_STATE, "draft state version %u is not supported (1..%u)",
                    version, WS_SPEC_STATE_VERSION);
    const int32_t d_off = (int32_t)get32(&p), lag_ok = (int32_t)get32(&p);
    uint64_t rng[4];
    for (int i = 0; i < 4; i++) rng[i] = get64(&p);
    ws_spec_counters c;
    c.n_steps = get64(&p);
    c.n_drafted = get64(&p);
    c.n_accepted = get64(&p);
    c.n_draft_prefill = get64(&p);
    for (int i = 0; i < WS_SPEC_MAX_DRAFT; i++) c.drafted_at[i] = get64(&p);
    for (int i = 0; i < WS_SPEC_MAX_DRAFT; i++) c.accepted_at[i] = get64(&p);
    if (!(rng[0] | rng[1] | rng[2] | rng[3]))
        return fail(s, WS_ERR_BAD_STATE, "draft state RNG is all zero");
    if (d_off < 0 || d_off > tn || lag_ok < 0 || lag_ok > tn)
        return fail(s, WS_ERR_BAD_STATE, "draft state offset %d / lag %d do not fit a slot of %d",
                    d_off, lag_ok, tn);
    uint32_t parts = SPEC_PART_DRAFT, h_ok = 0;
    uint64_t draft_bytes = len - SPEC_HEADER_BYTES, head_bytes = 0;
    if (version >= 2) {
        if (len < SPEC_HEADER_BYTES + SPEC_EXT_BYTES)
            return fail(s, WS_ERR_BAD_STATE, "draft state of %zu bytes is shorter than its header",
                        len);
        parts = get32(&p);
        h_ok = get32(&p);
        draft_bytes = get64(&p);
        head_bytes = get64(&p);
        const uint32_t k = get32(&p), e = get32(&p);
        if (parts > (SPEC_PART_DRAFT | SPEC_PART_HEAD) || h_ok > 1 ||
            draft_bytes > len || head_bytes > len ||
            SPEC_HEADER_BYTES + SPEC_EXT_BYTES + draft_bytes + head_bytes != len ||
            (!(parts & SPEC_PART_DRAFT) && draft_bytes) || (!(parts & SPEC_PART_HEAD) && head_bytes))
            return fail(s, WS_ERR_BAD_STATE, "draft state parts (%u: %llu + %llu bytes) do not "
                        "make its %zu bytes", parts, (unsigned long long)draft_bytes,
                        (unsigned long long)head_bytes, len);
        if ((parts & SPEC_PART_HEAD) && s->head &&
            (k != (uint32_t)s->head_k || e != (uint32_t)s->n_embd))
            return fail(s, WS_ERR_BAD_STATE, "draft state of a head of %u x %u, this head is "
                        "%d x %d", k, e, s->head_k, s->n_embd);
    }
    if (s->dft && !(parts & SPEC_PART_DRAFT))
        return fail(s, WS_ERR_BAD_STATE, "draft state holds no draft-model KV");
    size_t kv_read = 0;
    if (s->dft) TRY(load_draft_kv(s, slot, p, (size_t)draft_bytes, d_off, &kv_read));
    p += draft_bytes;
    if (s->head && (parts & SPEC_PART_HEAD)) {
        ws_status st = load_head_kv(s, slot, p, (size_t)head_bytes, h_ok);
        if (st != WS_OK) {
            if (s->dft) ws_slot_clear(s->dft, slot);
            return st;
        }
    }
    if (s->dft) {
        const int32_t dn = kv_len(s->dft, slot);
        ss->d_off = d_off;
        ss->lag_ok = lag_ok < tn - (d_off + dn) ? lag_ok : tn - (d_off + dn);
    }
    memcpy(ss->rng, rng, sizeof rng);
    ss->c = c;
    *read_out = len;
    return WS_OK;
}

/* ------------------------------------------------------------------------- */
/* the whole slot: target and draft state together                          */

ws_status ws_spec_slot_state_prepare(ws_spec *s, int32_t slot, size_t *target_size,
                                     size_t *draft_size) {
    if (!s || !target_size || !draft_size) return WS_ERR_INVALID_ARGUMENT;
    *target_size = *draft_size = 0;
    TRY(ws_spec_commit(s, slot));
    ws_status st = ws_slot_state_size(s->tgt, slot, target_size);
    if (st != WS_OK) return fail_from(s, s->tgt, st, "target state");
    if (s->dft || s->head) TRY(ws_spec_state_size(s, slot, draft_size));
    return WS_OK;
}

ws_status ws_spec_slot_state_get(const ws_spec *s, int32_t slot, uint8_t *tbuf, size_t tcap,
                                 size_t *t_written, uint8_t *dbuf, size_t dcap,
                                 size_t *d_written) {
    if (!s || !t_written || !d_written) return WS_ERR_INVALID_ARGUMENT;
    *t_written = *d_written = 0;
    TRY(check_slot(s, slot));
    if (s->slots[slot].pending >= 0)
        return fail(s, WS_ERR_BAD_STATE, "slot %d holds a pending token: prepare it first", slot);
    ws_status st = ws_slot_state_get(s->tgt, slot, tbuf, tcap, t_written);
    if (st != WS_OK) return fail_from((ws_spec *)s, s->tgt, st, "target state");
    if (s->dft || s->head) {
        st = ws_spec_state_get(s, slot, dbuf, dcap, d_written);
        if (st != WS_OK) *t_written = 0;
        return st;
    }
    return WS_OK;
}

ws_status ws_spec_slot_state_set(ws_spec *s, int32_t slot, const uint8_t *header,
                                 size_t header_len, const uint8_t *tokens, size_t tokens_len,
                                 const uint8_t *kv, size_t kv_len_, const uint8_t *dbuf,
                                 size_t dlen, int32_t draft_offset, int *draft_loaded) {
    if (!s || !draft_loaded) return WS_ERR_INVALID_ARGUMENT;
    *draft_loaded = 0;
    TRY(ws_spec_clear(s, slot));
    size_t read = 0;
    ws_status st = ws_slot_state_set_parts(s->tgt, slot, header, header_len, tokens, tokens_len,
                                           kv, kv_len_, &read);
    if (st != WS_OK) {
        fail_from(s, s->tgt, st, "target state");
        ws_spec_clear(s, slot);
        return st;
    }
    const int32_t tn = kv_len(s->tgt, slot);
    if (draft_offset < 0 || draft_offset > tn) {
        ws_spec_clear(s, slot);
        return fail(s, WS_ERR_INVALID_ARGUMENT, "draft offset %d outside 0..%d", draft_offset, tn);
    }
    /* a restored slot's head has no pairs and no hidden states to build them from */
    if (s->head && tn > 0) head_stale(s, slot);
    if (!s->dft && !s->head) return WS_OK;
    s->last_error[0] = '\0';
    if (dbuf && ws_spec_state_set(s, slot, dbuf, dlen, &read) == WS_OK) {
        *draft_loaded = 1;
        return WS_OK;
    }
    return ws_spec_draft_reset(s, slot, draft_offset);
}
