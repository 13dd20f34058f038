/* The causal depthwise convolution both recurrent layers run first (delta_net.c's q/k/v,
 * mamba2.c's x/B/C): a task's chunk of a sequence's tokens over a group of channels, and the
 * conv state a step leaves. The same operations in the same order for both, so the bits are
 * each kernel's as documented there; included only by files built with strict FP and no
 * contraction. */
#ifndef RADIXSERVE_CONV_STEP_H
#define RADIXSERVE_CONV_STEP_H

#include <stdint.h>

#include "common.h"
#include "exp_f.h"

#define CONV_BLOCK 64   /* channels the conv computes at once (their taps' weights in a block) */
#define CONV_GROUP 1024 /* about the channels of a conv task: several tasks even for one token */
#define CONV_TOKENS 16  /* tokens a conv task: its input rows stay in cache across its blocks */

/* wt[j][c] = w[c][j] for a block of nc <= CONV_BLOCK channels of the conv's K taps. */
static inline __attribute__((always_inline)) void taps_T(const float *w, int nc, int K,
                                                         float *wt) {
    for (int c = 0; c < nc; c++)
        for (int j = 0; j < K; j++) wt[j * CONV_BLOCK + c] = w[c * K + j];
}

/* The sequence of token chunk `chunk`: c0[s] <= chunk < c0[s + 1] (c0: each sequence's first
 * chunk, n_seq + 1 entries). */
static inline int64_t chunk_seq(const int64_t *c0, int64_t n_seq, int64_t chunk) {
    int64_t s = 0, hi = n_seq;
    while (hi - s > 1) {
        const int64_t mid = (s + hi) / 2;
        if (c0[mid] <= chunk) s = mid; else hi = mid;
    }
    return s;
}

/* work[(t0 + u) Cc + c] = silu(the taps' sum, plus bias[c] when bias is not NULL) for the
 * tokens u0 <= u < u1 of a sequence and the channels g0 <= c < g1: the sum over j from 0 in
 * order of w[c][j] xs[u + j][c], xs being the K-1 rows of the old conv state `old` (NULL:
 * zeros), then the inputs, token u's channel c at in[(t0 + u) P + c]. */
static inline __attribute__((always_inline)) void conv_chunk(
    const float *conv_w, const float *bias, int K, const float *old, const uint16_t *in,
    int64_t P, int64_t t0, int64_t u0, int64_t u1, int64_t g0, int64_t g1, int64_t Cc,
    float *work) {
    float wt[K][CONV_BLOCK], acc[CONV_BLOCK];
    for (int64_t b0 = g0; b0 < g1; b0 += CONV_BLOCK) {
        const int nc = (int)(g1 - b0 < CONV_BLOCK ? g1 - b0 : CONV_BLOCK);
        if (K == 4) /* Qwen3.5's and Granite's: the transposition vectorizes */
            taps_T(conv_w + b0 * 4, nc, 4, &wt[0][0]);
        else
            taps_T(conv_w + b0 * K, nc, K, &wt[0][0]);
        const float *b = bias ? bias + b0 : 0;
        for (int64_t u = u0; u < u1; u++) {
            for (int j = 0; j < K; j++) {
                const int64_t x = u + j; /* xs's row: K-1 state rows, then the inputs */
                if (x < K - 1) {
                    const float *r = old ? old + x * Cc + b0 : 0;
#pragma omp simd
                    for (int c = 0; c < nc; c++) {
                        float p = wt[j][c] * (r ? r[c] : 0.f);
                        acc[c] = j ? acc[c] + p : p;
                    }
                } else {
                    const uint16_t *r = in + (t0 + x - (K - 1)) * P + b0;
#pragma omp simd
                    for (int c = 0; c < nc; c++) {
                        float p = wt[j][c] * bf16_to_f32(r[c]);
                        acc[c] = j ? acc[c] + p : p;
                    }
                }
            }
            float *o = work + (t0 + u) * Cc + b0;
            if (b) {
#pragma omp simd
                for (int c = 0; c < nc; c++) o[c] = silu(acc[c] + b[c]);
            } else {
#pragma omp simd
                for (int c = 0; c < nc; c++) o[c] = silu(acc[c]);
            }
        }
    }
}

/* The conv state after a sequence's n new tokens, channels g0 <= c < g1: its last K-1 input
 * rows (the old state's newest rows first when n < K-1; NULL old: zeros), oldest first, into
 * nst [K-1, Cc]. */
static inline void conv_state_write(float *nst, const float *old, const uint16_t *in,
                                    int64_t P, int64_t t0, int64_t n, int K, int64_t g0,
                                    int64_t g1, int64_t Cc) {
    for (int64_t r = 0; r < K - 1; r++) {
        const int64_t x = n + r;
        float *d = nst + r * Cc;
        if (x < K - 1) {
            const float *src = old ? old + x * Cc : 0;
            for (int64_t c = g0; c < g1; c++) d[c] = src ? src[c] : 0.f;
        } else {
            const uint16_t *src = in + (t0 + x - (K - 1)) * P;
            for (int64_t c = g0; c < g1; c++) d[c] = bf16_to_f32(src[c]);
        }
    }
}

#endif
