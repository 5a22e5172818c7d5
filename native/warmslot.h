/*
 * warmslot.h - the Warmslot decoding core: a llama-family decoder over N slots.
 *
 * One public header. Conventions (after llama.h):
 *   - opaque handles, `ws_<object>_<verb>` names, `_init` / `_free` pairs;
 *   - every function that can fail returns a ws_status; the message of the
 *     last failure is kept per object (ws_context_last_error) and globally for
 *     model/context creation (ws_last_error);
 *   - buffers are owned by the caller and passed with their capacity; every
 *     length and count is validated, nothing is read or written out of bounds;
 *   - nothing calls exit() or abort().
 *
 * Numerics: every output element of every matrix product is one dot product
 * computed in a fixed order, whatever the batch size, slot or thread count.
 * Work is split over output rows (and attention heads), never over a reduction
 * axis, so the logits of a token are bit-identical however it was decoded.
 */
#ifndef WARMSLOT_H
#define WARMSLOT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WS_STATE_MAGIC   0x564b5357u /* "WSKV" little-endian */
/* state versions: 2 dtype f16 (and q8_0, which a reader without it refuses by its
   dtype) allowed; 3 sliding-window layers hold their last n_window positions only
   (versions 1 and 2 are still read) */
#define WS_STATE_VERSION 3u
#define WS_STATE_HEADER_BYTES 32u /* the slot state's header: 8 x u32 (ws_slot_state_get) */
#define WS_MAX_LAYERS    256
#define WS_MAX_THREADS   64
#define WS_MAX_SLOTS     1024

typedef enum {
    WS_OK = 0,
    WS_ERR_INVALID_ARGUMENT = 1, /* a bad parameter: null pointer, out-of-range value  */
    WS_ERR_OUT_OF_MEMORY = 2,    /* an allocation failed                                */
    WS_ERR_BUFFER_TOO_SMALL = 3, /* a caller buffer is smaller than what is needed      */
    WS_ERR_CONTEXT_FULL = 4,     /* the slot has no room for the tokens                 */
    WS_ERR_BAD_STATE = 5,        /* a state buffer is truncated, corrupt or mismatched  */
    WS_ERR_THREAD = 6,           /* a worker thread could not be started                */
} ws_status;

/* Architectures of the forward pass. */
typedef enum {
    WS_ARCH_LLAMA = 0,  /* the default: a zero-filled ws_hparams is a llama model      */
    WS_ARCH_GEMMA3 = 1, /* embedding scaled by sqrt(n_embd), QK-norm, NeoX RoPE, GeGLU
                           (gelu-tanh), post-attention and post-FFN norms, sliding-window
                           layers with their own RoPE base                              */
} ws_arch;

/* Hyper-parameters of a model. The fields after rope_theta default to 0 (llama). */
typedef struct {
    int32_t n_vocab;
    int32_t n_embd;      /* model width                                    */
    int32_t n_layer;
    int32_t n_head;      /* query heads                                    */
    int32_t n_head_kv;   /* key/value heads (n_head % n_head_kv == 0)       */
    int32_t n_ff;        /* feed-forward width                             */
    int32_t n_rot;       /* rotated dims per head (== head_dim here)       */
    float rms_eps;
    float rope_theta;    /* RoPE base (gemma3: of the global layers)        */
    int32_t arch;        /* ws_arch                                         */
    int32_t head_dim;    /* dims per head; 0: n_embd / n_head               */
    int32_t n_swa;       /* gemma3: sliding window (positions a local layer
                            attends to, itself included); 0: every layer global */
    int32_t swa_period;  /* gemma3: layer l is global when (l+1) % swa_period == 0 */
    float rope_theta_swa; /* gemma3: RoPE base of the local layers           */
} ws_hparams;

/* Tensor types the core computes with: the values of ggml's type enum, so a GGUF
 * tensor's type id is passed through as it is. */
#define WS_TYPE_F32  0
#define WS_TYPE_F16  1
#define WS_TYPE_Q4_0 2
#define WS_TYPE_Q4_1 3
#define WS_TYPE_Q5_0 6
#define WS_TYPE_Q8_0 8
#define WS_TYPE_Q4_K 12
#define WS_TYPE_Q5_K 13
#define WS_TYPE_Q6_K 14
#define WS_TYPE_BF16 30

/* A borrowed 2-D weight in its file type: `rows` rows of `cols` elements, each row
 * ws_type_row_bytes(type, cols) bytes, rows back to back. */
typedef struct {
    const void *data;
    int32_t type;  /* WS_TYPE_* */
    int32_t rows;
    int32_t cols;
} ws_tensor;

/* Bytes of one row of n elements of a type; 0 when the type is not supported or n
 * is not a whole number of its blocks. */
size_t ws_type_row_bytes(int32_t type, int64_t n);
/* The name of a type ("Q4_K"), or NULL when the core does not support it. */
const char *ws_type_name(int32_t type);
/* The matrix-product kernels this build compiled (its instruction set and tile shape),
 * e.g. "avx2+fma: 8-row vpmaddwd tiles", for benchmarks to name what they measured. */
const char *ws_kernel_path(void);

/* Row `row` of a tensor as floats (out: cols floats): the values every product uses.
 * reference: 1 unpacks with the scalar code, 0 with the build's kernels (the same bits). */
ws_status ws_tensor_dequantize(const ws_tensor *t, int32_t row, int reference, float *out,
                               size_t cap);
/* out[j][r] = the dot product of row r of t with x[j] ([nt][cols]), for every row r,
 * by the kernel a forward pass uses for a batch of nt tokens (out: [nt][rows]); for
 * the integer types over x quantized to 16 bits per block of 32 (quant.c). */
ws_status ws_tensor_matmul(const ws_tensor *t, const float *x, int32_t nt, float *out,
                           size_t cap);
/* Borrowed weights of one layer; matrices as [rows][cols], norms as F32. */
typedef struct {
    const float *attn_norm;   /* [n_embd]                          */
    ws_tensor wq;             /* [n_head*head_dim][n_embd]         */
    ws_tensor wk;             /* [n_head_kv*head_dim][n_embd]      */
    ws_tensor wv;             /* [n_head_kv*head_dim][n_embd]      */
    ws_tensor wo;             /* [n_embd][n_head*head_dim]         */
    const float *ffn_norm;    /* [n_embd]                          */
    ws_tensor w_gate;         /* [n_ff][n_embd]                    */
    ws_tensor w_up;           /* [n_ff][n_embd]                    */
    ws_tensor w_down;         /* [n_embd][n_ff]                    */
    /* gemma3 only (NULL for llama) */
    const float *attn_q_norm; /* [head_dim] RMSNorm of each query head */
    const float *attn_k_norm; /* [head_dim] RMSNorm of each key head   */
    const float *post_attn_norm; /* [n_embd] on the attention output   */
    const float *post_ffn_norm;  /* [n_embd] on the FFN output         */
} ws_layer_weights;

/* Borrowed weights of a model. They must outlive the model object. */
typedef struct {
    ws_tensor tok_embd;       /* [n_vocab][n_embd]                  */
    const float *output_norm; /* [n_embd]                           */
    ws_tensor output;         /* [n_vocab][n_embd]; data NULL: tied to tok_embd */
    const ws_layer_weights *layers; /* [n_layer], copied by ws_model_init */
    /* A feature head (docs/formats.md, warmslot-head): fc [n_embd][2 * n_embd], data
       NULL for a language model. A head's input of a token t paired with a feature
       vector f (ws_decode_io.features) is fc . concat(embedding of t, f); tok_embd is
       then its target's embedding ([target vocab][n_embd], any number of rows, the
       token ids a decode accepts), output must be its own ([n_vocab][n_embd]: n_vocab
       is the head's readout rows) and the architecture llama. */
    ws_tensor fc;
} ws_weights;

typedef struct ws_model ws_model;
typedef struct ws_context ws_context;

/* Element type of a context's KV cache; the value is the state header's dtype. */
typedef enum {
    WS_KV_F32 = 0,  /* keys and values kept as computed                          */
    WS_KV_F16 = 1,  /* rounded to IEEE half (nearest even) when written, read back
                       exactly as floats: half the memory and state size         */
    WS_KV_Q8_0 = 2, /* quantized once when written, in blocks of 32 values of one
                       head: llama.cpp's block_q8_0, 34 bytes (the scale d =
                       amax / 127 as IEEE half, then 32 int8 q = round(x / d)); read
                       back as the exact floats d * q: 17/32 of f16's memory and state
                       size. Needs a head_dim that is a multiple of 32.            */
} ws_kv_type;
/* KV types are 0 .. WS_KV_N_TYPES - 1 */
#define WS_KV_N_TYPES 3

/* The name of a KV type ("f32", "f16", "q8_0"), or NULL when it is not one. */
const char *ws_kv_type_name(int32_t kv_type);
/* Bytes n values of a KV type take (a q8_0 row: n / 32 blocks of 34 bytes); 0 when the
 * type is not one or n is not a whole number of its blocks. */
size_t ws_kv_type_bytes(int32_t kv_type, int64_t n);

typedef struct {
    int32_t n_slots;   /* independent sequences, each with its own KV cache */
    int32_t n_ctx;     /* positions per slot                                */
    int32_t n_threads; /* 1..WS_MAX_THREADS; the pool is created once       */
    int32_t n_batch;   /* largest batch one ws_decode call processes at once;
                          longer inputs are split internally                */
    int32_t reserve_kv; /* 1: write the whole KV cache at init, so its memory is
                           committed up front (a machine that cannot hold it fails
                           there, and no later decode or state set pays the first
                           touch of its pages); 0 (default): pages on first use  */
    int32_t kv_type;   /* ws_kv_type; default WS_KV_F16 (WS_KV_Q8_0: ws_context_init
                          refuses a model whose head_dim is not a multiple of 32)   */
    int32_t swa_full;  /* sliding-window layers (gemma3): 0 (default) keep a ring of
                          n_swa + WS_SWA_SPARE positions per layer and slot; 1 keep
                          all n_ctx positions, like a global layer. The logits are
                          bit-identical either way; see ws_slot_keep_min            */
} ws_context_params;

/* Positions a sliding-window layer's ring keeps beyond its window: a slot can drop its
 * last WS_SWA_SPARE + 1 tokens (a speculative verification rolled back, a stop string)
 * and continue exactly. */
#define WS_SWA_SPARE 16

/* The message of the last failed ws_model_init / ws_context_init (thread-local). */
const char *ws_last_error(void);

ws_context_params ws_context_default_params(void);

/* Validates hyper-parameters, pointers, tensor types and shapes; the weights are
 * borrowed. */
ws_status ws_model_init(const ws_hparams *hp, const ws_weights *w, ws_model **out);
void ws_model_free(ws_model *model);
const ws_hparams *ws_model_hparams(const ws_model *model);

/* Allocates the KV cache (n_slots x n_ctx positions) and starts the threads. */
ws_status ws_context_init(const ws_model *model, ws_context_params params, ws_context **out);
void ws_context_free(ws_context *ctx);
const char *ws_context_last_error(const ws_context *ctx);
ws_context_params ws_context_get_params(const ws_context *ctx);
const ws_model *ws_context_model(const ws_context *ctx);
/* Bytes the KV cache of this context takes (all slots). */
size_t ws_context_kv_bytes(const ws_context *ctx);
/* Bytes of KV cache ws_context_init allocates for this model and these parameters
 * (what ws_context_kv_bytes of that context returns): a sliding-window layer counts
 * the rows of its ring, not n_ctx. For a memory check before the context exists; the
 * parameters are not validated here (ws_context_init does), and a size past what the
 * machine can address fails with WS_ERR_OUT_OF_MEMORY. */
ws_status ws_context_kv_bytes_needed(const ws_model *model, ws_context_params params,
                                     uint64_t *out);

/* IEEE half <-> float conversions of the KV cache (the same bits in every build):
 * float -> half rounds to nearest even, overflows to infinity, keeps subnormals;
 * a NaN stays a NaN of the same sign (quiet, its top payload bits kept). Half ->
 * float is exact. Exposed so the tests can check them against numpy. */
void ws_fp16_from_fp32(const float *in, uint16_t *out, size_t n);
void ws_fp32_from_fp16(const uint16_t *in, float *out, size_t n);

/* Tokens held by a slot (its next position). */
ws_status ws_slot_n_tokens(const ws_context *ctx, int32_t slot, int32_t *n_out);
/* Copies up to cap tokens of the slot into out; *n_out gets the slot's count. */
ws_status ws_slot_tokens(const ws_context *ctx, int32_t slot, int32_t *out, size_t cap,
                         int32_t *n_out);

/*
 * Decodes n_tokens tokens for one slot at its current position and appends
 * them. logits_all == 0: writes the last token's logits (n_vocab floats);
 * otherwise every token's ([n_tokens][n_vocab]). logits_cap is the capacity
 * of `logits` in floats; logits NULL with logits_cap 0 computes none.
 * On any error the slot is left as it was.
 */
ws_status ws_decode(ws_context *ctx, int32_t slot, const int32_t *tokens, int32_t n_tokens,
                    int logits_all, float *logits, size_t logits_cap);

/*
 * Decodes one token for each of n distinct slots in one forward pass (the
 * weights are read once for all of them) and appends it to its slot; writes
 * the logits of every token ([n][n_vocab]). n <= n_batch. The logits are
 * bit-identical to decoding each token alone. On any error no slot changes.
 */
ws_status ws_decode_multi(ws_context *ctx, const int32_t *slots, const int32_t *tokens,
                          int32_t n, float *logits, size_t logits_cap);

/*
 * Decodes n_seq segments in one forward pass: n_tokens[i] tokens (1 or more) for slot
 * slots[i] (distinct slots), the segments back to back in `tokens`, each appended to
 * its slot; writes the logits of every token ([sum of n_tokens][n_vocab]). Batches
 * longer than n_batch are split, a slot's tokens staying in order. The logits are
 * bit-identical to decoding each segment alone. On any error no slot changes.
 */
ws_status ws_decode_batch(ws_context *ctx, int32_t n_seq, const int32_t *slots,
                          const int32_t *n_tokens, const int32_t *tokens, float *logits,
                          size_t logits_cap);

/*
 * The general decode: ws_decode_batch's segments with what the caller wants of them.
 *   features   a feature head's inputs: [sum of n_tokens][n_embd], the vector paired
 *              with each token (NULL: a language model, which refuses them; a head
 *              needs them). features_cap: floats it holds.
 *   want       [sum of n_tokens]: 1 for the tokens whose logits are wanted, written
 *              in token order, packed ([wanted][n_vocab]); NULL: every token's.
 *   logits     NULL with logits_cap 0: none.
 *   hidden     [sum of n_tokens][n_embd]: each token's hidden state, the residual
 *              stream after the last layer, before output_norm (what the logits are
 *              the output of), as floats; NULL with hidden_cap 0: none. Kept only
 *              when asked: the pass copies it out, nothing else changes.
 *   kv_only    1: only the keys and values are wanted (no logits, no hidden): the
 *              last layer stops once it has stored them (a feature head's catch-up
 *              costs its input projection and k, v only).
 * The logits and hidden states of a token are bit-identical however it was decoded
 * (batch, slot, threads, build), as ws_decode's. On any error no slot changes.
 */
typedef struct {
    const float *features;
    size_t features_cap;
    const uint8_t *want;
    float *logits;
    size_t logits_cap;
    float *hidden;
    size_t hidden_cap;
    int32_t kv_only;
} ws_decode_io;
ws_status ws_decode_ex(ws_context *ctx, int32_t n_seq, const int32_t *slots,
                       const int32_t *n_tokens, const int32_t *tokens, const ws_decode_io *io);
/* Whether the context's model is a feature head (ws_weights.fc set). */
int ws_context_is_head(const ws_context *ctx);

/* Keeps the first n positions of a slot (n <= current count). With sliding-window
 * layers in a ring, n must be 0 or >= ws_slot_keep_min: a shorter prefix needs keys
 * the ring no longer holds; such a call fails (WS_ERR_INVALID_ARGUMENT) and leaves
 * the slot as it was. */
ws_status ws_slot_truncate(ws_context *ctx, int32_t slot, int32_t n);
/* The shortest non-empty prefix a slot can be truncated to and still continue
 * exactly: 0 when every prefix can (no ring has overwritten a position yet, or the
 * model has no sliding-window layers); else the oldest position the rings still hold
 * plus n_swa - 1, the window of the next token. A common prefix shorter than this
 * is re-processed from position 0. */
ws_status ws_slot_keep_min(const ws_context *ctx, int32_t slot, int32_t *n_out);
ws_status ws_slot_clear(ws_context *ctx, int32_t slot);

/*
 * A slot's state: header, tokens and KV of its positions.
 *   header (32 bytes, little-endian u32): magic, version, n_layer, n_embd_k,
 *   n_embd_v, dtype (ws_kv_type: 0 = f32, 1 = f16, 2 = q8_0), n_tokens, n_window
 *   (version 3; 0 in versions 1 and 2)
 *   tokens: int32[n_tokens]
 *   per layer: K dtype[n_l][n_embd_k], then V dtype[n_l][n_embd_v] (a q8_0 row of
 *   n_embd values: n_embd / 32 blocks, each head's blocks in head order), the positions
 *   n_tokens - n_l .. n_tokens - 1, where n_l = n_tokens for a global layer and
 *   n_window for a sliding-window layer (version 3), n_tokens for every layer in
 *   versions 1 and 2.
 * Get writes version 2 when every layer holds every position (llama; a gemma3 slot
 * whose rings never wrapped, or a swa_full context), else version 3 with n_window =
 * the positions its rings still hold (at most n_swa + WS_SWA_SPARE; at least the
 * n_swa - 1 the next token reads). Set accepts n_window >= min(n_tokens, n_swa - 1)
 * and keeps the last ring-size positions of it.
 * The KV values are the cache's own (f16: the halves as stored; q8_0: the blocks), so a restored
 * slot continues bit for bit. ws_slot_state_set reads versions 1 (f32 only), 2 and 3,
 * and refuses a state whose dtype is not the context's kv_type; it validates
 * everything before it writes; on any error the slot is left empty (cleared) and
 * usable.
 */
ws_status ws_slot_state_size(const ws_context *ctx, int32_t slot, size_t *size_out);
ws_status ws_slot_state_get(const ws_context *ctx, int32_t slot, uint8_t *buf, size_t cap,
                            size_t *written_out);
ws_status ws_slot_state_set(ws_context *ctx, int32_t slot, const uint8_t *buf, size_t len,
                            size_t *read_out);
/* ws_slot_state_set with the state in three pieces that need not be contiguous:
 * the header (32 bytes), the tokens and the KV. A reader holding the pieces apart
 * (a slot file's sections) loads them without first joining them into one copy.
 * *read_out: the bytes of all three. */
ws_status ws_slot_state_set_parts(ws_context *ctx, int32_t slot, const uint8_t *header,
                                  size_t header_len, const uint8_t *tokens, size_t tokens_len,
                                  const uint8_t *kv, size_t kv_len, size_t *read_out);

/* ------------------------------------------------------------------------ */
/* Speculative decoding (speculative.c)                                      */
/*
 * A ws_spec drives a target context and an optional draft context with the
 * same number of slots and positions. Per slot it keeps the sequence S: the
 * tokens in the target's KV plus at most one pending token (sampled, not yet
 * decoded), the slot's RNG, and counters.
 *
 *   ws_spec_prefill  appends tokens to S (decoding any pending token with
 *                    them), brings the draft level when asked, samples the
 *                    next token from the target and leaves it pending.
 *   ws_spec_step     the draft proposes up to n_max tokens, the target decodes
 *                    the pending token plus the proposals in one batch, the
 *                    longest accepted prefix plus one target token are
 *                    returned; both KV caches roll back to the accepted
 *                    length and the last returned token is pending.
 *
 * Temperature 0 is greedy (argmax, lowest id on ties): the output is the
 * target-only greedy sequence. Otherwise proposals are sampled from the
 * draft's distribution q and accepted with probability min(1, p/q), a
 * rejection resamples from norm(max(0, p - q)): the output is distributed as
 * sampling from the target alone. p and q are both taken after the penalties,
 * temperature, top-k, top-p and min-p; greedy takes the argmax after the penalties.
 */

#define WS_SPEC_MAX_DRAFT 16
#define WS_SPEC_STATE_MAGIC 0x50535357u /* "WSSP" */
/* draft state versions: 1 the draft model's KV; 2 (written with a feature head) parts:
   the draft model's KV and/or the head's (version 1 is still read) */
#define WS_SPEC_STATE_VERSION 2u
/* the draft state's header: magic, version, d_off, lag_ok (u32), rng[4], then the
   counters n_steps, n_drafted, n_accepted, n_draft_prefill, drafted_at[16],
   accepted_at[16] (u64); version 2 then has WS_SPEC_STATE_EXT_BYTES more: parts (u32:
   1 the draft model's KV, 2 the head's), h_ok (u32), the parts' bytes (u64, u64), the
   head's readout rows and width (u32, u32) */
#define WS_SPEC_STATE_HEADER_BYTES 336u
#define WS_SPEC_STATE_EXT_BYTES 32u

#define WS_SPEC_MAX_LOGPROBS 20
#define WS_SPEC_MAX_PENALTY_LAST_N 4096

/*
 * Penalties (llama.cpp's, with OpenAI's presence and frequency terms), applied to
 * the raw logits before everything else, greedy included, for the target and the
 * draft alike: each token that occurs c > 0 times in the last repeat_last_n tokens
 * of S before the position being sampled (prompt, generated and drafted tokens)
 * has its logit divided by repeat_penalty when it is > 0, multiplied by it
 * otherwise, then lowered by c * frequency_penalty + presence_penalty.
 *
 * n_logprobs > 0: every token the call returns gets its log-probability and the
 * n_logprobs most likely tokens' (ws_spec_logprobs): the log-softmax of the
 * target's raw logits at that position (before penalties, temperature and
 * truncation, as OpenAI and llama.cpp report them), computed in double.
 */
typedef struct {
    float temperature;       /* <= 0: greedy                                   */
    int32_t top_k;           /* 0: off                                          */
    float top_p;             /* (0, 1]; 1: off                                  */
    float min_p;             /* [0, 1); 0: off                                  */
    float repeat_penalty;    /* [0, 10]; 0 or 1: off                            */
    int32_t repeat_last_n;   /* 0..WS_SPEC_MAX_PENALTY_LAST_N; 0: no penalties  */
    float presence_penalty;  /* [-2, 2]; 0: off                                 */
    float frequency_penalty; /* [-2, 2]; 0: off                                 */
    int32_t n_logprobs;      /* 0..WS_SPEC_MAX_LOGPROBS                         */
} ws_sampling_params;

/*
 * Two drafters. The lookup drafter (no model) finds, in the slot's own sequence S
 * (prompt, output, a session's earlier turns, and the pending token), the most
 * recent earlier occurrence of the longest suffix of S of at most
 * WS_SPEC_LOOKUP_MAX_MATCH tokens, m tokens long, and proposes the lookup_k[m]
 * tokens that followed it (a continuation that reaches the end of S goes on with
 * its own proposals, so a repeating pattern repeats): how far a continuation is
 * right depends mostly on how long the match is, so the caller says how many
 * proposals each match length is worth. It costs no decode: where it proposes, it
 * drafts the step and the draft model sits it out; elsewhere the draft model (if
 * any) drafts up to n_max. A lookup proposal is a certain draw
 * (q = 1 for it): greedy accepts it when it is the target's argmax, sampling with
 * probability p(x) and a rejection resamples from p without x, so the output is
 * distributed as sampling from the target alone.
 */
#define WS_SPEC_LOOKUP_MAX_MATCH 16

/* The lookup drafter's rule on its own: into drafts[0..k), the k tokens that follow
 * the most recent earlier occurrence in toks[0..n) of the longest suffix of toks of
 * min_match..WS_SPEC_LOOKUP_MAX_MATCH tokens. *n_out: k, or 0 when there is no such
 * occurrence. O(n) compares; no state. */
ws_status ws_spec_lookup(const int32_t *toks, int32_t n, int32_t min_match, int32_t k,
                         int32_t *drafts, int32_t *n_out);

typedef enum {
    WS_DRAFTER_NONE = 0,   /* the step drafted nothing                          */
    WS_DRAFTER_MODEL = 1,  /* the draft model proposed                          */
    WS_DRAFTER_LOOKUP = 2, /* the lookup drafter proposed                       */
    WS_DRAFTER_HEAD = 3,   /* the feature head proposed                         */
} ws_drafter;

typedef struct {
    int32_t n_max;     /* draft model: 0: no drafting; at most WS_SPEC_MAX_DRAFT   */
    int32_t n_min;     /* draft at least this many (<= n_max)                     */
    float p_min;       /* [0, 1]: stop drafting below this top prob               */
    /* lookup drafter: proposals after a match of m tokens, at [m] (0..
       WS_SPEC_MAX_DRAFT; [0] unused; all 0: lookup off)                          */
    int32_t lookup_k[WS_SPEC_LOOKUP_MAX_MATCH + 1];
    /* feature head (ws_spec_set_head): proposals per step where lookup does not
       propose (0..WS_SPEC_MAX_DRAFT; 0: off); it drafts instead of the draft model,
       stopping as the model does (p_min after n_min)                              */
    int32_t head_n_max;
} ws_spec_params;

/* What one slot's step did. */
typedef struct {
    int32_t n_out;     /* tokens returned (accepted proposals + 1)                */
    int32_t n_drafted; /* proposals verified                                      */
    int32_t drafter;   /* ws_drafter: who proposed them                            */
    int32_t match;     /* the lookup drafter's longest match (0: none or lookup off),
                          whether or not lookup_k made it propose                 */
} ws_spec_step_info;

typedef struct {
    uint64_t n_steps;         /* target verification passes              */
    uint64_t n_drafted;       /* tokens proposed by the draft            */
    uint64_t n_accepted;      /* proposals accepted                      */
    uint64_t n_draft_prefill; /* tokens the draft decoded to catch up    */
    uint64_t drafted_at[WS_SPEC_MAX_DRAFT];  /* proposals at position i  */
    uint64_t accepted_at[WS_SPEC_MAX_DRAFT]; /* accepted at position i   */
} ws_spec_counters;

typedef struct ws_spec ws_spec;

/* target and draft must outlive the ws_spec; draft may be NULL. */
ws_status ws_spec_init(ws_context *target, ws_context *draft, ws_spec **out);
/*
 * The feature head (docs/formats.md, warmslot-head): `head` a context of a head model
 * (ws_weights.fc) of the target's width, slots and positions; token_ids[k] the
 * vocabulary token of each of its k readout rows (k = the head's n_vocab). Set once,
 * while every slot is empty; it must outlive the ws_spec.
 *
 * With a head every target pass keeps the hidden states of its tokens and the head
 * follows: its KV holds the pairs (h_p, e_{p+1}) of positions 0..n-2 of a slot of n
 * tokens, computed from the target's true hidden states (the accepted tokens' pairs
 * after each step, in one keys-and-values-only head pass), and the slot keeps
 * h_{n-1}. A step where the head drafts (head_n_max > 0, lookup silent) chains the
 * head's own predicted hidden states: pair (h_{n-1}, e_{pending}) at position n-1,
 * then (g, e_{d_j}) at the next positions; the drafted pairs are dropped afterwards.
 * ws_spec_truncate to n < the target's tokens keeps n - 1 of them and the n-th as the
 * pending token, whose decode gives h_{n-1} back. A slot restored without the head's
 * state does not draft with the head until it is cleared.
 */
ws_status ws_spec_set_head(ws_spec *spec, ws_context *head, const int32_t *token_ids, int32_t k);
/* The pairs the head's KV holds for the slot, and whether the head can draft for it
   now (*ready 1: level with the target, h_{n-1} kept). */
ws_status ws_spec_head_status(const ws_spec *spec, int32_t slot, int32_t *n_pairs, int *ready);
void ws_spec_free(ws_spec *spec);
const char *ws_spec_last_error(const ws_spec *spec);

ws_status ws_spec_check_params(const ws_spec *spec, const ws_sampling_params *sp,
                               const ws_spec_params *pp);
ws_status ws_spec_seed(ws_spec *spec, int32_t slot, uint64_t seed);
/* Length of S (KV tokens plus the pending one) and its tokens. */
ws_status ws_spec_n_tokens(const ws_spec *spec, int32_t slot, int32_t *n_out);
ws_status ws_spec_tokens(const ws_spec *spec, int32_t slot, int32_t *out, size_t cap,
                         int32_t *n_out);
ws_status ws_spec_draft_n_tokens(const ws_spec *spec, int32_t slot, int32_t *n_out);
ws_status ws_spec_prefill(ws_spec *spec, int32_t slot, const int32_t *tokens, int32_t n_tokens,
                          const ws_sampling_params *sp, int with_draft, int32_t *token_out);
ws_status ws_spec_step(ws_spec *spec, int32_t slot, const ws_sampling_params *sp,
                       const ws_spec_params *pp, int32_t max_new, int32_t *out, size_t cap,
                       int32_t *n_out);
/*
 * One speculative step for each of n distinct slots with one target pass for all of
 * them: each slot's draft catches up and proposes up to pps[i].n_max tokens (the
 * drafts of all slots decode together, one round per proposal), then the target
 * decodes every slot's pending token and proposals in one batch, and each slot
 * accepts as ws_spec_step does. pps NULL: target only for every slot; max_new NULL:
 * no bound. out: [n][WS_SPEC_MAX_DRAFT + 1] tokens, info[i].n_out of them for slot
 * i, and what the step did in info[i]. The tokens, RNG draws, counters and
 * both caches of every slot are those of ws_spec_step on that slot alone. Every
 * argument is checked before anything is decoded.
 */
ws_status ws_spec_step_batch(ws_spec *spec, int32_t n, const int32_t *slots,
                             const ws_sampling_params *sps, const ws_spec_params *pps,
                             const int32_t *max_new, int32_t *out, ws_spec_step_info *info);
/*
 * One target-only step for each of n distinct slots in one forward pass: decodes
 * each slot's pending token, samples the next one with that slot's parameters
 * and RNG (out[i]), which becomes pending. The same tokens as n separate
 * ws_spec_step calls with n_max 0.
 */
ws_status ws_spec_step_multi(ws_spec *spec, const int32_t *slots, const ws_sampling_params *sps,
                             int32_t n, int32_t *out);
/*
 * The logprobs of the tokens the slot's last ws_spec_prefill, ws_spec_step or
 * ws_spec_step_multi returned, when its sampling parameters asked for them:
 * *n_rows tokens (0 when they did not ask), each a row of 1 + WS_SPEC_MAX_LOGPROBS
 * entries of ids and lps: the token and its logprob, then the *n_top most likely
 * tokens (most likely first, ties by lower id); the rest of a row is untouched.
 * cap: rows ids and lps hold.
 */
ws_status ws_spec_logprobs(const ws_spec *spec, int32_t slot, int32_t *ids, float *lps,
                           size_t cap, int32_t *n_rows, int32_t *n_top);
/* Decodes the pending token (if any) into the target and, when level, the draft. */
ws_status ws_spec_commit(ws_spec *spec, int32_t slot);
/* Keeps the first n tokens of S (n <= length of S). */
ws_status ws_spec_truncate(ws_spec *spec, int32_t slot, int32_t n);
ws_status ws_spec_clear(ws_spec *spec, int32_t slot);
/*
 * The draft's KV holds target positions [offset, offset + draft n_tokens).
 * ws_spec_draft_reset empties it and sets the offset: 0 makes the next
 * prefill (or ws_spec_draft_sync) re-prefill the whole context; the target's
 * length makes the draft start empty, seeing only tokens that come after.
 */
ws_status ws_spec_draft_reset(ws_spec *spec, int32_t slot, int32_t offset);
/* Brings the draft level with the target's KV tokens now; *n_out: tokens decoded. */
ws_status ws_spec_draft_sync(ws_spec *spec, int32_t slot, int32_t *n_out);
/*
 * Prefill in bounded pieces, for a caller that interleaves slots:
 * ws_spec_prefill_chunk appends the pending token (if any) and the tokens to
 * S without sampling (the slot holds no pending token afterwards); with_draft:
 * the draft then catches up by at most as many tokens as the target decoded.
 * ws_spec_draft_catch_up decodes at most max_tokens of the draft's lag behind
 * the target's KV; *n_done: tokens decoded, *n_left: the lag that remains.
 */
ws_status ws_spec_prefill_chunk(ws_spec *spec, int32_t slot, const int32_t *tokens,
                                int32_t n_tokens, int with_draft);
ws_status ws_spec_draft_catch_up(ws_spec *spec, int32_t slot, int32_t max_tokens,
                                 int32_t *n_done, int32_t *n_left);
ws_status ws_spec_draft_offset(const ws_spec *spec, int32_t slot, int32_t *offset_out);
ws_status ws_spec_counters_get(const ws_spec *spec, int32_t slot, ws_spec_counters *out);

/*
 * The slot's draft state: spec header (magic, version, RNG, counters), then
 * the draft context's slot state (ws_slot_state_get format). With a feature head
 * (version 2): the header's extension, then the draft context's slot state (with a
 * draft model), then the head's part: h_{n-1} (f32[n_embd]) and the head context's
 * slot state (its pairs 0..n-2; absent when the head cannot draft for the slot). Set
 * validates everything (the draft's tokens a prefix of the target's, the head's the
 * target's from position 1, as many pairs as the target has tokens less one); on
 * error the draft slot is left empty, the head off for the slot (until cleared), and
 * the RNG and counters unchanged. A version-1 state into a decoder with a head leaves
 * the head off for the slot.
 */
ws_status ws_spec_state_size(const ws_spec *spec, int32_t slot, size_t *size_out);
ws_status ws_spec_state_get(const ws_spec *spec, int32_t slot, uint8_t *buf, size_t cap,
                            size_t *written_out);
ws_status ws_spec_state_set(ws_spec *spec, int32_t slot, const uint8_t *buf, size_t len,
                            size_t *read_out);

/*
 * A slot's whole state, target and draft, in two buffers (never joined):
 * ws_spec_slot_state_prepare commits the pending token, then gives the sizes;
 * ws_spec_slot_state_get writes the target context's slot state
 * (ws_slot_state_get format) into tbuf and the draft state (ws_spec_state_get
 * format; nothing without a draft model) into dbuf.
 * ws_spec_slot_state_set empties the slot, loads the target state from its three
 * parts (ws_slot_state_set_parts), then the draft state validated against it.
 * A refused target leaves the slot empty and returns its error. A draft state
 * that is absent (dbuf NULL) or refused leaves an empty draft at draft_offset
 * (0 <= draft_offset <= the target's tokens) and *draft_loaded 0; a refusal's
 * reason is in ws_spec_last_error.
 */
ws_status ws_spec_slot_state_prepare(ws_spec *spec, int32_t slot, size_t *target_size,
                                     size_t *draft_size);
ws_status ws_spec_slot_state_get(const ws_spec *spec, int32_t slot, uint8_t *tbuf, size_t tcap,
                                 size_t *t_written, uint8_t *dbuf, size_t dcap, size_t *d_written);
ws_status ws_spec_slot_state_set(ws_spec *spec, int32_t slot, const uint8_t *header,
                                 size_t header_len, const uint8_t *tokens, size_t tokens_len,
                                 const uint8_t *kv, size_t kv_len, const uint8_t *dbuf,
                                 size_t dlen, int32_t draft_offset, int *draft_loaded);

/* SentencePiece-style BPE with byte fallback (native/spm.c), for a GGUF `llama`
 * tokenizer. ws_spm_init copies the vocabulary: `blob` (ends[n_tokens - 1] bytes)
 * holds the tokens' UTF-8 bytes one after another, token i ending at ends[i]
 * (non-decreasing); scores[i] its merge score; byte_ids[b] the token of byte b
 * (<0xXX>). */
typedef struct ws_spm ws_spm;
ws_status ws_spm_init(const char *blob, const uint64_t *ends, const float *scores,
                      const int32_t *byte_ids, int32_t n_tokens, ws_spm **out);
void ws_spm_free(ws_spm *spm);
/* The ids of text (UTF-8 of fewer than INT32_MAX bytes, user-defined tokens split off
 * and spaces escaped by the caller): *n_out ids, at most len, into out[cap]
 * (WS_ERR_BUFFER_TOO_SMALL when cap < *n_out). Thread-safe: the vocabulary is read
 * only. Takes 32 bytes of memory per byte of text while it runs. */
ws_status ws_spm_encode(const ws_spm *spm, const char *text, size_t len, int32_t *out,
                        size_t cap, size_t *n_out);

#ifdef __cplusplus
}
#endif

#endif /* WARMSLOT_H */
