/* Row-wise glue of a bf16 layer step, one call each instead of 5-8 torch ops.
 *
 * Why: in a decode step the layer glue (RMSNorm + cast, SiLU-gate product) is ~60 tiny torch
 * ops per layer at ~2-25 us each, more than the int4 matmuls themselves. Every row is computed
 * on its own in a fixed order, so a row's result does not depend on how many rows share the
 * call (batch-invariant), and the roundings follow the torch path: f32 math, one bf16 rounding
 * where torch rounds. Built by radixserve/model/kernels.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

/* Rows in parallel only when there are enough of them to pay for waking the pool. */
#define PAR_ROWS 16

/* The residual add and the next norm in one pass: x[r] += y[r] (bf16 y, skipped when NULL),
 * then out[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * w). x f32 [rows, d] with row stride xs
 * (updated in place, exactly as torch's x.add_(y)), y [rows, d] contiguous. */
void add_rms_norm_bf16(float *x, int64_t xs, const uint16_t *y, const float *w, int64_t rows,
                       int d, float eps, uint16_t *out) {
#pragma omp parallel for if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * xs;
        if (y)
            for (int i = 0; i < d; i++) xr[i] += bf16_to_f32(y[r * d + i]);
        float ss = 0.f;
        for (int i = 0; i < d; i++) ss += xr[i] * xr[i];
        float inv = 1.f / sqrtf(ss / (float)d + eps);
        uint16_t *o = out + r * d;
        for (int i = 0; i < d; i++) o[i] = f32_to_bf16(xr[i] * inv * w[i]);
    }
}

/* out[r] = bf16(bf16(silu(gate)) * up) with gu[r] = [gate (ff) | up (ff)] bf16: the roundings
 * of torch's F.silu(gate) * up on bf16 tensors. */
void silu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t ff, uint16_t *out) {
#pragma omp parallel for if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * ff, *u = g + ff;
        uint16_t *o = out + r * ff;
        for (int64_t i = 0; i < ff; i++) {
            float a = bf16_to_f32(g[i]);
            float s = bf16_to_f32(f32_to_bf16(a / (1.f + exp_clamped(-a))));
            o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
        }
    }
}
