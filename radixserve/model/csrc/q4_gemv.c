/* 4-bit weight matmul y = x W^T for bf16 activations (radixserve/model/quant.py's Q4Linear).
 *
 * Why our own: torch's int4 CPU kernel converts every weight to float and multiplies with FMAs,
 * which is compute-bound here (~16 GB/s of weights, 4.7 ms for the default model's layers at
 * batch 1); this one reads ~26 GB/s (2.5 ms), close to the ~31-37 GB/s two threads can stream,
 * and beats a bf16 GEMM on weights unpacked for the call up to ~96-row chunks (above that the
 * GEMM wins: q4_dequant_t_bf16 unpacks for it).
 *
 * Layout (quant.py's pack_q4 writes it): rows in tiles of 16; per tile, per group of 32
 * weights of a row, a 320-byte block: 4 chunks of 64 bytes of codes, then the 16 rows' f16
 * scales d, then their f16 offsets m (w = d q + m). Each thread walks whole tiles, so its reads
 * are one sequential stream. In a chunk, 16-bit word j holds four codes of row j / 2:
 * nibble n is the weight at k = 8 chunk + 2 n + (j & 1). OR-ing 0x4300 into a nibble gives the
 * bf16 of 128 + q exactly, so one AVX512-BF16 dot product (vdpbf16ps) multiplies 16 rows by a
 * broadcast pair of activations with no conversion; the 128 comes back out per group through
 * the group's activation sum S: y += d (sum x (128 + q)) + (m - 128 d) S. Products are exact in
 * f32 and partial sums round in f32, so the only rounding coarser than f32 is the bf16 output
 * (and f16 scales: exact for Q4_0/Q4_1, whose scales are f16 in the file).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#define BLOCK 320 /* bytes per (tile, group): 256 of codes, 32 of scales, 32 of offsets */
#define ROWS_IN_FLIGHT 4

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int q4_available(void) { return 1; }

/* One tile (16 output columns) for nb <= ROWS_IN_FLIGHT activation rows. */
static inline __attribute__((always_inline)) void tile(
    const uint8_t *w, const uint16_t *x, int64_t k, const float *gsum, int64_t ng, const int nb,
    uint16_t *y, int64_t n) {
    const __m512i low4 = _mm512_set1_epi16(0x000F), b128 = _mm512_set1_epi16(0x4300);
    __m512 out[ROWS_IN_FLIGHT];
    for (int b = 0; b < nb; b++) out[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *blk = w + g * BLOCK;
        __m512 acc[ROWS_IN_FLIGHT][2]; /* two chains a row: the dot products' latency */
        for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            __m512i q = _mm512_loadu_si512(blk + 64 * c);
            /* 0xEA: (a & b) | c */
            __m512bh q0 = (__m512bh)_mm512_ternarylogic_epi32(q, low4, b128, 0xEA);
            __m512bh q1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(q, 4), low4,
                                                              b128, 0xEA);
            __m512bh q2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(q, 8), low4,
                                                              b128, 0xEA);
            __m512bh q3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(q, 12), b128);
            for (int b = 0; b < nb; b++) {
                int32_t xp[4]; /* activation pairs (k, k + 1) for nibbles 0..3 */
                memcpy(xp, x + b * k + g * 32 + 8 * c, sizeof xp);
                acc[b][0] = _mm512_dpbf16_ps(acc[b][0], (__m512bh)_mm512_set1_epi32(xp[0]), q0);
                acc[b][1] = _mm512_dpbf16_ps(acc[b][1], (__m512bh)_mm512_set1_epi32(xp[1]), q1);
                acc[b][0] = _mm512_dpbf16_ps(acc[b][0], (__m512bh)_mm512_set1_epi32(xp[2]), q2);
                acc[b][1] = _mm512_dpbf16_ps(acc[b][1], (__m512bh)_mm512_set1_epi32(xp[3]), q3);
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
        __m512 m128 = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), m); /* m - 128 d */
        for (int b = 0; b < nb; b++) {
            out[b] = _mm512_fmadd_ps(d, _mm512_add_ps(acc[b][0], acc[b][1]), out[b]);
            out[b] = _mm512_fmadd_ps(m128, _mm512_set1_ps(gsum[b * ng + g]), out[b]);
        }
    }
    for (int b = 0; b < nb; b++)
        _mm256_storeu_si256((__m256i *)(y + b * n), (__m256i)_mm512_cvtneps_pbh(out[b]));
}

/* y [rows, n] bf16 = x [rows, k] bf16 (contiguous) times the packed W [n, k]^T. Returns 0, or 1
 * for a shape the layout cannot hold, 2 when out of memory. */
int q4_matmul_bf16(const uint8_t *w, const uint16_t *x, int64_t rows, int64_t n, int64_t k,
                   uint16_t *y) {
    if (n < 0 || k < 0 || n % 16 || k % 32 || rows < 0) return 1;
    int64_t ng = k / 32, tiles = n / 16;
    float *gsum = malloc(sizeof(float) * (size_t)(rows * ng + 1));
    if (!gsum) return 2;
    for (int64_t i = 0; i < rows * ng; i++) {
        float s = 0.f;
        for (int j = 0; j < 32; j++) s += bf16_to_f32(x[i * 32 + j]);
        gsum[i] = s;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *wt = w + t * ng * BLOCK;
        for (int64_t r = 0; r < rows; r += ROWS_IN_FLIGHT) {
            const uint16_t *xr = x + r * k;
            const float *gr = gsum + r * ng;
            uint16_t *yr = y + r * n + t * 16;
            switch (rows - r < ROWS_IN_FLIGHT ? rows - r : ROWS_IN_FLIGHT) {
            case 1: tile(wt, xr, k, gr, ng, 1, yr, n); break;
            case 2: tile(wt, xr, k, gr, ng, 2, yr, n); break;
            case 3: tile(wt, xr, k, gr, ng, 3, yr, n); break;
            default: tile(wt, xr, k, gr, ng, 4, yr, n); break;
            }
        }
    }
    free(gsum);
    return 0;
}

/* W^T [k, n] bf16 = bf16(d q + m): the weights for prefill chunks, where a bf16 GEMM on them beats
 * the kernel above (it is compute-bound there). Column-major so each (chunk, nibble, half) of a
 * block is one 16-row store. */
int q4_dequant_t_bf16(const uint8_t *w, int64_t n, int64_t k, uint16_t *wt) {
    if (n < 0 || k < 0 || n % 16 || k % 32) return 1;
    int64_t ng = k / 32, tiles = n / 16;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *blk = w + (t * ng + g) * BLOCK;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
            for (int c = 0; c < 4; c++) {
                __m512i q = _mm512_loadu_si512(blk + 64 * c);
                for (int nib = 0; nib < 4; nib++) {
                    /* 16 dwords, one a row: its two codes of this nibble, in the two halves */
                    __m512i pair = _mm512_and_si512(_mm512_srli_epi16(q, 4 * nib),
                                                    _mm512_set1_epi16(0x000F));
                    for (int half = 0; half < 2; half++) {
                        __m512i code = half ? _mm512_srli_epi32(pair, 16)
                                            : _mm512_and_si512(pair, _mm512_set1_epi32(0xFFFF));
                        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), d, m);
                        int64_t col = g * 32 + 8 * c + 2 * nib + half;
                        _mm256_storeu_si256((__m256i *)(wt + col * n + t * 16),
                                            (__m256i)_mm512_cvtneps_pbh(v));
                    }
                }
            }
        }
    }
    return 0;
}

#else /* no AVX512-BF16: quant.py keeps torch's int4 layout and kernel */

int q4_available(void) { return 0; }

int q4_matmul_bf16(const uint8_t *w, const uint16_t *x, int64_t rows, int64_t n, int64_t k,
                   uint16_t *y) {
    (void)w; (void)x; (void)rows; (void)n; (void)k; (void)y;
    return 1;
}

int q4_dequant_t_bf16(const uint8_t *w, int64_t n, int64_t k, uint16_t *wt) {
    (void)w; (void)n; (void)k; (void)wt;
    return 1;
}

#endif
