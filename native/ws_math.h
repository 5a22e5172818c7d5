/* ws_math.h - deterministic scalar maths shared by the core's C files (internal). */
#ifndef WS_MATH_H
#define WS_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/*
 * exp(x) in float (Cephes' expf scheme): n = round(x log2 e), r = x - n ln 2 in
 * two fused steps, a degree-6 polynomial, then 2^n added to the exponent. Every
 * step is one IEEE operation, so the 8-lane version in warmslot.c gives the
 * same bits per element; no libm, so no variation between machines.
 */
#define WS_EXP_LO (-87.0f)
#define WS_EXP_HI 88.0f
#define WS_LOG2E 1.44269504088896341f
#define WS_LN2_HI 0.693359375f
#define WS_LN2_LO (-2.12194440e-4f)
#define WS_EXP_P0 1.9875691500e-4f
#define WS_EXP_P1 1.3981999507e-3f
#define WS_EXP_P2 8.3334519073e-3f
#define WS_EXP_P3 4.1665795894e-2f
#define WS_EXP_P4 1.6666665459e-1f
#define WS_EXP_P5 5.0000001201e-1f

static inline float ws_expf(float x) {
    if (x < WS_EXP_LO) return 0.0f;
    if (x > WS_EXP_HI) return INFINITY;
    const float n = nearbyintf(x * WS_LOG2E);
    float r = fmaf(n, -WS_LN2_HI, x);
    r = fmaf(n, -WS_LN2_LO, r);
    float p = WS_EXP_P0;
    p = fmaf(p, r, WS_EXP_P1);
    p = fmaf(p, r, WS_EXP_P2);
    p = fmaf(p, r, WS_EXP_P3);
    p = fmaf(p, r, WS_EXP_P4);
    p = fmaf(p, r, WS_EXP_P5);
    const float y = fmaf(p, r * r, r) + 1.0f;
    int32_t bits;
    memcpy(&bits, &y, sizeof bits);
    bits += (int32_t)n * (1 << 23);
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

#endif /* WS_MATH_H */
