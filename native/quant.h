/* quant.h - typed weight rows and the matrix products over them (internal). */
#ifndef WS_QUANT_H
#define WS_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "warmslot.h"

/* Elements per block of a type (1 for F32/F16/BF16), 0 when unsupported. */
int ws_type_block(int32_t type);

/* Row `row` of t as cols floats into out (the exact values every product uses). */
void ws_row_f32(const ws_tensor *t, int32_t row, float *out);

/* tokens whose activations an integer product quantizes at once */
#define WS_XQ_TOKENS 16

/* bytes of WS_XQ_TOKENS tokens of rows of `cols` elements as 16-bit activations
   with two floats per block of 32 */
#define WS_XQ_BYTES(cols) ((size_t)WS_XQ_TOKENS * (2 * (size_t)(cols) + 8 * ((size_t)(cols) / 32)))

/* bytes of the scratch ws_matmul needs for rows of `cols` elements: the larger of
   4 rows unpacked to floats (F16/BF16) and the activations of an integer product */
#define WS_MATMUL_SCRATCH_BYTES(cols) \
    (WS_XQ_BYTES(cols) > 16 * (size_t)(cols) ? WS_XQ_BYTES(cols) : 16 * (size_t)(cols))

/*
 * out[t*ldo + r] (+)= W[r] . X[t] for rows r in [r0, r1) and tokens t in [0, nt);
 * X: [nt][ldx]. F32/F16/BF16 rows: every output element is the canonical dot product
 * (ws_simd.h) of the row's values with the activations. Integer types: the product
 * over 16-bit activations of quant.c, one order per output element. Either way the
 * bits do not depend on the tile, the batch or the build.
 * scratch: WS_MATMUL_SCRATCH_BYTES(W->cols) bytes of the calling thread, float
 * aligned; add: add to out (residual connection) instead of storing.
 */
void ws_matmul(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r0,
               int r1, int nt, int add, float *scratch);

#endif /* WS_QUANT_H */
