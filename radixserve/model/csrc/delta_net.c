/* One step of a Gated DeltaNet layer (Qwen3.5's linear attention) for every sequence of a
 * step, bf16 in and out, the recurrent state in f32: the depthwise causal convolution, the q/k
 * L2 norms, the gated delta rule and the gated RMS norm, one C call a layer.
 *
 * The state of a sequence lives in a cell of the layer's two f32 stores k, v [n_cells, W]:
 * k's row holds the conv state ((K-1) rows of the Cc conv channels, oldest first), then the
 * [dk][dv] matrices of v-heads 0..ha-1 (ha = ceil(nv / 2)); v's row the matrices of v-heads
 * ha..nv-1 (the rest of v's row is padding, never touched). A sequence reads its state from
 * one cell (or zeros) and leaves it in another; the read cell is never written.
 *
 * Per token, all in f32 (kernels.py's Kernels.gdn_step has the whole statement):
 *   conv: out[c] = silu(sum over j of w[c][j] xs[t + j][c]), the sum from j = 0 in order;
 *   q, k heads: x (1 / sqrt(sum of x^2 in index order + eps)), q then times 1 / sqrt(dk);
 *   beta = sigmoid(b), decay = exp(ssm_a softplus(alpha + dt_bias)), per v-head;
 *   per v-head h (q/k head h % nk: the GGUF tiles the v-heads) and its [dk][dv] matrix S:
 *     S *= decay; kv[j] = sum_i S[i][j] k[i]; delta = (v - kv) beta; S[i][j] += k[i] delta[j];
 *     o[j] = sum_i S[i][j] q[i]   (the sums over i from 0 in order)
 *   y[j] = o[j] (1 / sqrt(sum of o^2 in order / dv + eps)) norm_w[j] silu(z[j]), to bf16;
 *   silu(x) = x / (1 + exp(-x)), softplus(x) = x > 20 ? x : log1p(exp(x)) (torch's threshold).
 *
 * Determinism: every value is computed by one thread in the fixed order above, and this file
 * is built without reassociation or FMA contraction (kernel_build.py's _STRICT_FP,
 * _NO_CONTRACT), with its own exp (exp_f: the same bits on every CPU), so a token's output and
 * state bits do not depend on how many tokens the call holds, on the other sequences of the
 * call, on the thread count, or on the build variant.
 *
 * Speed: the delta rule reads S twice a token; within a sequence the second pass of a token and
 * the first of the next are one sweep (each element's operations unchanged), so n tokens sweep
 * S n + 1 times. The sweeps run in column blocks whose sums stay in registers. The in-order sums
 * (the L2 and RMS norms) are latency chains, so several run interleaved (heads, tokens).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "conv_step.h"
#include "exp_f.h"

/* columns of S a block of the delta rule's sweeps: its three accumulators stay in registers
 * (AVX-512: 32 of 512 bits; else 16 of 256 or 128 bits) */
#if defined(__AVX512F__)
#define JB 128
#else
#define JB 32
#endif
#define LANES 4         /* in-order sums interleaved */


/* x[l] = m[l] x[l] / sqrt(sum of x[l]^2 in index order + eps) over the d entries of each of the
 * nx <= LANES vectors x[l] (their sums interleaved). With rms: the mean of the squares instead
 * of their sum, and x untouched (inv[l] returned). */
static inline void norm_lanes(float *const *x, int nx, int d, float eps, const float *m,
                              int rms, float *inv) {
    float ss[LANES] = {0.f};
    if (nx == LANES) {
        for (int i = 0; i < d; i++)
            for (int l = 0; l < LANES; l++) ss[l] += x[l][i] * x[l][i];
    } else {
        for (int l = 0; l < nx; l++)
            for (int i = 0; i < d; i++) ss[l] += x[l][i] * x[l][i];
    }
    for (int l = 0; l < nx; l++) {
        inv[l] = 1.f / sqrtf((rms ? ss[l] / (float)d : ss[l]) + eps);
        if (!rms) {
            const float a = inv[l], b = m[l];
#pragma omp simd
            for (int i = 0; i < d; i++) x[l][i] = x[l][i] * a * b;
        }
    }
}

/* Pass 1 of a token on a block of nj <= JB columns: dst = src * decay (src NULL: zeros),
 * kv[j] = sum_i dst[i][j] kn[i]. */
static inline __attribute__((always_inline)) void decay_block(
    const float *src, float *dst, int dk, int dv, int nj, float decay, const float *kn,
    float *kv) {
    float acc[JB];
    for (int i = 0; i < dk; i++) {
        const float *r = src ? src + (int64_t)i * dv : 0;
        float *d = dst + (int64_t)i * dv;
        const float ki = kn[i];
#pragma omp simd
        for (int j = 0; j < nj; j++) {
            float s = (r ? r[j] : 0.f) * decay;
            d[j] = s;
            acc[j] = i ? acc[j] + s * ki : s * ki;
        }
    }
    for (int j = 0; j < nj; j++) kv[j] = acc[j];
}

static void decay_pass(const float *src, float *dst, int dk, int dv, float decay,
                       const float *kn, float *kv) {
    int j0 = 0;
    for (; j0 + JB <= dv; j0 += JB)
        decay_block(src ? src + j0 : 0, dst + j0, dk, dv, JB, decay, kn, kv + j0);
    if (j0 < dv) decay_block(src ? src + j0 : 0, dst + j0, dk, dv, dv - j0, decay, kn, kv + j0);
}

/* Pass 2 of a token on a block of columns: S[i][j] += kn[i] delta[j], o[j] = sum_i S[i][j]
 * qn[i]; and when kn2 is not NULL pass 1 of the sequence's next token in the same sweep:
 * S *= decay2, kv2[j] = sum_i S[i][j] kn2[i]. */
static inline __attribute__((always_inline)) void update_block(
    float *S, int dk, int dv, int nj, const float *kn, const float *delta, const float *qn,
    float *o, float decay2, const float *kn2, float *kv2) {
    float ao[JB], ak[JB], dl[JB];
    for (int j = 0; j < nj; j++) dl[j] = delta[j];
    for (int i = 0; i < dk; i++) {
        float *r = S + (int64_t)i * dv;
        const float ki = kn[i], qi = qn[i];
        if (kn2) {
            const float k2 = kn2[i];
#pragma omp simd
            for (int j = 0; j < nj; j++) {
                float s = r[j] + ki * dl[j];
                ao[j] = i ? ao[j] + s * qi : s * qi;
                s = s * decay2;
                r[j] = s;
                ak[j] = i ? ak[j] + s * k2 : s * k2;
            }
        } else {
#pragma omp simd
            for (int j = 0; j < nj; j++) {
                float s = r[j] + ki * dl[j];
                r[j] = s;
                ao[j] = i ? ao[j] + s * qi : s * qi;
            }
        }
    }
    for (int j = 0; j < nj; j++) o[j] = ao[j];
    if (kn2)
        for (int j = 0; j < nj; j++) kv2[j] = ak[j];
}

static void update_pass(float *S, int dk, int dv, const float *kn, const float *delta,
                        const float *qn, float *o, float decay2, const float *kn2,
                        float *kv2) {
    int j0 = 0;
    for (; j0 + JB <= dv; j0 += JB)
        update_block(S + j0, dk, dv, JB, kn, delta + j0, qn, o + j0, decay2, kn2, kv2 + j0);
    if (j0 < dv)
        update_block(S + j0, dk, dv, dv - j0, kn, delta + j0, qn, o + j0, decay2, kn2,
                     kv2 + j0);
}

/* A token's gates of v-head h from its proj row: beta and the decay. */
static void gates(const uint16_t *prow, int64_t Cc, int nv, int dv, int h, const float *ssm_a,
                  const float *dt_bias, float *beta, float *decay) {
    const uint16_t *b = prow + Cc + (int64_t)nv * dv, *a = b + nv;
    *beta = 1.f / (1.f + exp_f(-bf16_to_f32(b[h])));
    const float g = ssm_a[h] * softplus(bf16_to_f32(a[h]) + dt_bias[h]);
    *decay = exp_f(g);
}

/* proj [T, P] bf16, P = Cc + nv dv + 2 nv with Cc = 2 nk dk + nv dv: each token's conv input
 * (q | k | v), z (nv dv), beta logits (nv), alpha (nv). n_new, reads, writes [n_seq]: the
 * tokens of each sequence (proj's rows in order), the cell of its state before them (-1: zeros)
 * and the cell that receives it after them (no sequence's read cell, no other's write cell).
 * ks, vs [n_cells, W] f32: the layer's state stores. conv_w [Cc, K]; ssm_a, dt_bias [nv];
 * norm_w [dv]. work: f32 scratch of T Cc floats. out [T, nv dv] bf16. */
void gdn_step_bf16(const uint16_t *proj, int64_t T, int64_t n_seq, const int64_t *n_new,
                   const int64_t *reads, const int64_t *writes, float *ks, float *vs, int64_t W,
                   const float *conv_w, int K, const float *ssm_a, const float *dt_bias,
                   const float *norm_w, int nk, int nv, int dk, int dv, float eps, float *work,
                   uint16_t *out) {
    const int64_t QK = 2 * (int64_t)nk * dk, Cc = QK + (int64_t)nv * dv;
    const int64_t P = Cc + (int64_t)nv * dv + 2 * (int64_t)nv;
    const int64_t HD = (int64_t)dk * dv, ha = (nv + 1) / 2;
    /* a conv task's channels: whole q/k heads (the task normalizes them) */
    const int64_t grp = (int64_t)dk * ((CONV_GROUP + dk - 1) / dk);
    const int64_t n_grp = (Cc + grp - 1) / grp;
    const float qscale = 1.f / sqrtf((float)dk);
    /* sequence s's tokens are proj's rows t0[s]..t0[s+1]-1, its token chunks c0[s]..c0[s+1]-1 */
    int64_t t0[n_seq + 1], c0[n_seq + 1];
    t0[0] = c0[0] = 0;
    for (int64_t s = 0; s < n_seq; s++) {
        t0[s + 1] = t0[s] + n_new[s];
        c0[s + 1] = c0[s] + (n_new[s] + CONV_TOKENS - 1) / CONV_TOKENS;
    }
    (void)T;

#pragma omp parallel
    {
        /* 1. the convolution, each (sequence, chunk of its tokens, group of channels) a task:
         * work[t][c] = silu(the taps' sum), then the group's q and k heads normalized in place;
         * the task with the sequence's last token writes the group's channels of the new conv
         * state, the last K-1 rows of xs */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < c0[n_seq] * n_grp; task++) {
            const int64_t chunk = task / n_grp, g0 = (task % n_grp) * grp;
            const int64_t s = chunk_seq(c0, n_seq, chunk);
            const int64_t n = n_new[s], u0 = (chunk - c0[s]) * CONV_TOKENS;
            const int64_t u1 = u0 + CONV_TOKENS < n ? u0 + CONV_TOKENS : n;
            const int64_t g1 = g0 + grp < Cc ? g0 + grp : Cc;
            const float *old = reads[s] >= 0 ? ks + reads[s] * W : 0;
            conv_chunk(conv_w, 0, K, old, proj, P, t0[s], u0, u1, g0, g1, Cc, work);
            for (int64_t u = u0; u < u1; u++) { /* the group's q, k heads, LANES at a time */
                float *row = work + (t0[s] + u) * Cc;
                const int64_t qk1 = g1 < QK ? g1 : QK;
                for (int64_t c = g0; c < qk1; c += LANES * (int64_t)dk) {
                    float *x[LANES], m[LANES], inv[LANES];
                    int nx = 0;
                    for (; nx < LANES && c + nx * dk < qk1; nx++) {
                        x[nx] = row + c + nx * dk;
                        m[nx] = c + nx * dk < QK / 2 ? qscale : 1.f;
                    }
                    norm_lanes(x, nx, dk, eps, m, 0, inv); /* a q head's times 1 / sqrt(dk) */
                }
            }
            if (u1 == n)
                conv_state_write(ks + writes[s] * W, old, proj, P, t0[s], n, K, g0, g1, Cc);
        }
        /* (the barrier: every conv output is in work, q and k normalized) */

        /* 2. the delta rule and the gated norm, each (sequence, v-head) a task, its matrix
         * kept in the write cell from the first token on; a token's o goes where its v was
         * (work's v-head h columns, read only by this task), the norms after the last token */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n_seq * nv; task++) {
            const int64_t s = task / nv;
            const int h = (int)(task % nv), kh = h % nk;
            const int64_t n = n_new[s];
            const int64_t moff = h < ha ? (K - 1) * Cc + h * HD : (h - ha) * HD;
            float *base = h < ha ? ks : vs;
            const float *src = reads[s] >= 0 ? base + reads[s] * W + moff : 0;
            float *S = base + writes[s] * W + moff;
            const int64_t qo = (int64_t)kh * dk, ko = (int64_t)(nk + kh) * dk;
            const int64_t vo = QK + (int64_t)h * dv;
            float kv[dv], delta[dv];
            float beta, decay, beta2 = 0.f, decay2 = 0.f;
            gates(proj + t0[s] * P, Cc, nv, dv, h, ssm_a, dt_bias, &beta, &decay);
            decay_pass(src, S, dk, dv, decay, work + t0[s] * Cc + ko, kv);
            for (int64_t u = 0; u < n; u++) {
                const int64_t t = t0[s] + u;
                float *row = work + t * Cc;
                for (int j = 0; j < dv; j++) delta[j] = (row[vo + j] - kv[j]) * beta;
                const int next = u + 1 < n;
                if (next)
                    gates(proj + (t + 1) * P, Cc, nv, dv, h, ssm_a, dt_bias, &beta2, &decay2);
                update_pass(S, dk, dv, row + ko, delta, row + qo, row + vo, decay2,
                            next ? row + Cc + ko : 0, kv);
                beta = beta2;
            }
            /* the gated RMS norms of the outputs, LANES tokens at a time */
            for (int64_t u = 0; u < n; u += LANES) {
                float *x[LANES], inv[LANES];
                int nx = 0;
                for (; nx < LANES && u + nx < n; nx++) x[nx] = work + (t0[s] + u + nx) * Cc + vo;
                norm_lanes(x, nx, dv, eps, 0, 1, inv);
                for (int l = 0; l < nx; l++) {
                    const int64_t t = t0[s] + u + l;
                    const uint16_t *z = proj + t * P + Cc + (int64_t)h * dv;
                    uint16_t *y = out + t * (int64_t)nv * dv + (int64_t)h * dv;
                    const float *o = x[l], a = inv[l];
#pragma omp simd
                    for (int j = 0; j < dv; j++)
                        y[j] = f32_to_bf16(o[j] * a * norm_w[j] * silu(bf16_to_f32(z[j])));
                }
            }
        }
    }
}
