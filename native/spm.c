/* SentencePiece-style BPE (a GGUF `llama` tokenizer: Gemma) as llama.cpp runs it: the
 * text's UTF-8 characters are the first symbols; the adjacent pair whose concatenation
 * is the highest-scoring token is merged (ties: the leftmost pair), repeatedly; a
 * symbol no token holds becomes the byte tokens of its UTF-8 bytes. The caller splits
 * the text at user-defined tokens and escapes spaces first (inference_svc/core/spm.py).
 * The vocabulary is a read-only hash table after ws_spm_init, so encodes may run on any
 * number of threads at once, without the Python GIL. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "warmslot.h"
#include "ws_mem.h"

struct ws_spm {
    char *blob;       /* every token's bytes, one after another */
    uint64_t *start;  /* [n_tokens + 1] token i is blob[start[i] .. start[i+1])  */
    float *scores;    /* [n_tokens] */
    int32_t *table;   /* [n_table] token id or -1: open addressing, linear probing */
    uint64_t mask;    /* n_table - 1 */
    int32_t n_tokens;
    int32_t byte_ids[256];
};

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* the id of the token whose bytes are s[0..n), or -1 */
static int32_t lookup(const ws_spm *spm, const char *s, size_t n) {
    for (uint64_t at = hash_bytes(s, n) & spm->mask;; at = (at + 1) & spm->mask) {
        const int32_t id = spm->table[at];
        if (id < 0) return -1;
        const uint64_t len = spm->start[id + 1] - spm->start[id];
        if (len == n && memcmp(spm->blob + spm->start[id], s, n) == 0) return id;
    }
}

void ws_spm_free(ws_spm *spm) {
    if (!spm) return;
    WS_FREE_ALL(spm->blob, spm->start, spm->scores, spm->table, spm);
}

ws_status ws_spm_init(const char *blob, const uint64_t *ends, const float *scores,
                      const int32_t *byte_ids, int32_t n_tokens, ws_spm **out) {
    if (!out) return WS_ERR_INVALID_ARGUMENT;
    *out = NULL;
    if (!blob || !ends || !scores || !byte_ids || n_tokens < 1 || n_tokens > (1 << 28))
        return WS_ERR_INVALID_ARGUMENT;
    for (int32_t i = 0; i < n_tokens; i++)
        if (i > 0 && ends[i] < ends[i - 1]) return WS_ERR_INVALID_ARGUMENT;
    for (int b = 0; b < 256; b++)
        if (byte_ids[b] < 0 || byte_ids[b] >= n_tokens) return WS_ERR_INVALID_ARGUMENT;
    const uint64_t n_blob = ends[n_tokens - 1];
    uint64_t n_table = 1;
    while (n_table < 2 * (uint64_t)n_tokens) n_table <<= 1;
    ws_spm *spm = calloc(1, sizeof *spm);
    if (!spm) return WS_ERR_OUT_OF_MEMORY;
    spm->blob = malloc(n_blob ? n_blob : 1);
    spm->start = malloc(((size_t)n_tokens + 1) * sizeof *spm->start);
    spm->scores = malloc((size_t)n_tokens * sizeof *spm->scores);
    spm->table = malloc(n_table * sizeof *spm->table);
    if (!spm->blob || !spm->start || !spm->scores || !spm->table) {
        ws_spm_free(spm);
        return WS_ERR_OUT_OF_MEMORY;
    }
    memcpy(spm->blob, blob, n_blob);
    memcpy(spm->scores, scores, (size_t)n_tokens * sizeof *scores);
    memcpy(spm->byte_ids, byte_ids, sizeof spm->byte_ids);
    spm->start[0] = 0;
    memcpy(spm->start + 1, ends, (size_t)n_tokens * sizeof *ends);
    memset(spm->table, 0xff, n_table * sizeof *spm->table);
    spm->mask = n_table - 1;
    spm->n_tokens = n_tokens;
    /* a later token with the same bytes replaces an earlier one (as a dict would) */
    for (int32_t id = 0; id < n_tokens; id++) {
        const char *s = spm->blob + spm->start[id];
        const size_t n = (size_t)(spm->start[id + 1] - spm->start[id]);
        uint64_t at = hash_bytes(s, n) & spm->mask;
        for (;; at = (at + 1) & spm->mask) {
            const int32_t other = spm->table[at];
            if (other < 0) break;
            const uint64_t len = spm->start[other + 1] - spm->start[other];
            if (len == n && memcmp(spm->blob + spm->start[other], s, n) == 0) break;
        }
        spm->table[at] = id;
    }
    *out = spm;
    return WS_OK;
}

/* 32-bit indices (a text is at most INT32_MAX bytes): 16 bytes a symbol and a pair */
typedef struct {
    int32_t prev, next; /* neighbouring symbols, -1 / n_sym at the ends */
    uint32_t at, n;     /* its bytes in the text; n = 0: merged into its left neighbour */
} spm_sym;

typedef struct {
    float score;
    int32_t left, right;
    uint32_t n; /* bytes of the merged pair when queued (a changed side makes it stale) */
} spm_pair;

/* a before b in the queue: higher score, then the leftmost */
static int pair_before(const spm_pair *a, const spm_pair *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void heap_push(spm_pair *heap, size_t *n, spm_pair p) {
    size_t i = (*n)++;
    while (i > 0) {
        const size_t up = (i - 1) / 2;
        if (!pair_before(&p, &heap[up])) break;
        heap[i] = heap[up];
        i = up;
    }
    heap[i] = p;
}

static spm_pair heap_pop(spm_pair *heap, size_t *n) {
    const spm_pair top = heap[0], last = heap[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= *n) break;
        if (child + 1 < *n && pair_before(&heap[child + 1], &heap[child])) child++;
        if (!pair_before(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (*n > 0) heap[i] = last;
    return top;
}

static void queue_pair(const ws_spm *spm, const char *text, const spm_sym *sym, int32_t n_sym,
                       int32_t left, int32_t right, spm_pair *heap, size_t *n_heap) {
    if (left < 0 || right >= n_sym) return;
    const uint32_t n = sym[left].n + sym[right].n;
    const int32_t id = lookup(spm, text + sym[left].at, n);
    if (id < 0) return;
    const spm_pair p = {spm->scores[id], left, right, n};
    heap_push(heap, n_heap, p);
}

/* bytes of the UTF-8 character that starts with byte c (a stray byte: 1) */
static size_t utf8_len(uint8_t c) {
    static const size_t lens[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lens[c >> 4];
}

ws_status ws_spm_encode(const ws_spm *spm, const char *text, size_t len, int32_t *out,
                        size_t cap, size_t *n_out) {
    if (!spm || !n_out || (!text && len) || (!out && cap) || len >= INT32_MAX)
        return WS_ERR_INVALID_ARGUMENT;
    *n_out = 0;
    if (len == 0) return WS_OK;
    /* at most one symbol per byte; each merge queues at most two pairs */
    spm_sym *sym = malloc(len * sizeof *sym);
    spm_pair *heap = malloc(3 * len * sizeof *heap);
    if (!sym || !heap) {
        free(sym);
        free(heap);
        return WS_ERR_OUT_OF_MEMORY;
    }
    int32_t n_sym = 0;
    for (size_t at = 0; at < len; n_sym++) {
        size_t n = utf8_len((uint8_t)text[at]);
        if (n > len - at) n = len - at;
        sym[n_sym] = (spm_sym){n_sym - 1, n_sym + 1, (uint32_t)at, (uint32_t)n};
        at += n;
    }
    size_t n_heap = 0;
    for (int32_t i = 0; i + 1 < n_sym; i++)
        queue_pair(spm, text, sym, n_sym, i, i + 1, heap, &n_heap);
    while (n_heap > 0) {
        const spm_pair p = heap_pop(heap, &n_heap);
        spm_sym *l = &sym[p.left], *r = &sym[p.right];
        if (l->n == 0 || r->n == 0 || l->next != p.right || l->n + r->n != p.n) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next < n_sym) sym[r->next].prev = p.left;
        queue_pair(spm, text, sym, n_sym, l->prev, p.left, heap, &n_heap);
        queue_pair(spm, text, sym, n_sym, p.left, l->next, heap, &n_heap);
    }
    size_t n_ids = 0;
    ws_status st = WS_OK;
    for (int32_t i = 0; i < n_sym; i = sym[i].next) {
        const int32_t id = lookup(spm, text + sym[i].at, sym[i].n);
        if (id >= 0) {
            if (n_ids < cap) out[n_ids] = id;
            n_ids++;
            continue;
        }
        for (uint32_t b = 0; b < sym[i].n; b++, n_ids++)
            if (n_ids < cap) out[n_ids] = spm->byte_ids[(uint8_t)text[sym[i].at + b]];
    }
    if (n_ids > cap) st = WS_ERR_BUFFER_TOO_SMALL;
    *n_out = n_ids;
    free(sym);
    free(heap);
    return st;
}
