/* One step of a Mamba2 layer (Granite 4.0-H's SSM layers) for every sequence of a step, bf16
 * in and out, the recurrent state in f32: the depthwise causal convolution, the selective scan
 * and the gated group RMS norm, one C call a layer.
 *
 * The state of a sequence lives in a cell of the layer's two f32 stores k, v [n_cells, W],
 * laid out as delta_net.c's: k's row holds the conv state ((K-1) rows of the Cc conv channels,
 * oldest first), then the [dk][dv] matrices of heads 0..ha-1 (ha = ceil(nv / 2)); v's row the
 * matrices of heads ha..nv-1 (the rest of v's row is padding, never touched). A sequence reads
 * its state from one cell (or zeros) and leaves it in another; the read cell is never written.
 *
 * In SsmDims' terms nk B/C groups of dk (the state size), nv heads of dv (the head size); head
 * h reads group g = h / (nv / nk): groups are contiguous runs of heads. Per token, all in f32
 * (kernels.py's Kernels.mamba2_step has the whole statement):
 *   conv: out[c] = silu(sum over j of w[c][j] xs[t + j][c] (+ b[c])), the sum from j = 0 in
 *     order, the bias added last;
 *   per head h: dt = softplus(dt_raw + dt_bias), dA = exp(dt ssm_a), xdt = x dt;
 *     S[i][j] = S[i][j] dA + B[i] xdt[j];  y[j] = sum_i S[i][j] C[i]  (i from 0 in order);
 *     y = (y + ssm_d x) silu(z);
 *   per group: y (1 / sqrt(sum of y^2 over the group's heads in index order / n + eps)) norm_w,
 *     to bf16 (n = (nv / nk) dv);
 *   silu(x) = x / (1 + exp(-x)), softplus(x) = x > 20 ? x : log1p(exp(x)) (torch's threshold).
 *
 * Determinism: every value is computed by one thread in the fixed order above, and this file
 * is built without reassociation or FMA contraction (kernel_build.py's _STRICT_FP,
 * _NO_CONTRACT), with its own exp (exp_f: the same bits on every CPU), so a token's output and
 * state bits do not depend on how many tokens the call holds, on the other sequences of the
 * call, on the thread count, or on the build variant.
 *
 * Phases: the conv over (sequence, token chunk, channel group) tasks; the scan over (sequence,
 * head) tasks, each head's matrix swept once a token in column blocks whose sums stay in
 * registers; then the norm over (token block, group) tasks, since a group spans several heads'
 * scans. Its in-order sums are latency chains, so several tokens' run interleaved.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "conv_step.h"
#include "exp_f.h"

/* columns of S a block of the scan's sweep: its two arrays (the sums, x dt) stay in registers;
 * Granite's dv = 64 is whole blocks on every build */
#if defined(__AVX512F__)
#define JB 64
#elif defined(__AVX__)
#define JB 32
#else
#define JB 16
#endif
#define LANES 4         /* in-order sums interleaved */


/* inv[l] = 1 / sqrt(mean of x[l][i]^2 in index order + eps) over the d entries of each of the
 * nx <= LANES vectors x[l] (their sums interleaved). */
static inline void rms_lanes(const float *const *x, int nx, int64_t d, float eps, float *inv) {
    float ss[LANES] = {0.f};
    if (nx == LANES) {
        for (int64_t i = 0; i < d; i++)
            for (int l = 0; l < LANES; l++) ss[l] += x[l][i] * x[l][i];
    } else {
        for (int l = 0; l < nx; l++)
            for (int64_t i = 0; i < d; i++) ss[l] += x[l][i] * x[l][i];
    }
    for (int l = 0; l < nx; l++) inv[l] = 1.f / sqrtf(ss[l] / (float)d + eps);
}

/* A token's sweep of a head's matrix on a block of nj <= JB columns: dst = src dA + B xdt^T
 * (src NULL: zeros), y[j] = sum_i dst[i][j] C[i]. src is dst but for a sequence's first token,
 * which reads the read cell (or nothing) and leaves its matrix in the write cell. */
static inline __attribute__((always_inline)) void scan_block(
    const float *src, float *dst, int dk, int dv, int nj, float dA, const float *B,
    const float *C, const float *xdt, float *y) {
    float acc[JB], xd[JB];
    for (int j = 0; j < nj; j++) xd[j] = xdt[j];
    for (int i = 0; i < dk; i++) {
        const float *r = src ? src + (int64_t)i * dv : 0;
        float *d = dst + (int64_t)i * dv;
        const float bi = B[i], ci = C[i];
#pragma omp simd
        for (int j = 0; j < nj; j++) {
            const float s = (r ? r[j] : 0.f) * dA + bi * xd[j];
            d[j] = s;
            acc[j] = i ? acc[j] + s * ci : s * ci;
        }
    }
    for (int j = 0; j < nj; j++) y[j] = acc[j];
}

static void scan_pass(const float *src, float *dst, int dk, int dv, float dA, const float *B,
                      const float *C, const float *xdt, float *y) {
    int j0 = 0;
    for (; j0 + JB <= dv; j0 += JB)
        scan_block(src ? src + j0 : 0, dst + j0, dk, dv, JB, dA, B, C, xdt + j0, y + j0);
    if (j0 < dv)
        scan_block(src ? src + j0 : 0, dst + j0, dk, dv, dv - j0, dA, B, C, xdt + j0, y + j0);
}

/* proj [T, P] bf16, P = 2 nv dv + 2 nk dk + nv: each token's z (nv dv), then its conv input
 * (the Cc = nv dv + 2 nk dk channels x | B | C), then dt (nv). n_new, reads, writes [n_seq]:
 * the tokens of each sequence (proj's rows in order), the cell of its state before them (-1:
 * zeros) and the cell that receives it after them (no sequence's read cell, no other's write
 * cell). ks, vs [n_cells, W] f32: the layer's state stores. conv_w [Cc, K]; conv_b [Cc] or
 * NULL; ssm_a (= -exp(A_log)), dt_bias, ssm_d [nv]; norm_w [nv dv]. work: f32 scratch of T Cc
 * floats. out [T, nv dv] bf16. */
void mamba2_step_bf16(const uint16_t *proj, int64_t T, int64_t n_seq, const int64_t *n_new,
                      const int64_t *reads, const int64_t *writes, float *ks, float *vs,
                      int64_t W, const float *conv_w, const float *conv_b, int K,
                      const float *ssm_a, const float *dt_bias, const float *ssm_d,
                      const float *norm_w, int nk, int nv, int dk, int dv, float eps,
                      float *work, uint16_t *out) {
    const int64_t VD = (int64_t)nv * dv, Cc = VD + 2 * (int64_t)nk * dk;
    const int64_t P = VD + Cc + nv;
    const int64_t HD = (int64_t)dk * dv, ha = (nv + 1) / 2;
    const int64_t n_grp = (Cc + CONV_GROUP - 1) / CONV_GROUP;
    const int rep = nv / nk;                /* heads a group */
    const int64_t GN = (int64_t)rep * dv;   /* the values a group's norm spans */
    const int64_t n_tb = (T + LANES - 1) / LANES;
    /* sequence s's tokens are proj's rows t0[s]..t0[s+1]-1, its token chunks c0[s]..c0[s+1]-1 */
    int64_t t0[n_seq + 1], c0[n_seq + 1];
    t0[0] = c0[0] = 0;
    for (int64_t s = 0; s < n_seq; s++) {
        t0[s + 1] = t0[s] + n_new[s];
        c0[s + 1] = c0[s] + (n_new[s] + CONV_TOKENS - 1) / CONV_TOKENS;
    }

#pragma omp parallel
    {
        /* 1. the convolution, each (sequence, chunk of its tokens, group of channels) a task:
         * work[t][c] = silu(the taps' sum + the bias); the task with the sequence's last token
         * writes the group's channels of the new conv state, the last K-1 rows of xs */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < c0[n_seq] * n_grp; task++) {
            const int64_t chunk = task / n_grp, g0 = (task % n_grp) * CONV_GROUP;
            const int64_t s = chunk_seq(c0, n_seq, chunk);
            const int64_t n = n_new[s], u0 = (chunk - c0[s]) * CONV_TOKENS;
            const int64_t u1 = u0 + CONV_TOKENS < n ? u0 + CONV_TOKENS : n;
            const int64_t g1 = g0 + CONV_GROUP < Cc ? g0 + CONV_GROUP : Cc;
            const float *old = reads[s] >= 0 ? ks + reads[s] * W : 0;
            const uint16_t *in = proj + VD; /* the conv's inputs in a proj row */
            conv_chunk(conv_w, conv_b, K, old, in, P, t0[s], u0, u1, g0, g1, Cc, work);
            if (u1 == n)
                conv_state_write(ks + writes[s] * W, old, in, P, t0[s], n, K, g0, g1, Cc);
        }
        /* (the barrier: every conv output is in work) */

        /* 2. the scan, each (sequence, head) a task, its matrix kept in the write cell from the
         * first token on; a token's gated y goes where its x was (work's head h columns, read
         * only by this task) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n_seq * nv; task++) {
            const int64_t s = task / nv;
            const int h = (int)(task % nv), g = h / rep;
            const int64_t n = n_new[s];
            const int64_t moff = h < ha ? (K - 1) * Cc + h * HD : (h - ha) * HD;
            float *base = h < ha ? ks : vs;
            const float *src = reads[s] >= 0 ? base + reads[s] * W + moff : 0;
            float *S = base + writes[s] * W + moff;
            const int64_t xo = (int64_t)h * dv, bo = VD + (int64_t)g * dk;
            const int64_t co = VD + (int64_t)(nk + g) * dk;
            const float a = ssm_a[h], bias = dt_bias[h], D = ssm_d[h];
            float xdt[dv], y[dv];
            for (int64_t u = 0; u < n; u++) {
                const int64_t t = t0[s] + u;
                const uint16_t *prow = proj + t * P;
                float *row = work + t * Cc;
                const float dt = softplus(bf16_to_f32(prow[VD + Cc + h]) + bias);
                const float dA = exp_f(dt * a);
                float *x = row + xo;
#pragma omp simd
                for (int j = 0; j < dv; j++) xdt[j] = x[j] * dt;
                scan_pass(u ? S : src, S, dk, dv, dA, row + bo, row + co, xdt, y);
                const uint16_t *z = prow + xo;
#pragma omp simd
                for (int j = 0; j < dv; j++)
                    x[j] = (y[j] + D * x[j]) * silu(bf16_to_f32(z[j]));
            }
        }
        /* (the barrier: every head's y is in work) */

        /* 3. the group RMS norms, each (block of LANES tokens, group) a task: the group's heads'
         * y are contiguous in work's row (heads g rep .. g rep + rep - 1) */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < n_tb * nk; task++) {
            const int64_t tb = task / nk, g = task % nk;
            const int64_t u0 = tb * LANES;
            const float *x[LANES];
            float inv[LANES];
            int nx = 0;
            for (; nx < LANES && u0 + nx < T; nx++) x[nx] = work + (u0 + nx) * Cc + g * GN;
            rms_lanes(x, nx, GN, eps, inv);
            const float *w = norm_w + g * GN;
            for (int l = 0; l < nx; l++) {
                uint16_t *o = out + (u0 + l) * VD + g * GN;
                const float *yl = x[l], al = inv[l];
#pragma omp simd
                for (int64_t i = 0; i < GN; i++) o[i] = f32_to_bf16(yl[i] * al * w[i]);
            }
        }
    }
}
