/* y = x W^T for W in a GGUF file's own block form (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
 * Q6_K, F16, BF16, F32), read where it lies: each weight row is its blocks as in the file, so a
 * matrix costs the file's bytes per weight and needs no repacking (quant.py's QuantLinear).
 *
 * Why portable C: the same source is built for every CPU variant (kernels.py: AVX512-BF16,
 * AVX512, AVX2, generic), with GCC's vector extensions for 16-float vectors (one zmm, two ymm,
 * or four xmm registers), so every variant computes the same operations in the same order.
 *
 * The arithmetic, which makes a row's result the same bits at any row count or thread count
 * (deterministic mode), and times the identity the file's weights: each group of 32 weights is
 * decoded to f32 exactly as gguf-py's dequantization computes it (d q, d q + m, or (d sc) q -
 * dmin mn: the affine ones as one fused multiply-add where the CPU has FMA, within one f32
 * rounding of gguf-py's separate multiply and add), then every activation row accumulates
 * acc += w[0:16] x[0:16]; acc += w[16:32] x[16:32] over the groups in order, 16 lanes, and the
 * lanes are summed in one fixed tree (hsum16). Few rows decode a group into registers for all
 * rows; many rows decode a column once into a buffer per block of rows: the same values and the
 * same chain per row either way. Built without -fassociative-math (kernels.py), so the compiler
 * keeps this order. That f32 loop runs the float types (F16, BF16, F32) and decodes rows for the
 * head and the embedding (qmm_head_dots, qmm_rows_f32); the quantized types take integer dot
 * products on 16-bit activations (qmm_int below), with the same properties: row-invariant bits,
 * the file's weights times the identity. Which matrices run here is the route table's
 * (kernel_routes.py): the float types on the builds without AVX512-BF16, and the quantized
 * matrices the 16-row tiles of i8act.c cannot hold.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int16_t v8s __attribute__((vector_size(16)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef int8_t v8c __attribute__((vector_size(8)));
typedef uint8_t v16b __attribute__((vector_size(16)));

/* 8-lane vectors (one ymm, two xmm): GCC 12 lowers wider generic vectors poorly on AVX2. A
 * group's 32 weights are four of them, w[0..3], and the 16-lane accumulator of the arithmetic
 * above is two, lanes 0-7 and 8-15 (w[0], w[2] go to the first, w[1], w[3] to the second). */
static inline v8f loadf(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v16b loadb(const uint8_t *p) {
    v16b v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* bytes -> floats through 16 and 32 bits: GCC 12 scalarizes a direct 8-to-32-bit conversion */
static inline v8i widen(v8b q) { return __builtin_convertvector(__builtin_convertvector(q, v8s), v8i); }
static inline v8i widen_s(v8c q) { return __builtin_convertvector(__builtin_convertvector(q, v8s), v8i); }
static inline v8f tof(v8i q) { return __builtin_convertvector(q, v8f); }
static inline v8b lo8(v16b q) { return __builtin_shufflevector(q, q, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8b hi8(v16b q) { return __builtin_shufflevector(q, q, 8, 9, 10, 11, 12, 13, 14, 15); }

/* 16 codes (bytes, unsigned or signed) as two 8-lane integer vectors. With AVX2 one
 * vpmovzxbd / vpmovsxbd each (GCC's generic conversions take three instructions and a lane
 * insert here). */
#if defined(__AVX2__)
static inline void codes16(v16b q, v8i *a, v8i *b) {
    *a = (v8i)_mm256_cvtepu8_epi32((__m128i)q);
    *b = (v8i)_mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)q, 8));
}
static inline void scodes16(v16b q, v8i *a, v8i *b) {
    *a = (v8i)_mm256_cvtepi8_epi32((__m128i)q);
    *b = (v8i)_mm256_cvtepi8_epi32(_mm_srli_si128((__m128i)q, 8));
}
#else
static inline void codes16(v16b q, v8i *a, v8i *b) {
    *a = widen(lo8(q));
    *b = widen(hi8(q));
}
static inline void scodes16(v16b q, v8i *a, v8i *b) {
    *a = widen_s((v8c)lo8(q));
    *b = widen_s((v8c)hi8(q));
}
#endif

/* ggml's type ids */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

#define FEW_ROWS 4    /* up to this many rows: groups decoded into registers */
#define ROW_BLOCK 128   /* many rows: rows per block, a column decoded once per block */

/* IEEE half -> float, exact for every input (subnormals, infinities, NaNs). */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) { /* zero or subnormal: m 2^-24, exact in f32 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* 8 halves -> floats, exact: the bits moved into an f32, rescaled by 2^112 (normal and
 * subnormal alike), infinities and NaNs given f32's all-ones exponent. */
static inline v8f f16x8(const uint8_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u);
    v8u mag = (u & 0x7fff) << 13;
    v8f f;
    memcpy(&f, &mag, sizeof f);
    f *= 5.192296858534828e33f; /* 2^112 */
    v8u bits;
    memcpy(&bits, &f, sizeof bits);
    v8u special = (v8u)((u & 0x7c00) == 0x7c00);
    bits = (bits & ~special) | (special & ((u & 0x3ff) << 13 | 0x7f800000u));
    bits |= (u & 0x8000) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline v8f bf16x8(const uint8_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A Q4_K / Q5_K sub-block's 6-bit scale and min (gguf-py's Q4_K.get_scale_min). */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Sub-block j of a Q4_K / Q5_K super-block b as w = scale q + off (gguf-py's d sc, -dmin mn). */
static inline void k_affine(const uint8_t *b, int j, float *scale, float *off) {
    int sc, mn;
    k_scale_min(b + 4, j, &sc, &mn);
    *scale = f16_to_f32(rd16(b)) * (float)sc;
    *off = -(f16_to_f32(rd16(b + 2)) * (float)mn);
}

/* Where group s (32 weights) of a Q6_K super-block b lies: its low and high code bytes (ql, qh: 32 each,
 * a code ((ql >> lsh) & 15) | ((qh >> hsh) & 3) << 4), its two sub-blocks' scales and d. */
typedef struct {
    const uint8_t *ql, *qh;
    const int8_t *sc;
    float d;
    int lsh, hsh;
} q6k_t;

static inline q6k_t q6k_at(const uint8_t *b, int s) {
    int h = s / 4, s2 = s % 4;
    return (q6k_t){b + 64 * h + 32 * (s2 & 1), b + 128 + 32 * h, (const int8_t *)(b + 192) + 2 * s,
                   f16_to_f32(rd16(b + 208)), 4 * (s2 / 2), 2 * s2};
}

/* The fifth bits of 32 weights (bit i of qh for weight i) as 16s in bytes: h0 weights 0-15,
 * h1 16-31. Each byte of qh copied to 8 lanes, masked by its lane's bit (byte ops, one register
 * each, where a variable shift a lane takes eight). */
#if defined(__AVX2__)
static inline void q5_high(uint32_t qh, v16b *h0, v16b *h1) { /* the same in three AVX2 ops */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i q = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                    _mm256_setr_epi64x(0, 0x0101010101010101LL,
                                                       0x0202020202020202LL,
                                                       0x0303030303030303LL));
    q = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(q, bit), bit), _mm256_set1_epi8(16));
    *h0 = (v16b)_mm256_castsi256_si128(q);
    *h1 = (v16b)_mm256_extracti128_si256(q, 1);
}
#else
static inline void q5_high(uint32_t qh, v16b *h0, v16b *h1) {
    const v16b bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    v16b q = (v16b){(uint8_t)qh, (uint8_t)(qh >> 8), (uint8_t)(qh >> 16), (uint8_t)(qh >> 24)};
    v16b b0 = __builtin_shufflevector(q, q, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    v16b b1 = __builtin_shufflevector(q, q, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    *h0 = (v16b)((b0 & bit) != 0) & 16;
    *h1 = (v16b)((b1 & bit) != 0) & 16;
}
#endif

/* The one block decoder of each quantized type. Groups of 32 weights are addressed as group j
 * of block b: a K-quant's super-block holds 8 (GPB), the other types' blocks one, so a loop
 * over a row's blocks with j a constant (unrolled) decodes a super-block's shared scales once.
 * A group is its codes c0 (weights 0-15) and c1 (16-31) as bytes, w = d_h (c - bias) + m: d0,
 * d1 the halves' scales (equal but for Q6_K's sub-blocks of 16), m the affine types' offset
 * (0 for the others), bias the symmetric types' centre (8, 16 or 32; 0 for the affine ones).
 * Q8_0's codes are its signed bytes (bias 0: read them as int8). Every path takes its weights
 * from here: the f32 loop (group), the integer dot products (igroup_at) and the int8 tiles
 * (qmm_codes), so a format is decoded in one place. */
typedef struct {
    v16b c0, c1;
    float d0, d1, m;
    int bias;
} small_t;

static inline int has_offset(int t) {
    return t == T_Q4_1 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K;
}

static inline int is_k(int t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }
#define GPB(t) (is_k(t) ? 8 : 1) /* groups a block */

/* Bytes a block of a quantized type (the blocks a row is made of; qmm_block tells Python) */
static inline int64_t block_bytes(int t) {
    switch (t) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    default: return 210; /* T_Q6_K */
    }
}

static inline __attribute__((always_inline)) small_t codes_at(const int t, const uint8_t *b,
                                                              const int j) {
    small_t o = {.m = 0.f, .bias = 0};
    switch (t) {
    case T_Q8_0:
        o.d0 = o.d1 = f16_to_f32(rd16(b));
        o.c0 = loadb(b + 2);
        o.c1 = loadb(b + 18);
        break;
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q5_1: {
        const int one = t == T_Q4_1 || t == T_Q5_1, five = t == T_Q5_0 || t == T_Q5_1;
        o.d0 = o.d1 = f16_to_f32(rd16(b));
        if (one) o.m = f16_to_f32(rd16(b + 2));
        else o.bias = five ? 16 : 8;
        v16b c = loadb(b + (one ? 4 : 2) + (five ? 4 : 0));
        o.c0 = c & 15;
        o.c1 = c >> 4;
        if (five) {
            uint32_t qh;
            memcpy(&qh, b + (one ? 4 : 2), 4);
            v16b h0, h1;
            q5_high(qh, &h0, &h1);
            o.c0 |= h0;
            o.c1 |= h1;
        }
        break;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = t == T_Q5_K;
        k_affine(b, j, &o.d0, &o.m);
        o.d1 = o.d0;
        const uint8_t *qs = b + (five ? 48 : 16) + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        o.c0 = (loadb(qs) >> shift) & 15;
        o.c1 = (loadb(qs + 16) >> shift) & 15;
        if (five) {
            o.c0 |= ((loadb(b + 16) >> j) & 1) << 4;
            o.c1 |= ((loadb(b + 32) >> j) & 1) << 4;
        }
        break;
    }
    default: { /* T_Q6_K */
        q6k_t z = q6k_at(b, j);
        o.c0 = ((loadb(z.ql) >> z.lsh) & 15) | (((loadb(z.qh) >> z.hsh) & 3) << 4);
        o.c1 = ((loadb(z.ql + 16) >> z.lsh) & 15) | (((loadb(z.qh + 16) >> z.hsh) & 3) << 4);
        o.d0 = z.d * (float)z.sc[0];
        o.d1 = z.d * (float)z.sc[1];
        o.bias = 32;
        break;
    }
    }
    return o;
}

/* Group g of a row (any position: the block and group within it computed) */
static inline __attribute__((always_inline)) small_t small_codes(const int t, const uint8_t *row,
                                                                 int64_t g) {
    return codes_at(t, row + block_bytes(t) * (g / GPB(t)), (int)(g % GPB(t)));
}

/* Group g (32 weights) of a row in type t as gguf-py dequantizes it, w[i] = weights 8i..8i+7:
 * the quantized types from their decoder (d (c - bias), or d c + m as one fused multiply-add
 * where the CPU has FMA), the float types as they lie. */
static inline __attribute__((always_inline)) void group(const int t, const uint8_t *row,
                                                        int64_t g, v8f w[4]) {
    switch (t) {
    case T_F16:
        for (int i = 0; i < 4; i++) w[i] = f16x8(row + 64 * g + 16 * i);
        return;
    case T_BF16:
        for (int i = 0; i < 4; i++) w[i] = bf16x8(row + 64 * g + 16 * i);
        return;
    case T_F32:
        memcpy(w, row + 128 * g, 128);
        return;
    default: {
        small_t z = small_codes(t, row, g);
        v8i q[4];
        if (t == T_Q8_0) {
            scodes16(z.c0, &q[0], &q[1]);
            scodes16(z.c1, &q[2], &q[3]);
        } else {
            codes16(z.c0, &q[0], &q[1]);
            codes16(z.c1, &q[2], &q[3]);
        }
        for (int i = 0; i < 4; i++) {
            float d = i < 2 ? z.d0 : z.d1;
            w[i] = has_offset(t) ? tof(q[i]) * d + z.m : tof(q[i] - z.bias) * d;
        }
        return;
    }
    }
}

/* A row's 32-lane accumulator (a[i]: lanes 8i..8i+7, lane j takes weight j of every group)
 * summed in one fixed order: a[0] + a[1], a[2] + a[3], their sum, then halves of 8 lanes. */
static inline float hsum32(const v8f a[4]) {
    v8f s = (a[0] + a[1]) + (a[2] + a[3]);
    float f[8];
    memcpy(f, &s, sizeof f);
    f[0] += f[4], f[1] += f[5], f[2] += f[6], f[3] += f[7];
    f[0] += f[2], f[1] += f[3];
    return f[0] + f[1];
}

/* One row's share of a group: four independent chains, one per 8 weights. */
static inline __attribute__((always_inline)) void fma_group(v8f a[4], const v8f w[4],
                                                            const float *x) {
    for (int i = 0; i < 4; i++) a[i] += w[i] * loadf(x + 8 * i);
}

/* Few rows: column `row` of W against NR <= FEW_ROWS rows of xf (f32, stride k); NR a
 * constant, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void col_few(const int t, const uint8_t *row,
                                                          const float *xf, const int nr,
                                                          int64_t k, uint16_t *y, int64_t n) {
    v8f acc[FEW_ROWS][4] = {};
    for (int64_t g = 0; g < k / 32; g++) {
        v8f w[4];
        group(t, row, g, w);
        for (int r = 0; r < nr; r++) fma_group(acc[r], w, xf + r * k + 32 * g);
    }
    for (int r = 0; r < nr; r++) y[r * n] = f32_to_bf16(hsum32(acc[r]));
}

/* Many rows: COL_BLOCK columns decoded once into wbuf [COL_BLOCK][k] f32, then for each
 * activation row (read once from memory per block of columns, then from L1) the columns in
 * threes: 3 x 4 accumulators and the row's 4 vectors fill AVX2's 16 registers, the weights
 * come from wbuf as memory operands. Each (row, column) keeps col_few's chains and order, so
 * the bits are the same at any row count. The earlier loop (a column against every row of a
 * 32-row block) re-read those rows from L2 for each column and spilled its accumulators:
 * ~190 rows/s on the default model with AVX2, the cache traffic and not the FMAs its limit. */
#define COL_BLOCK 6
static inline __attribute__((always_inline)) void cols_many(
    const int t, const uint8_t *w, int64_t row_bytes, int nc, const float *xf, int nr,
    int64_t k, uint16_t *y, int64_t n, float *wbuf) {
    for (int c = 0; c < nc; c++)
        for (int64_t g = 0; g < k / 32; g++) {
            v8f v[4];
            group(t, w + c * row_bytes, g, v);
            memcpy(wbuf + c * k + 32 * g, v, sizeof v); /* wbuf is only float-aligned */
        }
    for (int r = 0; r < nr; r++) {
        const float *xr = xf + r * k;
        int c = 0;
        for (; c + 3 <= nc; c += 3) {
            v8f acc[3][4] = {};
            const float *w0 = wbuf + c * k;
            for (int64_t g = 0; g < k / 32; g++) {
                v8f x[4];
                for (int i = 0; i < 4; i++) x[i] = loadf(xr + 32 * g + 8 * i);
                for (int m = 0; m < 3; m++)
                    for (int i = 0; i < 4; i++)
                        acc[m][i] += loadf(w0 + m * k + 32 * g + 8 * i) * x[i];
            }
            for (int m = 0; m < 3; m++) y[r * n + c + m] = f32_to_bf16(hsum32(acc[m]));
        }
        for (; c < nc; c++) {
            v8f acc[4] = {};
            for (int64_t g = 0; g < k / 32; g++)
                for (int i = 0; i < 4; i++)
                    acc[i] += loadf(wbuf + c * k + 32 * g + 8 * i) * loadf(xr + 32 * g + 8 * i);
            y[r * n + c] = f32_to_bf16(hsum32(acc));
        }
    }
}

/* The quantized types multiply in integers, as llama.cpp's CPU kernels do, but with 16-bit
 * activations: the f32 loop above
 * spent ~33 instructions a group of 32 decoding to floats (compute-bound: ~8-10 GB/s of blocks
 * on 2 cores), where vpmaddwd multiplies 16 code / activation pairs in one.
 *
 * Each row's group of 32 bf16 activations becomes a = x 2^-e in int16, e chosen from the
 * group's largest |x| (its a in [2^14, 2^15)): every activation within 2^7 of that largest one
 * is exact (bf16 has 8 significant bits), smaller ones round to 2^e (at most 2^-15 of the
 * largest). A group's integer sums are exact; each of its 8 lanes (the sum of 4 products, under
 * 2^24) converts to f32 exactly and adds d_h 2^e times it to the output's 8-lane accumulator
 * (one fused multiply-add a group, two for Q6_K's sub-blocks of 16), the affine types' offsets
 * m (2^e sum a) to a scalar one, groups in order (a K-quant's 8 at a time: lane j takes its
 * super-blocks' group j), the 8 lanes then summed in one fixed tree.
 * Both paths (few rows, many rows) run this very sequence per output (ig_row), so a row's bits
 * are the same at any row count or thread count. Times the identity (a = 2^14, e = -14) the
 * result is d c + m rounded once: gguf-py's weight, the affine types included. */
#define PF_ROWS 8

typedef int16_t v16s __attribute__((vector_size(32)));
typedef int8_t v16c __attribute__((vector_size(16)));
typedef int16_t v8s2 __attribute__((vector_size(16)));

/* A group's 32 codes as int16 (c[0]: weights 0-15, c[1]: 16-31), w = d_h c + m. */
typedef struct {
    v16s c[2];
    float d0, d1, m;
} igroup;

static inline v16s widen16(v16b q) {
#if defined(__AVX2__)
    return (v16s)_mm256_cvtepu8_epi16((__m128i)q);
#else
    return __builtin_convertvector(q, v16s);
#endif
}

static inline v16s swiden16(v16b q) {
#if defined(__AVX2__)
    return (v16s)_mm256_cvtepi8_epi16((__m128i)q);
#else
    return __builtin_convertvector((v16c)q, v16s);
#endif
}

/* lane i = c[2i] a[2i] + c[2i + 1] a[2i + 1], exactly (vpmaddwd) */
static inline v8i madd(v16s c, v16s a) {
#if defined(__AVX2__)
    return (v8i)_mm256_madd_epi16((__m256i)c, (__m256i)a);
#elif defined(__SSE2__)
    /* the generic x86 build: pmaddwd on each half (GCC turns the portable form below into
     * ~20 shuffles and multiplies a lane) */
    typedef int32_t v4i __attribute__((vector_size(16)));
    v8s2 c0 = __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7);
    v8s2 c1 = __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15);
    v8s2 a0 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    v8s2 a1 = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4i r0 = (v4i)_mm_madd_epi16((__m128i)c0, (__m128i)a0);
    v4i r1 = (v4i)_mm_madd_epi16((__m128i)c1, (__m128i)a1);
    return __builtin_shufflevector(r0, r1, 0, 1, 2, 3, 4, 5, 6, 7);
#elif defined(RS_NEON)
    /* smull / smull2 of each half, then addp of neighbouring products: the same exact sums */
    v8s2 c0 = __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7);
    v8s2 c1 = __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15);
    v8s2 a0 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    v8s2 a1 = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    int16x8_t n0 = (int16x8_t)c0, n1 = (int16x8_t)c1, b0 = (int16x8_t)a0, b1 = (int16x8_t)a1;
    int32x4_t r0 = vpaddq_s32(vmull_s16(vget_low_s16(n0), vget_low_s16(b0)),
                              vmull_high_s16(n0, b0));
    int32x4_t r1 = vpaddq_s32(vmull_s16(vget_low_s16(n1), vget_low_s16(b1)),
                              vmull_high_s16(n1, b1));
    typedef int32_t v4i __attribute__((vector_size(16)));
    return __builtin_shufflevector((v4i)r0, (v4i)r1, 0, 1, 2, 3, 4, 5, 6, 7);
#else
    v8s2 ce = __builtin_shufflevector(c, c, 0, 2, 4, 6, 8, 10, 12, 14);
    v8s2 co = __builtin_shufflevector(c, c, 1, 3, 5, 7, 9, 11, 13, 15);
    v8s2 ae = __builtin_shufflevector(a, a, 0, 2, 4, 6, 8, 10, 12, 14);
    v8s2 ao = __builtin_shufflevector(a, a, 1, 3, 5, 7, 9, 11, 13, 15);
    return __builtin_convertvector(ce, v8i) * __builtin_convertvector(ae, v8i)
           + __builtin_convertvector(co, v8i) * __builtin_convertvector(ao, v8i);
#endif
}

static inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__) /* fmla on each half: every aarch64 build fuses, as x86's FMA ones */
    v8f r;
    for (int i = 0; i < 8; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#else
    return a * b + c;
#endif
}


static inline __attribute__((always_inline)) void igroup_at(const int t, const uint8_t *b,
                                                            const int j, igroup *o) {
    small_t z = codes_at(t, b, j);
    o->d0 = z.d0, o->d1 = z.d1, o->m = z.m;
    if (t == T_Q8_0) {
        o->c[0] = swiden16(z.c0);
        o->c[1] = swiden16(z.c1);
        return;
    }
    o->c[0] = widen16(z.c0) - (int16_t)z.bias;
    o->c[1] = widen16(z.c1) - (int16_t)z.bias;
}

/* The activations of `rows` rows as int16 groups: a [rows, k], the groups' 2^e in s and
 * 2^e (sum of a) in sa [rows, k / 32]. A group of zeros gets s = 0; one with an infinity or
 * a NaN s = NaN, so every output it reaches is NaN (the f32 loop gives +-inf for an infinity
 * times a weight that is not zero); e is at least -115 (tiny groups keep their bits down to
 * 2^-115, their s a normal float). Accuracy beyond the identity: an activation under 2^-7 of
 * its group's largest is rounded to 2^e, up to 2^-16 of that largest (the f32 loop used the
 * bf16 value itself); an output can lose more than the bf16 output rounding only where such
 * small activations carry it against a group's outlier whose weight is near zero. */
static void quant_acts(const uint16_t *x, int64_t rows, int64_t k, int16_t *a, float *s,
                       float *sa) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * (k / 32); i++) {
        const uint16_t *xg = x + 32 * i;
        int16_t *ag = a + 32 * i;
        float xf[32], mx = 0.f;
        for (int j = 0; j < 32; j++) {
            xf[j] = bf16_to_f32(xg[j]);
            float v = __builtin_fabsf(xf[j]);
            mx = v > mx || v != v ? v : mx;
        }
        if (mx == 0.f || !(mx <= 3.4028234663852886e38f)) {
            memset(ag, 0, 64);
            s[i] = sa[i] = mx == 0.f ? 0.f : __builtin_nanf("");
            continue;
        }
        int ex;
        frexpf(mx, &ex); /* mx in [2^(ex - 1), 2^ex) */
        int e = ex - 15 < -115 ? -115 : ex - 15;
        float inv = ldexpf(1.f, -e);
        int32_t tot = 0;
        for (int j = 0; j < 32; j++) {
            int32_t q = (int32_t)__builtin_rintf(xf[j] * inv);
            ag[j] = (int16_t)q;
            tot += q;
        }
        s[i] = ldexpf(1.f, e);
        sa[i] = s[i] * (float)tot; /* |tot| < 2^21: exact, and so is the product */
    }
}

/* One row's share of group g (ag: its 32 int16 activations, s and sa its group's 2^e and
 * 2^e sum a) added to an output's accumulators: the sequence every path runs. */
static inline __attribute__((always_inline)) void ig_row(const int t, const igroup *gr,
                                                         const int16_t *ag, float s, float sa,
                                                         v8f *acc, float *off) {
    v16s a0, a1;
    memcpy(&a0, ag, sizeof a0);
    memcpy(&a1, ag + 16, sizeof a1);
    v8i s0 = madd(gr->c[0], a0), s1 = madd(gr->c[1], a1);
    if (t == T_Q6_K) {
        v8f d0 = {}, d1 = {};
        d0 += gr->d0 * s;
        d1 += gr->d1 * s;
        *acc = fma8(tof(s0), d0, *acc);
        *acc = fma8(tof(s1), d1, *acc);
        return;
    }
    v8f d = {};
    d += gr->d0 * s;
    *acc = fma8(tof(s0 + s1), d, *acc);
    if (has_offset(t) && !is_k(t)) *off = fma1(gr->m, sa, *off);
}

/* A K-quant super-block b's 8 offsets -(dmin mn_j), each as k_affine computes it: the mins of
 * k_scale_min taken 8 at a time (scales[4..11], with scales[4..7]'s high bits for j >= 4) */
static inline v8f k_offsets(const uint8_t *b) {
    const float dmin = f16_to_f32(rd16(b + 2));
#if defined(__AVX2__)
    const __m128i u = _mm_loadl_epi64((const __m128i *)(b + 8)); /* scales[4..11] */
    const __m128i lo = _mm_and_si128(u, _mm_set1_epi8(63));
    const __m128i top = _mm_shuffle_epi8(u, _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3,
                                                         0, 1, 2, 3));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(u, 4), _mm_set1_epi8(15)),
                                    _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
    const __m128i mn = _mm_blend_epi32(lo, hi, 2); /* bytes 0-3 from lo, 4-7 from hi */
    v8f m = tof((v8i)_mm256_cvtepu8_epi32(mn));
#else
    v8f m;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        m[j] = (float)mn;
    }
#endif
    return -(m * dmin);
}

/* The 8 lanes of v in one fixed order */
static inline float hsum8(v8f v) {
    float f[8];
    memcpy(f, &v, sizeof f);
    f[0] += f[4], f[1] += f[5], f[2] += f[6], f[3] += f[7];
    f[0] += f[2], f[1] += f[3];
    return f[0] + f[1];
}

/* An output's 8 lanes in one fixed order, plus its offsets' sum. */
static inline float ig_result(v8f acc, float off) { return hsum8(acc) + off; }

typedef struct {
    const int16_t *a;
    const float *s, *sa;
    int64_t k;
} iacts;

/* Group j of block b (group g of the row) against nr activation rows. */
static inline __attribute__((always_inline)) void icol_group(const int t, const uint8_t *b,
                                                             const int j, int64_t g,
                                                             const iacts *x, const int nr,
                                                             v8f *acc, float *off) {
    const int64_t k = x->k, ng = k / 32;
    igroup gr;
    igroup_at(t, b, j, &gr);
    for (int r = 0; r < nr; r++)
        ig_row(t, &gr, x->a + r * k + 32 * g, x->s[r * ng + g], x->sa[r * ng + g], &acc[r],
               &off[r]);
}

/* An output's result: its 8 lanes, plus its offsets (a K-quant's in 8 lanes, one a group of
 * its super-blocks, summed in the same order). */
static inline float ig_out(const int t, v8f acc, float off, v8f koff) {
    return ig_result(acc, is_k(t) ? hsum8(koff) : off);
}

/* Few rows: column `row` of W against nr <= FEW_ROWS activation rows. A K-quant's offsets
 * -(dmin mn_j) (sum of a) go 8 at a time, one fused multiply-add a super-block. */
static inline __attribute__((always_inline)) void icol_few(const int t, const uint8_t *row,
                                                           const iacts *x, const int nr,
                                                           uint16_t *y, int64_t n) {
    const int64_t ng = x->k / 32;
    v8f acc[FEW_ROWS] = {}, koff[FEW_ROWS] = {};
    float off[FEW_ROWS] = {};
    for (int64_t g0 = 0; g0 < ng; g0 += GPB(t)) {
        const uint8_t *b = row + block_bytes(t) * (g0 / GPB(t));
        if (is_k(t)) { /* j a constant in each: the super-block's scales decoded once */
            icol_group(t, b, 0, g0, x, nr, acc, off), icol_group(t, b, 1, g0 + 1, x, nr, acc, off);
            icol_group(t, b, 2, g0 + 2, x, nr, acc, off), icol_group(t, b, 3, g0 + 3, x, nr, acc, off);
            icol_group(t, b, 4, g0 + 4, x, nr, acc, off), icol_group(t, b, 5, g0 + 5, x, nr, acc, off);
            icol_group(t, b, 6, g0 + 6, x, nr, acc, off), icol_group(t, b, 7, g0 + 7, x, nr, acc, off);
            if (has_offset(t)) {
                v8f m = k_offsets(b);
                for (int r = 0; r < nr; r++)
                    koff[r] = fma8(m, loadf(x->sa + r * ng + g0), koff[r]);
            }
        } else {
            icol_group(t, b, 0, g0, x, nr, acc, off);
        }
    }
    for (int r = 0; r < nr; r++) y[r * n] = f32_to_bf16(ig_out(t, acc[r], off[r], koff[r]));
}

/* A tile of nr (a constant) activation rows from r by nc (a constant) columns of buf (the
 * columns' decoded groups, ng apart; mins: their K-quant offsets, ng apart): nr nc independent
 * chains, each output's sequence that of icol_few. */
#define TILE_ROWS 2
static inline __attribute__((always_inline)) void itile(const int t, const igroup *buf,
                                                        const float *mins, const iacts *x,
                                                        int64_t r, const int nr, const int nc,
                                                        uint16_t *y, int64_t n) {
    const int64_t k = x->k, ng = k / 32;
    v8f acc[TILE_ROWS][3] = {}, koff[TILE_ROWS][3] = {};
    float off[TILE_ROWS][3] = {};
    for (int64_t g = 0; g < ng; g++) {
        for (int i = 0; i < nr; i++)
            for (int m = 0; m < nc; m++)
                ig_row(t, &buf[m * ng + g], x->a + (r + i) * k + 32 * g, x->s[(r + i) * ng + g],
                       x->sa[(r + i) * ng + g], &acc[i][m], &off[i][m]);
        if (has_offset(t) && is_k(t) && g % 8 == 7)
            for (int i = 0; i < nr; i++)
                for (int m = 0; m < nc; m++)
                    koff[i][m] = fma8(loadf(mins + m * ng + g - 7),
                                      loadf(x->sa + (r + i) * ng + g - 7), koff[i][m]);
    }
    for (int i = 0; i < nr; i++)
        for (int m = 0; m < nc; m++)
            y[i * n + m] = f32_to_bf16(ig_out(t, acc[i][m], off[i][m], koff[i][m]));
}

/* Many rows: COL_BLOCK columns' groups decoded once into buf [COL_BLOCK][k / 32] (a K-quant's
 * offsets into mins, the same shape), then the activation rows against them in tiles of
 * TILE_ROWS rows by 3 columns. */
static inline __attribute__((always_inline)) void icols_many(
    const int t, const uint8_t *w, int64_t row_bytes, int nc, const iacts *x, int nr,
    uint16_t *y, int64_t n, igroup *buf, float *mins) {
    const int64_t ng = x->k / 32;
    for (int c = 0; c < nc; c++)
        for (int64_t g = 0; g < ng; g += GPB(t)) {
            const uint8_t *b = w + c * row_bytes + block_bytes(t) * (g / GPB(t));
            igroup *o = &buf[c * ng + g];
            if (is_k(t)) {
                igroup_at(t, b, 0, o), igroup_at(t, b, 1, o + 1), igroup_at(t, b, 2, o + 2);
                igroup_at(t, b, 3, o + 3), igroup_at(t, b, 4, o + 4), igroup_at(t, b, 5, o + 5);
                igroup_at(t, b, 6, o + 6), igroup_at(t, b, 7, o + 7);
                if (has_offset(t)) {
                    v8f m = k_offsets(b);
                    memcpy(mins + c * ng + g, &m, sizeof m);
                }
            } else {
                igroup_at(t, b, 0, o);
            }
        }
    for (int r = 0; r < nr; r += TILE_ROWS) {
        int c = 0;
        if (r + TILE_ROWS <= nr) {
            for (; c + 3 <= nc; c += 3)
                itile(t, buf + c * ng, mins + c * ng, x, r, TILE_ROWS, 3, y + r * n + c, n);
            for (; c < nc; c++)
                itile(t, buf + c * ng, mins + c * ng, x, r, TILE_ROWS, 1, y + r * n + c, n);
        } else {
            for (int i = r; i < nr; i++) {
                for (c = 0; c + 3 <= nc; c += 3)
                    itile(t, buf + c * ng, mins + c * ng, x, i, 1, 3, y + i * n + c, n);
                for (; c < nc; c++)
                    itile(t, buf + c * ng, mins + c * ng, x, i, 1, 1, y + i * n + c, n);
            }
        }
    }
}

static inline __attribute__((always_inline)) void irun(const int t, const uint8_t *w,
                                                       int64_t row_bytes, const iacts *x,
                                                       int64_t rows, int64_t n, uint16_t *y,
                                                       igroup *bufs) {
    if (rows <= FEW_ROWS) {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *row = w + j * row_bytes;
            /* the row PF_ROWS ahead into L2: the hardware's stream prefetcher is still
             * ramping up when a decode step's small matrix is done (most of the time in
             * this loop was the wait for each group's codes) */
            if (j + PF_ROWS < n)
                for (int64_t b = 0; b < row_bytes; b += 64)
                    __builtin_prefetch(row + PF_ROWS * row_bytes + b, 0, 2);
            switch (rows) {
            case 1: icol_few(t, row, x, 1, y + j, n); break;
            case 2: icol_few(t, row, x, 2, y + j, n); break;
            case 3: icol_few(t, row, x, 3, y + j, n); break;
            default: icol_few(t, row, x, 4, y + j, n); break;
            }
        }
        return;
    }
    const int64_t k = x->k, ng = k / 32;
    igroup *buf = bufs + (size_t)omp_get_thread_num() * (size_t)(COL_BLOCK * ng);
    float *mins = (float *)(bufs + (size_t)omp_get_max_threads() * (size_t)(COL_BLOCK * ng)) +
                  (size_t)omp_get_thread_num() * (size_t)(COL_BLOCK * ng);
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        int nr = rows - r0 < ROW_BLOCK ? (int)(rows - r0) : ROW_BLOCK;
        iacts xb = {x->a + r0 * k, x->s + r0 * ng, x->sa + r0 * ng, k};
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < n; j += COL_BLOCK) {
            int nc = n - j < COL_BLOCK ? (int)(n - j) : COL_BLOCK;
            icols_many(t, w + j * row_bytes, row_bytes, nc, &xb, nr, y + r0 * n + j, n, buf,
                       mins);
        }
    }
}

static inline int int_type(int t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 ||
           t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
}

static int qmm_int(int t, const uint8_t *w, int64_t row_bytes, const uint16_t *x, int64_t rows,
                   int64_t n, int64_t k, uint16_t *y) {
    size_t nt = (size_t)omp_get_max_threads(), ng = (size_t)(k / 32);
    /* one block: the scales s, sa [rows, ng] each, then the int16 activations a [rows, k]
     * (64-byte aligned); the many-rows path's column buffers only where it runs, so a decode
     * step's product allocates once */
    size_t sbytes = (sizeof(float) * 2 * (size_t)rows * ng + 63) / 64 * 64;
    float *s = aligned_alloc(64, sbytes + (sizeof(int16_t) * (size_t)(rows * k) + 63) / 64 * 64);
    igroup *bufs = NULL;
    if (s && rows > FEW_ROWS)
        bufs = aligned_alloc(64, ((sizeof(igroup) + sizeof(float)) * nt * COL_BLOCK * ng + 63)
                                     / 64 * 64); /* the groups, then the K-quants' mins */
    if (!s || (rows > FEW_ROWS && !bufs)) {
        free(s);
        free(bufs);
        return 2;
    }
    int16_t *a = (int16_t *)((char *)s + sbytes);
    iacts xs = {a, s, s + rows * ng, k};
#pragma omp parallel
    {
        quant_acts(x, rows, k, a, s, s + rows * ng); /* its omp for ends in a barrier */
        switch (t) {
        case T_Q4_0: irun(T_Q4_0, w, row_bytes, &xs, rows, n, y, bufs); break;
        case T_Q4_1: irun(T_Q4_1, w, row_bytes, &xs, rows, n, y, bufs); break;
        case T_Q5_0: irun(T_Q5_0, w, row_bytes, &xs, rows, n, y, bufs); break;
        case T_Q5_1: irun(T_Q5_1, w, row_bytes, &xs, rows, n, y, bufs); break;
        case T_Q8_0: irun(T_Q8_0, w, row_bytes, &xs, rows, n, y, bufs); break;
        case T_Q4_K: irun(T_Q4_K, w, row_bytes, &xs, rows, n, y, bufs); break;
        case T_Q5_K: irun(T_Q5_K, w, row_bytes, &xs, rows, n, y, bufs); break;
        default: irun(T_Q6_K, w, row_bytes, &xs, rows, n, y, bufs); break;
        }
    }
    free(s);
    free(bufs);
    return 0;
}

/* Every column of one type, the type a constant so each gets its own compiled loop. */
static inline __attribute__((always_inline)) void run(const int t, const uint8_t *w,
                                                      int64_t row_bytes, const float *xf,
                                                      int64_t rows, int64_t n, int64_t k,
                                                      uint16_t *y, float *wbufs) {
    if (rows <= FEW_ROWS) {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *row = w + j * row_bytes;
            switch (rows) {
            case 1: col_few(t, row, xf, 1, k, y + j, n); break;
            case 2: col_few(t, row, xf, 2, k, y + j, n); break;
            case 3: col_few(t, row, xf, 3, k, y + j, n); break;
            default: col_few(t, row, xf, 4, k, y + j, n); break;
            }
        }
        return;
    }
    float *wbuf = wbufs + (size_t)omp_get_thread_num() * (size_t)(COL_BLOCK * k);
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        int nr = rows - r0 < ROW_BLOCK ? (int)(rows - r0) : ROW_BLOCK;
        /* the same columns for each thread every block: static schedule, no barrier needed */
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < n; j += COL_BLOCK) {
            int nc = n - j < COL_BLOCK ? (int)(n - j) : COL_BLOCK;
            cols_many(t, w + j * row_bytes, row_bytes, nc, xf + r0 * k, nr, k,
                      y + r0 * n + j, n, wbuf);
        }
    }
}

/* Weights per block and bytes per block of a type; 0 for a type this file does not run. */
int64_t qmm_block(int t, int64_t *bytes) {
    switch (t) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0:
    case T_Q4_K: case T_Q5_K: case T_Q6_K:
        *bytes = block_bytes(t);
        return 32 * GPB(t);
    case T_F16: *bytes = 64; return 32;
    case T_BF16: *bytes = 64; return 32;
    case T_F32: *bytes = 128; return 32;
    default: *bytes = 0; return 0;
    }
}

/* y [rows, n] bf16 = x [rows, k] bf16 (contiguous) times W [n, k]^T, W's rows row_bytes apart
 * in type t's blocks. Returns 0; 1 for a type or shape this cannot run, 2 out of memory. */
int qmm_bf16(int t, const uint8_t *w, int64_t row_bytes, const uint16_t *x, int64_t rows,
             int64_t n, int64_t k, uint16_t *y) {
    int64_t bytes, per = qmm_block(t, &bytes);
    if (!per || n < 0 || rows < 0 || k <= 0 || k % per || row_bytes < k / per * bytes) return 1;
    if (rows == 0 || n == 0) return 0; /* nothing to write (the paths assume a row and a column) */
    if (int_type(t)) return qmm_int(t, w, row_bytes, x, rows, n, k, y);
    /* the f32 rows, then one column buffer per thread (many rows) */
    size_t nt = (size_t)omp_get_max_threads();
    float *xf = malloc(sizeof(float) * ((size_t)(rows * k) + nt * (size_t)(COL_BLOCK * k) + 1));
    if (!xf) return 2;
    float *wbufs = xf + rows * k;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * k; i++) xf[i] = bf16_to_f32(x[i]);
        switch (t) {
        case T_Q4_0: run(T_Q4_0, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_Q4_1: run(T_Q4_1, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_Q5_0: run(T_Q5_0, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_Q5_1: run(T_Q5_1, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_Q8_0: run(T_Q8_0, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_Q4_K: run(T_Q4_K, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_Q5_K: run(T_Q5_K, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_Q6_K: run(T_Q6_K, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_F16: run(T_F16, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        case T_BF16: run(T_BF16, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        default: run(T_F32, w, row_bytes, xf, rows, n, k, y, wbufs); break;
        }
    }
    free(xf);
    return 0;
}

/* A Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K matrix as int8 codes and f32 maps, w = d c + m (i8act.c's
 * 8-bit tiles, packed by quant.py's pack_i8): c [n, k]; d [n, k / 16]
 * (one a half group of 16: equal halves except Q6_K's sub-blocks); m [n, k / 32] (zero for the
 * symmetric types, whose codes are centred: Q8_0's own, Q5_0's q - 16, Q6_K's q - 32). d and m
 * are computed as group() computes them, so d c + m is gguf-py's weight. Returns 1 for another
 * type or a bad shape. Plain C: it runs once, at load. */
int qmm_codes(int t, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, int8_t *c,
              float *d, float *m) {
    int64_t bytes, per = qmm_block(t, &bytes);
    if (!per || k <= 0 || k % per || row_bytes < k / per * bytes) return 1;
    if (t != T_Q5_0 && t != T_Q5_1 && t != T_Q8_0 && t != T_Q5_K && t != T_Q6_K) return 1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + i * row_bytes;
        for (int64_t g = 0; g < k / 32; g++) {
            small_t z = small_codes(t, row, g);
            int8_t *cg = c + i * k + 32 * g;
            float *dg = d + i * (k / 16) + 2 * g;
            uint8_t u[32];
            memcpy(u, &z.c0, 16);
            memcpy(u + 16, &z.c1, 16);
            for (int x = 0; x < 32; x++)
                cg[x] = t == T_Q8_0 ? (int8_t)u[x] : (int8_t)((int)u[x] - z.bias);
            dg[0] = z.d0;
            dg[1] = z.d1;
            m[i * (k / 32) + g] = z.m;
        }
    }
    return 0;
}

/* Row `row` of W decoded into o [k] f32: the values the matmul multiplies. */
static void decode_row(int t, const uint8_t *row, int64_t k, float *o) {
    for (int64_t g = 0; g < k / 32; g++) {
        v8f w[4];
        switch (t) { /* the type a constant in each call, as in run() */
        case T_Q4_0: group(T_Q4_0, row, g, w); break;
        case T_Q4_1: group(T_Q4_1, row, g, w); break;
        case T_Q5_0: group(T_Q5_0, row, g, w); break;
        case T_Q5_1: group(T_Q5_1, row, g, w); break;
        case T_Q8_0: group(T_Q8_0, row, g, w); break;
        case T_Q4_K: group(T_Q4_K, row, g, w); break;
        case T_Q5_K: group(T_Q5_K, row, g, w); break;
        case T_Q6_K: group(T_Q6_K, row, g, w); break;
        case T_F16: group(T_F16, row, g, w); break;
        case T_BF16: group(T_BF16, row, g, w); break;
        default: group(T_F32, row, g, w); break;
        }
        memcpy(o + 32 * g, w, sizeof w);
    }
}

/* 0 when rows ids (or, with ids NULL, the first m) of W can be read; 1 for a type or shape
 * this cannot run, 3 for an id outside W. */
static int rows_ok(int t, int64_t row_bytes, int64_t n, int64_t k, const int64_t *ids,
                   int64_t m) {
    int64_t bytes, per = qmm_block(t, &bytes);
    if (!per || k <= 0 || k % per || row_bytes < k / per * bytes || m < 0) return 1;
    if (!ids) return m > n ? 3 : 0;
    for (int64_t i = 0; i < m; i++)
        if (ids[i] < 0 || ids[i] >= n) return 3;
    return 0;
}

/* Rows `ids` of W as f32 [m, k] (embedding lookups): the same decoded values the matmul
 * multiplies. Returns 0, 1 for a type or shape this cannot run, 3 for an id outside W. */
int qmm_rows_f32(int t, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                 const int64_t *ids, int64_t m, float *out) {
    int rc = ids ? rows_ok(t, row_bytes, n, k, ids, m) : 1;
    if (rc) return rc;
#pragma omp parallel for schedule(static) if (m * k > 65536)
    for (int64_t i = 0; i < m; i++) decode_row(t, w + ids[i] * row_bytes, k, out + i * k);
    return 0;
}

float f32_head_dot(const float *a, const float *b, int64_t d); /* f32_head.c */

/* The output head's exact logits from the file's blocks (head.py): out[r][j] = W[id_j] . h[r]
 * for r < nh, j < m (id_j = ids[j], or j when ids is NULL), each row decoded into a buffer of
 * the thread's (L1) and multiplied by f32_head_dots' own dot product: the f32 matrix's logits
 * bit for bit, reading the file's bytes (a Q8_0 head: 1.06 bytes a weight, not 4). Returns as
 * qmm_rows_f32, 2 out of memory. */
int qmm_head_dots(int t, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                  const int64_t *ids, int64_t m, const float *h, int64_t nh, float *out) {
    int rc = rows_ok(t, row_bytes, n, k, ids, m);
    if (rc) return rc;
    int failed = 0;
#pragma omp parallel if (m >= 2048)
    {
        float *buf = malloc(sizeof(float) * (size_t)k);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < m; j++) {
            if (!buf) continue;
            decode_row(t, w + (ids ? ids[j] : j) * row_bytes, k, buf);
            for (int64_t r = 0; r < nh; r++) out[r * m + j] = f32_head_dot(buf, h + r * k, k);
        }
        free(buf);
    }
    return failed ? 2 : 0;
}
