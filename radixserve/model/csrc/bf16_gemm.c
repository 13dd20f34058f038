/* bf16 weight matmul y = x W^T for bf16 activations (radixserve/model/quant.py's DenseLinear).
 *
 * Why our own: torch's bf16 GEMM picks its blocking by the row count, so a row's outputs came
 * out with other last bits when it shared the call with 15 other rows (measured, torch 2.13).
 * Deterministic mode needs a token's logits to depend on its tokens alone: here every output is
 * one chain of vdpbf16ps over k in order, from 0, then one bf16 rounding, whatever the rows and
 * threads beside it. The paths below differ only in how many rows and tiles share a pass over
 * the weights (registers), never in an output's arithmetic; the dot products are builtins that
 * no -fassociative-math reassociates, and there is no other float arithmetic. (DAZ/FTZ are part
 * of vdpbf16ps itself, so denormal inputs flush the same way everywhere.)
 *
 * Layout (quant.py's pack_bf16 writes it): W padded with zeros to [NP, KP], NP a multiple of
 * PANEL_N, KP of 32; in panels of PANEL_N output rows, per panel [KP / 2, PANEL_N, 2]: for each
 * pair of weights (k, k + 1), the panel's rows' pairs side by side, so one 64-byte load holds a
 * pair of 16 rows (a tile) and vdpbf16ps multiplies it by a broadcast pair of activations.
 * Zero padding adds exact zeros to a chain (padded outputs are never stored).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define TILE 16
#define PANEL_N 32 /* rows per panel: two tiles */
#define PAIR_W (PANEL_N * 2) /* bf16 weights per panel per pair */
/* Up to FEW_ROWS rows (decode: memory-bound) all ride one pass over the weights, FEW_PANELS
 * panels at a time so enough independent chains hide vdpbf16ps's latency. */
#define FEW_ROWS 4
#define FEW_PANELS(R) ((R) <= 2 ? 4 : (R) == 3 ? 3 : 2) /* R * 2 FEW_PANELS <= 18 of 32 zmm */
/* More rows: MR rows times one panel (two tiles) of accumulators in registers, the weights
 * streamed once per MR rows (MR 6 or 7 with two panels measured the same on one thread; one
 * panel splits the default model's 18-panel matrices evenly over two threads). */
#define MR 12
#define MAX_R 12 /* the accumulators' fixed shape, MAX_R x MAX_T zmm */
#define MAX_T 8
/* Rows a thread keeps hot while it walks its panels: about RB_BYTES of activations (L2). */
#define RB_BYTES (192 * 1024)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int bf16_gemm_available(void) { return 1; }

/* two bf16 activations (k, k + 1) read as one dword */
typedef int32_t __attribute__((may_alias, aligned(2))) pair;

/* acc + w . broadcast(*p), one vdpbf16ps either way (same bits: the broadcast is a copy);
 * embed uses an embedded-broadcast memory operand, which gcc 12 does not form from the
 * intrinsics (~15% faster for many rows, measured on Zen 4). */
static inline __attribute__((always_inline)) __m512 dp(__m512 acc, __m512bh w, const pair *p,
                                                        const int embed) {
    if (!embed) return _mm512_dpbf16_ps(acc, w, (__m512bh)_mm512_set1_epi32(*p));
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
    return acc;
}

/* R rows (x, row stride ldx) times T tiles (tile j: panel j / 2 of w, panel stride ws) over
 * np pairs, into y (row stride ldy), the columns from `valid` on not stored. Every output of
 * every path is this function's chain: acc = 0, then one vdpbf16ps per pair in k order. */
static inline __attribute__((always_inline)) void block(
    const uint16_t *w, int64_t ws, const uint16_t *x, int64_t ldx, int64_t np, uint16_t *y,
    int64_t ldy, int64_t valid, const int R, const int T, const int embed) {
    /* fixed sizes (not [R][T]): gcc keeps only fixed arrays in registers */
    __m512 acc[MAX_R][MAX_T];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int j = 0; j < T; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        __m512bh wv[MAX_T];
#pragma GCC unroll 16
        for (int j = 0; j < T; j++)
            wv[j] = (__m512bh)_mm512_loadu_si512(w + (j / 2) * ws + p * PAIR_W + (j % 2) * 32);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 16
            for (int j = 0; j < T; j++)
                acc[r][j] = dp(acc[r][j], wv[j], (const pair *)(x + r * ldx) + p, embed);
    }
#pragma GCC unroll 16
    for (int j = 0; j < T; j++) {
        int64_t left = valid - TILE * j;
        if (left <= 0) break;
        __mmask16 m = left >= TILE ? 0xFFFF : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            _mm256_mask_storeu_epi16(y + r * ldy + TILE * j, m,
                                     (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
    }
}

/* Few rows: panels [p0, p1) for all rows (<= FEW_ROWS), FEW_PANELS at a time. */
static inline __attribute__((always_inline)) void few(
    const uint16_t *w, int64_t ws, const uint16_t *x, int64_t ldx, int64_t np, uint16_t *y,
    int64_t n, int64_t p0, int64_t p1, const int R) {
    int64_t p = p0;
    for (; p + FEW_PANELS(R) <= p1; p += FEW_PANELS(R))
        block(w + p * ws, ws, x, ldx, np, y + p * PANEL_N, n, n - p * PANEL_N, R,
              2 * FEW_PANELS(R), 0);
    for (; p < p1; p++)
        block(w + p * ws, ws, x, ldx, np, y + p * PANEL_N, n, n - p * PANEL_N, R, 2, 0);
}

/* Many rows: rows [0, nr) of x against panel p, MR rows at a time. */
static void many(const uint16_t *w, int64_t ws, const uint16_t *x, int64_t ldx, int64_t np,
                 uint16_t *y, int64_t n, int64_t nr, int64_t p) {
    const uint16_t *wp = w + p * ws;
    uint16_t *yp = y + p * PANEL_N;
    int64_t valid = n - p * PANEL_N, r = 0;
    for (; r + MR <= nr; r += MR)
        block(wp, ws, x + r * ldx, ldx, np, yp + r * n, n, valid, MR, 2, 1);
    switch (nr - r) { /* the MR - 1 shorter row blocks */
#define REST(R_)                                                                              \
    case R_: block(wp, ws, x + r * ldx, ldx, np, yp + r * n, n, valid, R_, 2, 1); break;
    REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
    default: break;
    }
}

/* y [rows, n] bf16 = x [rows, k] bf16 (contiguous) times the packed W [n, k]^T. Returns 0, or 1
 * for a bad shape, 2 when out of memory. Every row's result is the same bits whatever the row
 * count or thread count. */
int bf16_matmul(const uint16_t *w, const uint16_t *x, int64_t rows, int64_t n, int64_t k,
                uint16_t *y) {
    if (n <= 0 || k <= 0 || rows < 0) return 1;
    if (rows == 0) return 0;
    int64_t kp = (k + 31) / 32 * 32, np = kp / 2, panels = (n + PANEL_N - 1) / PANEL_N;
    int64_t ws = PANEL_N * kp;
    uint16_t *xpad = NULL;
    if (kp != k) { /* rows zero-padded to the weights' length: every chain runs over kp */
        xpad = calloc((size_t)(rows * kp), 2);
        if (!xpad) return 2;
        for (int64_t r = 0; r < rows; r++) memcpy(xpad + r * kp, x + r * k, 2 * (size_t)k);
        x = xpad;
    }
    if (rows <= FEW_ROWS) {
#pragma omp parallel
        {
            /* contiguous, even shares of panels: decode is memory-bound */
            int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
            int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
            switch (rows) {
            case 1: few(w, ws, x, kp, np, y, n, p0, p1, 1); break;
            case 2: few(w, ws, x, kp, np, y, n, p0, p1, 2); break;
            case 3: few(w, ws, x, kp, np, y, n, p0, p1, 3); break;
            default: few(w, ws, x, kp, np, y, n, p0, p1, 4); break;
            }
        }
    } else {
        /* row blocks outer, so a block's activations stay in L2 while each thread walks its
         * panels (the same panels every block) */
        int64_t rb = RB_BYTES / (2 * kp);
        rb = rb < MR ? MR : rb - rb % MR;
#pragma omp parallel
        for (int64_t r0 = 0; r0 < rows; r0 += rb) {
            int64_t nr = rows - r0 < rb ? rows - r0 : rb;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++)
                many(w, ws, x + r0 * kp, kp, np, y + r0 * n, n, nr, p);
        }
    }
    free(xpad);
    return 0;
}

#else /* no AVX512-BF16: quant.py keeps torch's bf16 GEMM */

int bf16_gemm_available(void) { return 0; }

int bf16_matmul(const uint16_t *w, const uint16_t *x, int64_t rows, int64_t n, int64_t k,
                uint16_t *y) {
    (void)w; (void)x; (void)rows; (void)n; (void)k; (void)y;
    return 1;
}

#endif
