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

/* out[r] = bf16(bf16(act(gate)) * up) with gu[r] = [gate (ff) | up (ff)] bf16, act silu or
 * (gelu, a constant) the tanh-approximated GELU; the sigmoid form a / (1 + e^-u) for both. */
static inline __attribute__((always_inline)) void gate_mul(const uint16_t *gu, int64_t rows,
                                                           int64_t ff, uint16_t *out,
                                                           const int gelu) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
#pragma omp parallel for if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * ff, *u = g + ff;
        uint16_t *o = out + r * ff;
        for (int64_t i = 0; i < ff; i++) {
            float a = bf16_to_f32(g[i]);
            float e = gelu ? -2.f * (beta * (a + kappa * a * a * a)) : -a;
            float s = bf16_to_f32(f32_to_bf16(a / (1.f + exp_clamped(e))));
            o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
        }
    }
}

/* out[r] = bf16(bf16(silu(gate)) * up) with gu[r] = [gate (ff) | up (ff)] bf16: the roundings
 * of torch's F.silu(gate) * up on bf16 tensors. */
void silu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t ff, uint16_t *out) {
    gate_mul(gu, rows, ff, out, 0);
}

/* out[r] = bf16(a sigmoid(1.702 a) (b + 1)), a = min(gate, 7), b = clamp(up, -7, 7), with
 * gu[r] = [gate (ff) | up (ff)] bf16: gpt-oss's clamped SwiGLU (moe.py's swiglu_oai) in f32
 * with one rounding, the sigmoid as a / (1 + e^-1.702a) as ggml's swiglu_oai; a NaN stays
 * NaN. Every element runs the same sequence, so a row's bits do not depend on the rows
 * beside it. */
void swiglu_oai_bf16(const uint16_t *gu, int64_t rows, int64_t ff, uint16_t *out) {
    const float alpha = 1.702f, limit = 7.f;
#pragma omp parallel for if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * ff, *u = g + ff;
        uint16_t *o = out + r * ff;
        for (int64_t i = 0; i < ff; i++) {
            float a = bf16_to_f32(g[i]), b = bf16_to_f32(u[i]);
            a = a > limit ? limit : a;
            b = b > limit ? limit : (b < -limit ? -limit : b);
            o[i] = f32_to_bf16(a / (1.f + exp_clamped(-alpha * a)) * (b + 1.f));
        }
    }
}

/* Gemma 3's residual step: x[r] += rms_norm(y[r]) * wp (y bf16, normed in f32, as torch's
 * F.rms_norm(y.float()) * wp then x.add_, but with this file's sum order and the compiler's
 * fused multiply-adds: within f32 rounding of torch's, not its bits), then, when wn is given,
 * out[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * wn): the post-attention / post-FFN norm,
 * the residual add and the next norm in one pass. The step and forward.py's general path
 * both call this, so their bits agree within a variant. */
void post_norm_add_bf16(float *x, int64_t xs, const uint16_t *y, const float *wp,
                        const float *wn, int64_t rows, int d, float eps, uint16_t *out) {
#pragma omp parallel for if (rows >= PAR_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * xs;
        const uint16_t *yr = y + r * d;
        float ss = 0.f;
        for (int i = 0; i < d; i++) {
            float v = bf16_to_f32(yr[i]);
            ss += v * v;
        }
        float iy = 1.f / sqrtf(ss / (float)d + eps);
        for (int i = 0; i < d; i++) xr[i] += bf16_to_f32(yr[i]) * iy * wp[i];
        if (!wn) continue;
        ss = 0.f;
        for (int i = 0; i < d; i++) ss += xr[i] * xr[i];
        float inv = 1.f / sqrtf(ss / (float)d + eps);
        uint16_t *o = out + r * d;
        for (int i = 0; i < d; i++) o[i] = f32_to_bf16(xr[i] * inv * wn[i]);
    }
}

/* out[r] = bf16(bf16(gelu(gate)) * up) with gu[r] = [gate (ff) | up (ff)] bf16 and the
 * tanh-approximated GELU (torch's approximate="tanh", Gemma's gelu_pytorch_tanh): the bf16
 * roundings of F.gelu(gate) * up on bf16 tensors, the GELU itself within f32 error of
 * torch's. 0.5 (1 + tanh(u)) is computed as the logistic 1 / (1 + e^-2u), with exp_clamped's
 * relative error (< 6e-6, far below bf16's); for gates below about -4.5 that is more accurate
 * than torch's 1 + tanh, which cancels to 0. */
void gelu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t ff, uint16_t *out) {
    gate_mul(gu, rows, ff, out, 1);
}
