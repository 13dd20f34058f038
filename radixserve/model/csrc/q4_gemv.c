/* 4-bit weight matmul y = x W^T for bf16 activations (radixserve/model/quant.py's Q4Linear), and
 * the same kernel on 8-bit tiles (I8Linear: Q5_0, Q5_1, Q5_K, Q6_K, Q8_0; i8_matmul_bf16 below).
 *
 * Why our own: torch's int4 CPU kernel converts every weight to float and multiplies with FMAs,
 * which is compute-bound here (~16 GB/s of weights, 4.7 ms for the default model's layers at
 * batch 1); this one reads ~26 GB/s (2.5 ms), close to the ~31-37 GB/s two threads can stream.
 * From MANY_ROWS rows on it decodes each block once per block of rows and streams the rows
 * through the decoded weights, which keeps it level with a bf16 GEMM on weights unpacked for
 * the call (q4_dequant_t_bf16) at 512-row chunks and ahead below: its dot products are the
 * GEMM's, one vdpbf16ps per 32 multiply-adds, plus 3 ops per 16 for the scales.
 *
 * Batch invariance (deterministic mode): a row's outputs are the same bits whatever the rows
 * and threads beside it. Each output is computed by one sequence of operations, group_sums and
 * group_out, shared by both paths; the paths differ only in which row, tile and group comes
 * next. (NaN payloads are not pinned: the compiler picks the operand order of the adds.)
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

/* Tile formats: F_Q4 the 4-bit tiles above; F_I8* the 8-bit ones (int8 codes, see i8_matmul_bf16)
 * for Q8_0 / Q5_0 (F_I8: a scale a group), Q6_K (F_I8H: a scale a half group of 16) and Q5_1 /
 * Q5_K (F_I8M: a scale and an offset a group). */
enum { F_Q4 = 0, F_I8 = 1, F_I8H = 2, F_I8M = 3 };
/* bytes per (tile, group): Q4 256 of codes, 32 of f16 scales, 32 of f16 offsets; I8 512 of
 * codes, then 16 f32 scales (I8), 2 x 16 (I8H: half 0's, then half 1's) or 16 scales and 16
 * offsets (I8M) */
#define BLOCK(f) ((f) == F_Q4 ? 320 : (f) == F_I8 ? 576 : 640)
#define ROWS_IN_FLIGHT 4
/* From this many rows on, each (tile, group) is decoded once per block of rows rather than once
 * per ROWS_IN_FLIGHT rows: ~15-30% faster from 5 rows on, ~10% slower below (measured). */
#define MANY_ROWS 5
#define PF_TILES 4 /* few rows: tiles ahead that a tile's groups prefetch */
/* Rows a thread keeps hot while it walks its tiles: about RB_BYTES of activations (L2), and at
 * most RB_MAX so that the tile's f32 outputs (RB_MAX * 64 bytes) and a group's activation lines
 * stay in L1. (32..256 measured within noise of each other.) */
#define RB_BYTES (128 * 1024)
#define RB_MAX 128

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int q4_available(void) { return 1; }

/* two bf16 activations (k, k + 1) read as one dword */
typedef int32_t __attribute__((may_alias, aligned(2))) pair;

/* s[i] = the sum of the 32 activations of group i. Not inlined: both matmul paths must share
 * one compiled copy, since with -fassociative-math two copies of a reduction may round
 * differently. The order is spelled out (the two halves, then 8, 4, 2, 1 lanes), so a group's
 * sum does not depend on how a compiler vectorizes a loop over groups or on their count; it is
 * the order gcc 12 chose for the plain loop this replaces (same bits). */
static __attribute__((noinline)) void group_sums(const uint16_t *x, int64_t count, float *s) {
    for (int64_t i = 0; i < count; i++) {
        __m512i v = _mm512_loadu_si512(x + 32 * i);
        __m512 lo = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
        __m512 hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
        __m512 s16 = _mm512_add_ps(hi, lo);
        __m256 s8 = _mm256_add_ps(_mm512_extractf32x8_ps(s16, 1), _mm512_castps512_ps256(s16));
        __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
        __m128 s2 = _mm_add_ps(_mm_movehl_ps(s4, s4), s4);
        __m128 s1 = _mm_add_ss(_mm_shuffle_ps(s2, s2, 0x55), s2);
        s[i] = _mm_cvtss_f32(s1);
    }
}

/* A (tile, group)'s 16 weight vectors: q[4 c + n] is nibble n of chunk c as bf16 128 + code. */
static inline __attribute__((always_inline)) void decode(const uint8_t *blk, __m512bh q[16]) {
    const __m512i low4 = _mm512_set1_epi16(0x000F), b128 = _mm512_set1_epi16(0x4300);
    for (int c = 0; c < 4; c++) {
        __m512i v = _mm512_loadu_si512(blk + 64 * c);
        /* 0xEA: (a & b) | c */
        q[4 * c] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, b128, 0xEA);
        q[4 * c + 1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, b128,
                                                           0xEA);
        q[4 * c + 2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low4, b128,
                                                           0xEA);
        q[4 * c + 3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), b128);
    }
}

/* acc + q . broadcast(*p), one vdpbf16ps either way (same bits: the broadcast is a copy):
 * embed takes the pair as an embedded-broadcast memory operand, which gcc 12 does not form from
 * the intrinsics (it adds a vpbroadcastd), ~15% faster for many rows; the intrinsics are ~10%
 * faster for the few-rows path (measured, Zen 4). The products are exact, so which operand is q
 * does not change a bit either. */
static inline __attribute__((always_inline)) __m512 dp_bcast(__m512 acc, __m512bh q,
                                                              const pair *p, const int embed) {
    if (!embed) return _mm512_dpbf16_ps(acc, q, (__m512bh)_mm512_set1_epi32(*p));
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*p));
    return acc;
}

/* Every output's arithmetic, in both paths: one row's group (xg: its 32 activations, gsum their
 * sum) added to the row's 16 outputs of a tile. Two chains for the dot products' latency:
 * nibbles 0 and 2 into the first, 1 and 3 into the second, chunks in order. embed: dp_bcast. */
static inline __attribute__((always_inline)) __m512 group_out(
    const __m512bh q[16], const uint16_t *xg, __m512 d, __m512 m128, float gsum, __m512 out,
    const int embed, const int f) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const pair *xp = (const pair *)xg; /* xp[4 c + n]: activations (k, k + 1) of nibble n */
    if (f != F_Q4) { /* 8-bit: xp[p] pairs with q[p]; pairs alternate between the two chains */
        for (int p = 0; p < 8; p += 2) {
            acc0 = dp_bcast(acc0, q[p], xp + p, embed);
            acc1 = dp_bcast(acc1, q[p + 1], xp + p + 1, embed);
        }
        if (f == F_I8H) { /* half 0 (weights 0-15) done: its own scale */
            out = _mm512_fmadd_ps(d, _mm512_add_ps(acc0, acc1), out);
            acc0 = acc1 = _mm512_setzero_ps();
        }
        for (int p = 8; p < 16; p += 2) {
            acc0 = dp_bcast(acc0, q[p], xp + p, embed);
            acc1 = dp_bcast(acc1, q[p + 1], xp + p + 1, embed);
        }
        out = _mm512_fmadd_ps(f == F_I8H ? m128 : d, _mm512_add_ps(acc0, acc1), out);
        return f == F_I8M ? _mm512_fmadd_ps(m128, _mm512_set1_ps(gsum), out) : out;
    }
    for (int c = 0; c < 4; c++) {
        acc0 = dp_bcast(acc0, q[4 * c], xp + 4 * c, embed);
        acc1 = dp_bcast(acc1, q[4 * c + 1], xp + 4 * c + 1, embed);
        acc0 = dp_bcast(acc0, q[4 * c + 2], xp + 4 * c + 2, embed);
        acc1 = dp_bcast(acc1, q[4 * c + 3], xp + 4 * c + 3, embed);
    }
    out = _mm512_fmadd_ps(d, _mm512_add_ps(acc0, acc1), out);
    return _mm512_fmadd_ps(m128, _mm512_set1_ps(gsum), out);
}

/* d and m - 128 d of a (tile, group), f32 */
static inline __attribute__((always_inline)) void scales(const uint8_t *blk, __m512 *d,
                                                         __m512 *m128) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
    *m128 = _mm512_fnmadd_ps(*d, _mm512_set1_ps(128.f), m);
}

/* Few rows: one tile (16 output columns) for nb <= ROWS_IN_FLIGHT rows, outputs in registers
 * across the groups. */
/* An 8-bit (tile, group)'s 16 weight vectors: q[p] is pair p (weights 2p, 2p + 1) of the 16
 * rows as bf16, exact (|code| <= 128): 32 int8 codes at blk + 32 p, row j's pair at bytes 2j,
 * 2j + 1, widened to f32 and narrowed to bf16 (no cheaper exact int8 -> bf16 exists). */
static inline __attribute__((always_inline)) void decode_i8(const uint8_t *blk, __m512bh q[16]) {
    for (int p = 0; p < 16; p++) {
        __m512 lo = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * p))));
        __m512 hi = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * p + 16))));
        q[p] = _mm512_cvtne2ps_pbh(hi, lo); /* lo: rows 0-7, the low half */
    }
}

/* A (tile, group)'s weights as dpbf16 operands and its scales: Q4 d and m - 128 d; I8 d (a
 * only); I8H d of each half (a, b); I8M d and m. */
static inline __attribute__((always_inline)) void load_group(const uint8_t *blk, __m512bh q[16],
                                                             __m512 *a, __m512 *b, const int f) {
    if (f == F_Q4) {
        decode(blk, q);
        scales(blk, a, b);
        return;
    }
    decode_i8(blk, q);
    *a = _mm512_loadu_ps((const float *)(blk + 512));
    *b = f == F_I8 ? _mm512_setzero_ps() : _mm512_loadu_ps((const float *)(blk + 576));
}

static inline __attribute__((always_inline)) void tile(
    const uint8_t *w, const uint16_t *x, int64_t k, const float *gsum, int64_t ng, const int nb,
    uint16_t *y, int64_t n, const int f, const uint8_t *pf) {
    __m512 out[ROWS_IN_FLIGHT];
    for (int b = 0; b < nb; b++) out[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *blk = w + g * BLOCK(f);
        if (pf) /* the same group of a tile PF_TILES ahead, into L2 (see matmul) */
            for (int c = 0; c < BLOCK(f); c += 64) __builtin_prefetch(pf + g * BLOCK(f) + c, 0, 2);
        __m512bh q[16];
        __m512 d, m128;
        load_group(blk, q, &d, &m128, f);
        for (int b = 0; b < nb; b++)
            out[b] = group_out(q, x + b * k + g * 32, d, m128, gsum[b * ng + g], out[b], 0, f);
    }
    for (int b = 0; b < nb; b++)
        _mm256_storeu_si256((__m256i *)(y + b * n), (__m256i)_mm512_cvtneps_pbh(out[b]));
}

/* Many rows: nb <= ROWS_IN_FLIGHT rows' share of one (tile, group), their outputs in o. */
static inline __attribute__((always_inline)) void rows_group(
    const __m512bh q[16], __m512 d, __m512 m128, const uint16_t *xg, int64_t k,
    const float *gs, int64_t ng, const int nb, float *o, const int f) {
    for (int b = 0; b < nb; b++)
        _mm512_storeu_ps(o + 16 * b, group_out(q, xg + b * k, d, m128, gs[b * ng],
                                               _mm512_loadu_ps(o + 16 * b), 1, f));
}

/* Many rows: one tile for rows [r0, r0 + nr): each (tile, group) decoded once, rows streamed
 * through its registers, the f32 outputs in o [nr, 16] (L1) across the groups. */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *w, const uint16_t *x, int64_t k, const float *gsum, int64_t ng, int64_t nr,
    uint16_t *y, int64_t n, float *o, const int f) {
    memset(o, 0, sizeof(float) * 16 * (size_t)nr);
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *blk = w + g * BLOCK(f);
        __m512bh q[16];
        __m512 d, m128;
        load_group(blk, q, &d, &m128, f);
        const uint16_t *xg = x + g * 32;
        const float *gs = gsum + g;
        int64_t r = 0;
        for (; r + ROWS_IN_FLIGHT <= nr; r += ROWS_IN_FLIGHT)
            rows_group(q, d, m128, xg + r * k, k, gs + r * ng, ng, ROWS_IN_FLIGHT, o + 16 * r,
                       f);
        switch (nr - r) {
        case 1: rows_group(q, d, m128, xg + r * k, k, gs + r * ng, ng, 1, o + 16 * r, f); break;
        case 2: rows_group(q, d, m128, xg + r * k, k, gs + r * ng, ng, 2, o + 16 * r, f); break;
        case 3: rows_group(q, d, m128, xg + r * k, k, gs + r * ng, ng, 3, o + 16 * r, f); break;
        default: break;
        }
    }
    for (int64_t r = 0; r < nr; r++)
        _mm256_storeu_si256((__m256i *)(y + r * n),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(o + 16 * r)));
}

/* y [rows, n] bf16 = x [rows, k] bf16 (contiguous) times the packed W [n, k]^T. Returns 0, or 1
 * for a shape the layout cannot hold, 2 when out of memory. Every row's result is the same
 * bits whatever the row count or thread count (both paths share group_sums and group_out). */
static inline __attribute__((always_inline)) int matmul(const uint8_t *w, const uint16_t *x,
                                                        int64_t rows, int64_t n, int64_t k,
                                                        uint16_t *y, const int f) {
    if (n < 0 || k < 0 || n % 16 || k % 32 || rows < 0) return 1;
    int64_t ng = k / 32, tiles = n / 16;
    float *gsum = malloc(sizeof(float) * (size_t)(rows * ng + 1));
    if (!gsum) return 2;
    if (rows < MANY_ROWS) {
        group_sums(x, rows * ng, gsum);
        /* Each thread streams its tiles once; a decode step's matrices are small (a few
         * hundred KB a thread), so the hardware's stream prefetcher is still ramping up when
         * one ends: each group prefetches its twin PF_TILES tiles ahead (measured below). */
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *wt = w + t * ng * BLOCK(f);
            for (int64_t r = 0; r < rows; r += ROWS_IN_FLIGHT) {
                const uint16_t *xr = x + r * k;
                const float *gr = gsum + r * ng;
                uint16_t *yr = y + r * n + t * 16;
                const uint8_t *pf = r == 0 && t + PF_TILES < tiles ? wt + PF_TILES * ng * BLOCK(f)
                                                                   : NULL;
                switch (rows - r < ROWS_IN_FLIGHT ? rows - r : ROWS_IN_FLIGHT) {
                case 1: tile(wt, xr, k, gr, ng, 1, yr, n, f, pf); break;
                case 2: tile(wt, xr, k, gr, ng, 2, yr, n, f, pf); break;
                case 3: tile(wt, xr, k, gr, ng, 3, yr, n, f, pf); break;
                default: tile(wt, xr, k, gr, ng, 4, yr, n, f, pf); break;
                }
            }
        }
        free(gsum);
        return 0;
    }
    /* row blocks outer, so a block's activations stay in L2 while each thread walks its tiles
     * (the same tiles every block: its weights stay in its L2 too when they fit) */
    int64_t rb = RB_BYTES / (2 * k);
    rb = rb > RB_MAX ? RB_MAX : (rb < ROWS_IN_FLIGHT ? ROWS_IN_FLIGHT : rb);
    rb -= rb % ROWS_IN_FLIGHT;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) group_sums(x + r * k, ng, gsum + r * ng);
        float o[RB_MAX * 16] __attribute__((aligned(64)));
        for (int64_t r0 = 0; r0 < rows; r0 += rb) {
            int64_t nr = rows - r0 < rb ? rows - r0 : rb;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; t++)
                tile_rows(w + t * ng * BLOCK(f), x + r0 * k, k, gsum + r0 * ng, ng, nr,
                          y + r0 * n + t * 16, n, o, f);
        }
    }
    free(gsum);
    return 0;
}

int q4_matmul_bf16(const uint8_t *w, const uint16_t *x, int64_t rows, int64_t n, int64_t k,
                   uint16_t *y) {
    return matmul(w, x, rows, n, k, y, F_Q4);
}

/* The same for 8-bit tiles (quant.py's pack_i8): codes c in int8 (Q8_0's own, Q6_K's q - 32,
 * Q5_0's q - 16, Q5_1's and Q5_K's q), one bf16 dot product a pair of activations for 16 rows as
 * in the 4-bit tiles, w = d c (+ m): exact products, f32 sums, each half or group times its f32
 * scale (the file's d, or d sc as qmm.c computes it) with one FMA, so times the identity the
 * weights are gguf-py's d c (+ m) bit for bit. The codes take the 16-bit lanes as bf16
 * themselves (not 128 + c), so the 5-, 6- and 8-bit types need no offset term and no second
 * plane: 1 + 1/8 bytes a weight for Q8_0 and Q5_0 (the file's 1 + 1/16 and 11/16), 1 + 1/4 for
 * the others, against 2 for the dense bf16 they ran before. */
int i8_matmul_bf16(int f, const uint8_t *w, const uint16_t *x, int64_t rows, int64_t n,
                   int64_t k, uint16_t *y) {
    switch (f) {
    case F_I8: return matmul(w, x, rows, n, k, y, F_I8);
    case F_I8H: return matmul(w, x, rows, n, k, y, F_I8H);
    case F_I8M: return matmul(w, x, rows, n, k, y, F_I8M);
    default: return 1;
    }
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
            const uint8_t *blk = w + (t * ng + g) * BLOCK(F_Q4);
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

int i8_matmul_bf16(int f, const uint8_t *w, const uint16_t *x, int64_t rows, int64_t n,
                   int64_t k, uint16_t *y) {
    (void)f; (void)w; (void)x; (void)rows; (void)n; (void)k; (void)y;
    return 1;
}

#endif
