/* The recurrent layers' scalar functions (delta_net.c, mamba2.c): e^x with the same bits on
 * every build and CPU, and the SiLU and softplus built on it. Included only by files built
 * with strict FP and no contraction (kernel_build.py's _STRICT_FP, _NO_CONTRACT), which their
 * bits rely on. */
#ifndef RADIXSERVE_EXP_F_H
#define RADIXSERVE_EXP_F_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x rounded to f32. Evaluated in double: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
 * degree-8 Taylor polynomial (error < 2e-10), times 2^n, then one rounding to f32: within
 * 0.51 ulp of e^x (libm's expf and torch's exp are within 1 ulp). Plain IEEE operations, no
 * branch (a NaN passes through, x > 89 gives inf, x < -104 zero), so the loops around it
 * vectorize and its bits are the same on every build and CPU (libm's expf picks its code by the
 * CPU it runs on). */
static inline float exp_f(float xf) {
    double x = (double)xf;
    { /* x clamped to [-104, 89] by masks: a conditional here is threaded into branches (its
       * constant arms fold), which keeps the loops around it from vectorizing */
        const double lo = -104.0, hi = 89.0;
        int64_t xb, lb, hb;
        memcpy(&xb, &x, 8);
        memcpy(&lb, &lo, 8);
        memcpy(&hb, &hi, 8);
        const int64_t ml = -(int64_t)(x < lo), mh = -(int64_t)(x > hi);
        xb = (xb & ~(ml | mh)) | (lb & ml) | (hb & mh);
        memcpy(&x, &xb, 8);
    }
    const double shift = 6755399441055744.0; /* 1.5 * 2^52: adding it rounds to an integer */
    const double u = x * 1.4426950408889634 + shift;
    const double n = u - shift;
    const double r = x - n * 0.6931471805599453;
    double p = 1.0 / 40320;
    p = p * r + 1.0 / 5040;
    p = p * r + 1.0 / 720;
    p = p * r + 1.0 / 120;
    p = p * r + 1.0 / 24;
    p = p * r + 1.0 / 6;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    uint64_t bits; /* u's low bits are n: 2^n's exponent field is n + 1023 */
    memcpy(&bits, &u, 8);
    bits = (bits + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, 8);
    return (float)(p * scale);
}

static inline float silu(float x) { return x / (1.f + exp_f(-x)); }

static inline float softplus(float x) { return x > 20.f ? x : log1pf(exp_f(x)); }

#endif
