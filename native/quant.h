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

/*
 * out[t*ldo + r] (+)= dot(W[r], X[t]) for rows r in [r0, r1) and tokens t in [0, nt);
 * X: [nt][ldx]. Every output element is the canonical dot product (ws_simd.h) of the
 * row's dequantized values with the activations, whatever the tile, batch or build.
 * scratch: 4 * W->cols floats of the calling thread (rows unpacked once per block of
 * tokens); add: add to out (residual connection) instead of storing.
 */
void ws_matmul(float *out, int ldo, const ws_tensor *W, const float *X, int ldx, int r0,
               int r1, int nt, int add, float *scratch);

#endif /* WS_QUANT_H */
