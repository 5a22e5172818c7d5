/* ws_math.h - deterministic scalar maths shared by the core's C files (internal). */
#ifndef WS_MATH_H
#define WS_MATH_H

#include <math.h>

/* exp(x) for float x: range reduction by ln2, degree-8 Taylor polynomial in double. */
static inline float ws_expf(float xf) {
    if (xf < -103.0f) return 0.0f;
    if (xf > 88.0f) return INFINITY;
    double x = (double)xf;
    double n = nearbyint(x * 1.4426950408889634);
    double r = x - n * 0.6931471805599453;
    double p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6 + r * (1.0 / 24 + r * (1.0 / 120 +
               r * (1.0 / 720 + r * (1.0 / 5040 + r * (1.0 / 40320))))))));
    return (float)ldexp(p, (int)n);
}

#endif /* WS_MATH_H */
