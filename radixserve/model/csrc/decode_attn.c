/* Causal attention over bf16 K/V held in the KV pool (radixserve/memory/pool/pool.py), computed the same
 * way whatever shares the call, so that a token's output depends on its tokens alone.
 *
 * Why fixed blocks: a query's keys (its sequence's cells in position order, up to itself) are
 * cut into blocks of BLOCK positions, boundaries at absolute positions that are multiples of
 * BLOCK (a list's first entry has position pos0, 0 unless given). Each (query, KV head, block)
 * gives one partial softmax (max, sum, acc[d]) for the g query heads of that KV head (one K/V
 * row load serves the whole group), and the partials are merged in block order. With a sliding
 * window w > 0 a query at position p sees only positions p - w < k <= p: the keys before that
 * are skipped outright (not read, not in any block's max), and blocks with no visible key are
 * not computed, so the query's bits do not depend on how many older keys the list holds.
 * The blocks, and so every rounding, depend only on the query's position (and window): not on
 * the thread count (the old kernel split the context across the threads), not on how many
 * tokens share the chunk (a prefill chunk's queries and a decode step's query run this same
 * code), not on the batch. Which thread computes an item changes nothing, so the work is
 * spread over (query, KV head, block) when there are few queries (a decode step: the context is
 * what is long) and over (query, KV head) with the blocks in turn when there are many.
 *
 * A step (attn_step_win_bf16) also rotates every new token's q and k (NeoX halves) and stores
 * its k and v in the pool before any query reads them, one C call a layer, after RMS-norming
 * each q and k head where the model has q/k norms (qwen3, Gemma 3), with positions and a
 * sliding window for Gemma 3's sliding layers, so no layer needs a torch op for its glue.
 *
 * With AVX512-BF16 the dot products are bf16 pairs (exact products, f32 sums) for head_dim 64,
 * 128, 192 or 256 (attend_bf16: q.k 16 keys at a time per query head, p.V in 64-dimension
 * slices); the other AVX2 builds' (avx512, avxvnni, avx2) in 8-lane f32 vectors with FMA for
 * head sizes that are multiples of 8 (attend_avx2: 1.4x the plain C at 1B's 32 heads on 8);
 * the neon variant's in 4-lane f32 vectors (attend_neon); other head sizes, and the generic
 * build, take the plain-C path. Each path is the same for every query, so the guarantees above
 * hold in each.
 *
 * Built by radixserve/model/kernels.py with the system C compiler; OpenMP calls resolve to the
 * libgomp torch has already loaded, so the kernel shares torch's thread pool.
 *
 * Layout: q [T, n_kv * g, d] bf16 (query heads of KV head h are rows h*g .. h*g+g-1);
 * k, v: rows of cache types kt, vt (kv_rows.h: bf16, f16, f32, q8_0, q4_0), KV head h at byte
 * h * k_hs (v_hs), cell c its row c. Every path reads bf16: other types' values rounded to
 * bf16 (as the compute dtype holds them), converted in registers as read where the AVX512-BF16
 * path reads each row about once (a decode step), else the rows the lists name once a call
 * into a scratch of the call's own (the same values: the same bits either way);
 * a sequence's cells: len cell indices, or NULL for the run c0 .. c0+len-1, its n_new queries
 * being the last n_new of them (rows of q in sequence order), pos0 the position of its first
 * entry (positions contiguous; NULL: every list starts at 0); out [T, n_kv * g, d] bf16;
 * work: attn_work_floats(longest list, T, n_kv, g, d) floats of scratch.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kv_rows.h"

#define MAXG 16
#define MAXD 256
#define GPF 16 /* keys ahead whose rows the portable loop prefetches */

/* Keys [j0, j1) of the list for the g query heads of one KV head: (max, sum, acc[d]) per head. */
static void attend_share_generic(const uint16_t *q, const uint16_t *kh, const uint16_t *vh,
                         const int64_t *cells, int64_t c0, int64_t j0, int64_t j1, int g, int d,
                         float scale, float *s, int64_t s_stride, float *part) {
    float qf[MAXG][MAXD], acc[MAXG][MAXD], row[MAXD], m[MAXG];
    for (int a = 0; a < g; a++) {
        for (int x = 0; x < d; x++) qf[a][x] = bf16_to_f32(q[a * d + x]) * scale;
        m[a] = -INFINITY;
    }
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t *kr = kh + (cells ? cells[j] : c0 + j) * d;
        if (j + GPF < j1) { /* the key GPF ahead, and its value row for the second pass */
            int64_t e = cells ? cells[j + GPF] : c0 + j + GPF;
            for (int c = 0; c < 2 * d; c += 64) {
                __builtin_prefetch((const char *)(kh + e * d) + c, 0, 3);
                __builtin_prefetch((const char *)(vh + e * d) + c, 0, 2);
            }
        }
        for (int x = 0; x < d; x++) row[x] = bf16_to_f32(kr[x]);
        for (int a = 0; a < g; a++) {
            float dot = 0.f;
            for (int x = 0; x < d; x++) dot += qf[a][x] * row[x];
            s[a * s_stride + (j - j0)] = dot;
            m[a] = dot > m[a] ? dot : m[a];
        }
    }
    for (int a = 0; a < g; a++) {
        float *sa = s + a * s_stride, sum = 0.f;
        for (int64_t j = 0; j < j1 - j0; j++) {
            float e = exp_clamped(sa[j] - m[a]);
            sa[j] = e;
            sum += e;
        }
        float *pa = part + a * (2 + d);
        pa[0] = m[a];
        pa[1] = sum;
        for (int x = 0; x < d; x++) acc[a][x] = 0.f;
    }
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t *vr = vh + (cells ? cells[j] : c0 + j) * d;
        for (int x = 0; x < d; x++) row[x] = bf16_to_f32(vr[x]);
        for (int a = 0; a < g; a++) {
            float p = s[a * s_stride + (j - j0)];
            for (int x = 0; x < d; x++) acc[a][x] += p * row[x];
        }
    }
    for (int a = 0; a < g; a++) memcpy(part + a * (2 + d) + 2, acc[a], d * sizeof(float));
}

#if defined(RS_NEON)
/* 4 bf16 -> 4 f32: the bits shifted into the high halves */
static inline float32x4_t bf4(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* attend_share_generic in 4-lane vectors (the neon variant, d a multiple of 4): each q.k in
 * two 4-lane partial sums added across lanes at the end (another order than the plain C's,
 * within f32 rounding of it), the key row converted once for the group; p.V lane by lane,
 * p v + acc fused, as the plain C's compiles on aarch64. */
static void attend_neon(const uint16_t *q, const uint16_t *kh, const uint16_t *vh,
                        const int64_t *cells, int64_t c0, int64_t j0, int64_t j1, int g, int d,
                        float scale, float *s, int64_t s_stride, float *part) {
    float32x4_t qf[MAXG][MAXD / 4], acc[MAXG][MAXD / 4], row[MAXD / 4];
    float m[MAXG];
    const int n4 = d / 4;
    for (int a = 0; a < g; a++) {
        for (int i = 0; i < n4; i++) qf[a][i] = vmulq_n_f32(bf4(q + a * d + 4 * i), scale);
        m[a] = -INFINITY;
    }
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t *kr = kh + (cells ? cells[j] : c0 + j) * d;
        if (j + GPF < j1) {
            int64_t e = cells ? cells[j + GPF] : c0 + j + GPF;
            for (int c = 0; c < 2 * d; c += 64) {
                __builtin_prefetch((const char *)(kh + e * d) + c, 0, 3);
                __builtin_prefetch((const char *)(vh + e * d) + c, 0, 2);
            }
        }
        for (int i = 0; i < n4; i++) row[i] = bf4(kr + 4 * i);
        for (int a = 0; a < g; a++) {
            float32x4_t s0 = vdupq_n_f32(0.f), s1 = s0;
            int i = 0;
            for (; i + 1 < n4; i += 2) {
                s0 = vfmaq_f32(s0, qf[a][i], row[i]);
                s1 = vfmaq_f32(s1, qf[a][i + 1], row[i + 1]);
            }
            if (i < n4) s0 = vfmaq_f32(s0, qf[a][i], row[i]);
            float dot = vaddvq_f32(vaddq_f32(s0, s1));
            s[a * s_stride + (j - j0)] = dot;
            m[a] = dot > m[a] ? dot : m[a];
        }
    }
    /* the plain C's softmax, written again rather than shared: a helper both paths called
     * cost the plain C 15% of a prefill's attention on AVX2 (GCC vectorized it worse) */
    for (int a = 0; a < g; a++) {
        float *sa = s + a * s_stride, sum = 0.f;
        for (int64_t j = 0; j < j1 - j0; j++) {
            float e = exp_clamped(sa[j] - m[a]);
            sa[j] = e;
            sum += e;
        }
        float *pa = part + a * (2 + d);
        pa[0] = m[a];
        pa[1] = sum;
        for (int i = 0; i < n4; i++) acc[a][i] = vdupq_n_f32(0.f);
    }
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t *vr = vh + (cells ? cells[j] : c0 + j) * d;
        for (int i = 0; i < n4; i++) row[i] = bf4(vr + 4 * i);
        for (int a = 0; a < g; a++) {
            float32x4_t p = vdupq_n_f32(s[a * s_stride + (j - j0)]);
            for (int i = 0; i < n4; i++) acc[a][i] = vfmaq_f32(acc[a][i], p, row[i]);
        }
    }
    for (int a = 0; a < g; a++) memcpy(part + a * (2 + d) + 2, acc[a], d * sizeof(float));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BF16__))
#define RS_AVX2_ATTN 1
#include <immintrin.h>
#define AVX2_KEYS 256 /* keys a call at most: a block (BLOCK below) */

/* 8 bf16 -> 8 f32: the bits shifted into the high halves */
static inline __m256 bf8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Lane i = the sum of p[i]'s 8 lanes, for 8 vectors (pairwise adds, then the 128-bit halves) */
static inline __m256 sum8(const __m256 *p) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* exp_clamped on 8 lanes, step for step (the clamp passes a NaN through, as the scalar one) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_floor_ps(t);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* attend_share_generic in 8-lane vectors with FMA (the avx512, avxvnni and avx2 builds, d a
 * multiple of 8): q.k 8 keys at a time, their rows converted to f32 once for the g heads and
 * each head's 8 sums reduced together (sum8); p.V in 64-dimension slices of the output (8
 * accumulators in registers), the block's value rows of the slice converted once for the g
 * heads. Another summation order than the plain C's, within f32 rounding of it, and the same
 * for every query. */
static void attend_avx2(const uint16_t *q, const uint16_t *kh, const uint16_t *vh,
                        const int64_t *cells, int64_t c0, int64_t j0, int64_t j1, int g, int d,
                        float scale, float *s, int64_t s_stride, float *part) {
    const int n8 = d / 8;
    const int64_t n = j1 - j0;
    __m256 qf[MAXG][MAXD / 8];
    float kf[8][MAXD] __attribute__((aligned(32)));
    float vf[AVX2_KEYS][64] __attribute__((aligned(32))); /* a block's V slice (64 KiB) */
    float m[MAXG];
    for (int a = 0; a < g; a++) {
        for (int i = 0; i < n8; i++)
            qf[a][i] = _mm256_mul_ps(bf8(q + a * d + 8 * i), _mm256_set1_ps(scale));
        m[a] = -INFINITY;
    }
    int64_t j = 0;
    for (; j < n; j += 8) {
        const int nk = n - j < 8 ? (int)(n - j) : 8;
        for (int jj = 0; jj < 8; jj++) {
            if (jj < nk) {
                const uint16_t *kr = kh + (cells ? cells[j0 + j + jj] : c0 + j0 + j + jj) * d;
                for (int i = 0; i < n8; i++) _mm256_store_ps(kf[jj] + 8 * i, bf8(kr + 8 * i));
            } else {
                for (int i = 0; i < n8; i++) _mm256_store_ps(kf[jj] + 8 * i, _mm256_setzero_ps());
            }
            if (j + jj + GPF < n) {
                int64_t e = cells ? cells[j0 + j + jj + GPF] : c0 + j0 + j + jj + GPF;
                for (int c = 0; c < 2 * d; c += 64) {
                    __builtin_prefetch((const char *)(kh + e * d) + c, 0, 3);
                    __builtin_prefetch((const char *)(vh + e * d) + c, 0, 2);
                }
            }
        }
        for (int a = 0; a < g; a++) {
            __m256 p[8];
            for (int jj = 0; jj < 8; jj++) p[jj] = _mm256_setzero_ps();
            for (int i = 0; i < n8; i++)
                for (int jj = 0; jj < 8; jj++)
                    p[jj] = _mm256_fmadd_ps(qf[a][i], _mm256_load_ps(kf[jj] + 8 * i), p[jj]);
            float dots[8];
            _mm256_storeu_ps(dots, sum8(p));
            for (int jj = 0; jj < nk; jj++) {
                s[a * s_stride + j + jj] = dots[jj];
                m[a] = dots[jj] > m[a] ? dots[jj] : m[a];
            }
        }
    }
    for (int a = 0; a < g; a++) {
        float *sa = s + a * s_stride;
        __m256 vm = _mm256_set1_ps(m[a]), vs = _mm256_setzero_ps();
        for (j = 0; j + 8 <= n; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sa + j), vm));
            _mm256_storeu_ps(sa + j, e);
            vs = _mm256_add_ps(vs, e);
        }
        float lanes[8], sum = 0.f;
        _mm256_storeu_ps(lanes, vs);
        for (int i = 0; i < 8; i++) sum += lanes[i];
        for (; j < n; j++) {
            float e = exp_clamped(sa[j] - m[a]);
            sa[j] = e;
            sum += e;
        }
        part[a * (2 + d)] = m[a];
        part[a * (2 + d) + 1] = sum;
    }
    for (int c = 0; c < d; c += 64) { /* output dimensions c .. c + w - 1 */
        const int w8 = (d - c < 64 ? d - c : 64) / 8;
        for (j = 0; j < n; j++) {
            const uint16_t *vr = vh + (cells ? cells[j0 + j] : c0 + j0 + j) * d + c;
            for (int i = 0; i < w8; i++) _mm256_store_ps(vf[j] + 8 * i, bf8(vr + 8 * i));
        }
        for (int a = 0; a < g; a++) {
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            const float *sa = s + a * s_stride;
            for (j = 0; j < n; j++) {
                __m256 p = _mm256_set1_ps(sa[j]);
                for (int i = 0; i < w8; i++)
                    acc[i] = _mm256_fmadd_ps(p, _mm256_load_ps(vf[j] + 8 * i), acc[i]);
            }
            float *o = part + a * (2 + d) + 2 + c;
            for (int i = 0; i < w8; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#ifndef PF
#define PF 16 /* keys fetched ahead */
#endif

/* Lane i of the result = the sum of p[i]'s 16 lanes, for 16 vectors (a transpose-and-add tree:
 * ~3 ops a vector instead of ~8 for a separate horizontal sum each). */
static inline __m512 sum16(const __m512 *p) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                             _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* u[i] holds, in each 128-bit lane L, the lane-L partial sums of vectors 4i .. 4i+3 */
    __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp_clamped on 16 lanes: the same clamp, split and polynomial, each step one instruction. The
 * clamp's operands in this order pass a NaN through (vmaxps / vminps return the second operand
 * when either is NaN), as the scalar one does: corrupt scores show in the output. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-87.f), x));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)),
                                  23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* p = e^(s - m) of each query head's n scores (rows of s, s_stride floats apart), 16 at a time:
 * rounded to bf16 into pb (rows 2 s_stride apart; lanes past n zero, so an odd last key gets
 * a zero partner) for the V pass, summed in f32 (16 lanes, then one fixed reduction) into
 * (m, sum) of each head's part. Vectorised by hand: GCC's own version of the scalar loop
 * scattered the bf16 pairs (vpscatterqd, microcoded on AMD). */
static inline __attribute__((always_inline)) void exp_pairs(const float *s, int64_t s_stride,
                                                            uint16_t *pb, int64_t n,
                                                            const float *m, const int g,
                                                            float *part,
                                                            int64_t part_stride) {
    for (int a = 0; a < g; a++) {
        const float *sa = s + a * s_stride;
        uint16_t *pa = pb + 2 * a * s_stride;
        __m512 vm = _mm512_set1_ps(m[a]), vs = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
            __m512 e = _mm512_maskz_mov_ps(
                k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sa + i), vm)));
            vs = _mm512_add_ps(vs, e);
            _mm256_storeu_si256((__m256i *)(pa + i), (__m256i)_mm512_cvtneps_pbh(e));
        }
        part[a * part_stride] = m[a];
        part[a * part_stride + 1] = _mm512_reduce_add_ps(vs);
    }
}

/* 64 dims of two value rows v0, v1 (v1 NULL: a zero partner) interleaved as bf16 pairs for
 * vdpbf16ps against the packed probability pairs: x[r] lane 4L + i pairs dim
 * 32 (r / 2) + 8 L + 4 (r % 2) + i of both rows. */
static inline void v_pairs(const uint16_t *v0, const uint16_t *v1, __m512bh x[4]) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i a0 = _mm512_loadu_si512(v0), a1 = _mm512_loadu_si512(v0 + 32);
    __m512i b0 = v1 ? _mm512_loadu_si512(v1) : zero, b1 = v1 ? _mm512_loadu_si512(v1 + 32) : zero;
    x[0] = (__m512bh)_mm512_unpacklo_epi16(a0, b0);
    x[1] = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
    x[2] = (__m512bh)_mm512_unpacklo_epi16(a1, b1);
    x[3] = (__m512bh)_mm512_unpackhi_epi16(a1, b1);
}

/* Block b (32 values) of a stored row of `type` (f16, q8_0 or q4_0) -> 32 bf16 at dst, the
 * bits of kv_load_bf16: each value's f32 (an exact product, never subnormal) rounded to
 * nearest even by vcvtne2ps2bf16. */
static inline void block_bf16(int type, const uint8_t *row, int b, uint16_t *dst) {
    __m512 f0, f1;
    if (type == KV_F16) {
        const __m256i *p = (const __m256i *)(row + 64 * b);
        f0 = _mm512_cvtph_ps(_mm256_loadu_si256(p));
        f1 = _mm512_cvtph_ps(_mm256_loadu_si256(p + 1));
    } else {
        const uint8_t *p = row + (type == KV_Q8_0 ? 34 : 18) * b;
        uint16_t h;
        memcpy(&h, p, 2);
        __m512 sc = _mm512_set1_ps(_cvtsh_ss(h));
        __m512i i0, i1;
        if (type == KV_Q8_0) {
            i0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)));
            i1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)));
        } else { /* q4_0: value j in the low nibble of byte j, value j + 16 in its high one */
            __m128i x = _mm_loadu_si128((const __m128i *)(p + 2)), m4 = _mm_set1_epi8(15);
            __m512i e8 = _mm512_set1_epi32(8);
            i0 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(x, m4)), e8);
            i1 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(x, 4), m4)),
                                  e8);
        }
        f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), sc);
        f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), sc);
    }
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
}

/* Row `cell` of a K or V head as bf16: in place for bf16, else its blocks b0 .. b0 + nb - 1
 * converted into tmp (block_bf16); the pointer is at the row's value 32 b0. */
static inline const uint16_t *row_bf16(const uint8_t *h, int type, int64_t rb, int64_t cell,
                                       int b0, int nb, uint16_t *tmp) {
    const uint8_t *row = h + cell * rb;
    if (type == KV_BF16) return (const uint16_t *)row + 32 * b0;
    for (int b = 0; b < nb; b++) block_bf16(type, row, b0 + b, tmp + 32 * b);
    return tmp;
}

/* attend_share with AVX512-BF16 for head_dim d a multiple of 64 (64: SmolLM2 / llama; 256:
 * Gemma 3): bf16 pair dot products (exact products, f32 sums) for q.k, 16 keys of one query
 * head at a time (the 16 key rows stay in L1 across the g heads, the 16 sums in registers);
 * for p.V the weights p are rounded to bf16 (as SDPA's bf16 path does), key pairs interleaved
 * so one instruction adds two keys' contributions, in 64-dimension slices of the output (4 g
 * accumulators). g and d are constants in each compiled copy (attend_share's switch): with a
 * variable g the compiler kept every head's 16 sums at once and spilled them to the stack.
 * `kt`, `vt`: the rows' cache types (kb, vb bytes a row): bf16 rows are read in place, f16 /
 * q8_0 / q4_0 rows converted block by block to bf16 as they are read (a decode step reads
 * each row once; many queries read a pre-converted copy instead: run). */
static inline __attribute__((always_inline)) void attend_bf16(
    const uint16_t *q, const uint8_t *kh, const uint8_t *vh, int kt, int vt, int64_t kb,
    int64_t vb, const int64_t *cells, int64_t c0, int64_t j0, int64_t j1, const int g,
    const int d, float scale, float *s, int64_t s_stride, uint16_t *pb, float *part) {
    const int nc = d / 32; /* 32-value chunks of a row */
    const int64_t vslice = 2 * vb / nc; /* bytes of 64 values of a V row */
    uint16_t kbuf[16 * MAXD], vbuf[2][64];
    float m[MAXG];
    int64_t n = j1 - j0, j = 0;
    __m512 vmax[MAXG];
    for (int a = 0; a < g; a++) vmax[a] = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) {
        const uint16_t *kr[16];
        for (int jj = 0; jj < 16; jj++) {
            kr[jj] = row_bf16(kh, kt, kb, cells ? cells[j0 + j + jj] : c0 + j0 + j + jj, 0, nc,
                              kbuf + jj * d);
            /* a key row is d / 32 cache lines; fetch PF keys ahead, and the same keys' value
             * rows into L2 for the p.V pass (the block's V was a second cold stream: in a
             * decode step the K/V come from memory; ~5% a layer with caches flushed) */
            if (j + jj + PF < n) {
                int64_t e = j0 + j + jj + PF;
                int64_t ce = cells ? cells[e] : c0 + e;
                const char *kp = (const char *)(kh + ce * kb), *vp = (const char *)(vh + ce * vb);
                for (int64_t o = 0; o < kb; o += 64) _mm_prefetch(kp + o, _MM_HINT_T0);
                for (int64_t o = 0; o < vb; o += 64) _mm_prefetch(vp + o, _MM_HINT_T1);
            }
        }
        for (int a = 0; a < g; a++) {
            __m512 p[16];
            for (int jj = 0; jj < 16; jj++) p[jj] = _mm512_setzero_ps();
            for (int c = 0; c < nc; c++) {
                __m512bh qc = (__m512bh)_mm512_loadu_si512(q + a * d + 32 * c);
                for (int jj = 0; jj < 16; jj++)
                    p[jj] = _mm512_dpbf16_ps(p[jj], qc,
                                             (__m512bh)_mm512_loadu_si512(kr[jj] + 32 * c));
            }
            __m512 sc = _mm512_mul_ps(sum16(p), _mm512_set1_ps(scale));
            _mm512_storeu_ps(s + a * s_stride + j, sc);
            vmax[a] = _mm512_max_ps(vmax[a], sc);
        }
    }
    for (int a = 0; a < g; a++) m[a] = _mm512_reduce_max_ps(vmax[a]);
    for (; j < n; j++) {
        const uint16_t *kr = row_bf16(kh, kt, kb, cells ? cells[j0 + j] : c0 + j0 + j, 0, nc,
                                      kbuf);
        for (int a = 0; a < g; a++) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < nc; c++)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + a * d + 32 * c),
                                       (__m512bh)_mm512_loadu_si512(kr + 32 * c));
            float dot = _mm512_reduce_add_ps(acc) * scale;
            s[a * s_stride + j] = dot;
            m[a] = dot > m[a] ? dot : m[a];
        }
    }
    exp_pairs(s, s_stride, pb, n, m, g, part, 2 + d);
    const uint32_t *pp = (const uint32_t *)pb; /* pair j / 2 of head a: pp[a s_stride + j / 2] */
    for (int c = 0; c < d / 64; c++) { /* output dimensions 64 c .. 64 c + 63 */
        __m512 acc[MAXG][4];
        for (int a = 0; a < g; a++)
            for (int r = 0; r < 4; r++) acc[a][r] = _mm512_setzero_ps();
        for (j = 0; j < n; j += 2) {
            const uint16_t *v0 = row_bf16(vh, vt, vb, cells ? cells[j0 + j] : c0 + j0 + j,
                                          2 * c, 2, vbuf[0]);
            for (int64_t e = j + PF; e < j + PF + 2 && e < n; e++) {
                const char *vp = (const char *)vh + (cells ? cells[j0 + e] : c0 + j0 + e) * vb
                                 + vslice * c;
                for (int64_t o = 0; o < vslice; o += 64) _mm_prefetch(vp + o, _MM_HINT_T0);
            }
            __m512bh x[4];
            v_pairs(v0, j + 1 < n ? row_bf16(vh, vt, vb, cells ? cells[j0 + j + 1]
                                             : c0 + j0 + j + 1, 2 * c, 2, vbuf[1]) : NULL, x);
            for (int a = 0; a < g; a++) {
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[a * s_stride + j / 2]);
                for (int r = 0; r < 4; r++) acc[a][r] = _mm512_dpbf16_ps(acc[a][r], x[r], w);
            }
        }
        /* undo the interleave: acc[r] lane 4L + i is dim 32 (r / 2) + 8 L + 4 (r % 2) + i */
        for (int a = 0; a < g; a++) {
            float tmp[64], *o = part + a * (2 + d) + 2 + 64 * c;
            for (int r = 0; r < 4; r++) _mm512_storeu_ps(tmp + 16 * r, acc[a][r]);
            for (int r = 0; r < 4; r++)
                for (int L = 0; L < 4; L++)
                    for (int i = 0; i < 4; i++)
                        o[32 * (r / 2) + 8 * L + 4 * (r % 2) + i] = tmp[16 * r + 4 * L + i];
        }
    }
}
#endif

/* bf16 K and V get a copy of their own with the types constant, so that their hot loop has no
 * per-key type test and no conversion buffers (the code the bf16 path had before the types) */
#define BF_CASE(G, D)                                                                          \
    case (G) * 1024 + (D):                                                                      \
        if (kt == KV_BF16 && vt == KV_BF16)                                                     \
            attend_bf16(q, kh, vh, KV_BF16, KV_BF16, 2 * (D), 2 * (D), cells, c0, j0, j1, G, D, \
                        scale, s, s_stride, pairs, part);                                       \
        else                                                                                    \
            attend_bf16(q, kh, vh, kt, vt, kb, vb, cells, c0, j0, j1, G, D, scale, s, s_stride, \
                        pairs, part);                                                           \
        return;

/* Whether attend_share reads f16 / q8_0 / q4_0 rows itself (attend_bf16), for head size d;
 * elsewhere run converts them first. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define READS_TYPED(d) ((d) % 64 == 0 && (d) <= MAXD)
#else
#define READS_TYPED(d) 0
#endif

/* kh, vh: a KV head's rows of types kt, vt (kb, vb bytes a row): bf16 unless READS_TYPED */
static void attend_share(const uint16_t *q, const uint8_t *kh, const uint8_t *vh, int kt, int vt,
                         int64_t kb, int64_t vb, const int64_t *cells, int64_t c0, int64_t j0,
                         int64_t j1, int g, int d, float scale, float *s, int64_t s_stride,
                         uint16_t *pairs, float *part) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    switch (g * 1024 + d) { /* the group sizes and head sizes of the models we run */
        BF_CASE(1, 64) BF_CASE(2, 64) BF_CASE(3, 64) BF_CASE(4, 64) BF_CASE(5, 64)
        BF_CASE(6, 64) BF_CASE(7, 64) BF_CASE(8, 64)
        BF_CASE(1, 128) BF_CASE(2, 128) BF_CASE(4, 128) BF_CASE(8, 128)
        BF_CASE(1, 256) BF_CASE(2, 256) BF_CASE(4, 256) BF_CASE(8, 256)
    default:
        break;
    }
    if (d % 64 == 0 && d <= MAXD) {
        attend_bf16(q, kh, vh, kt, vt, kb, vb, cells, c0, j0, j1, g, d, scale, s, s_stride,
                    pairs, part);
        return;
    }
#else
    (void)pairs, (void)kt, (void)vt, (void)kb, (void)vb;
#endif
    const uint16_t *k16 = (const uint16_t *)kh, *v16 = (const uint16_t *)vh;
#if defined(RS_AVX2_ATTN)
    if (d % 8 == 0 && d <= MAXD && j1 - j0 <= AVX2_KEYS) {
        attend_avx2(q, k16, v16, cells, c0, j0, j1, g, d, scale, s, s_stride, part);
        return;
    }
#endif
#if defined(RS_NEON)
    if (d % 4 == 0 && d <= MAXD) {
        attend_neon(q, k16, v16, cells, c0, j0, j1, g, d, scale, s, s_stride, part);
        return;
    }
#endif
    attend_share_generic(q, k16, v16, cells, c0, j0, j1, g, d, scale, s, s_stride, part);
}


/* The numbers a query's output depends on come from exactly one compiled copy of each of these
 * functions: -fassociative-math lets every inlined or cloned copy reassociate its sums its own
 * way, and the same block could then round differently from two call sites. */
#if defined(__clang__)
#define ONE_COPY __attribute__((noinline))
#else
#define ONE_COPY __attribute__((noipa))
#endif

#define BLOCK 256 /* positions a block; boundaries at absolute positions, multiples of it */
#define SSTRIDE (BLOCK + 16) /* a score row: a block, the odd key's zero partner, 64-byte rows */
#define FLAT 4 /* below FLAT items (query, KV head) a thread, blocks are items of their own */

static int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }
static int64_t n_blocks(int64_t n) { return (n + BLOCK - 1) / BLOCK; }

/* One (query, KV head)'s partials: nb blocks of g rows (max, sum, acc[d]). Every region of the
 * scratch is a multiple of 16 floats from a 64-byte aligned start, so a vectorised loop over a
 * score row sees the same alignment (the same peel, the same sums) on every thread. */
static int64_t parts_floats(int64_t nb, int g, int d) { return round16(nb * g * (2 + d)); }
static int64_t thread_floats(int64_t nb, int g, int d) {
    return 2 * g * SSTRIDE + parts_floats(nb, g, d); /* scores, bf16 weight pairs, partials */
}
static int flat(int64_t n_tok, int n_kv, int nt) { return n_tok * n_kv < (int64_t)FLAT * nt; }

static int64_t need_floats(int64_t max_len, int64_t n_tok, int n_kv, int g, int d, int nt,
                           int with_q) {
    int64_t nb = n_blocks(max_len), q = with_q ? round16((n_tok * n_kv * g * d + 1) / 2) : 0;
    int64_t shared = flat(n_tok, n_kv, nt) ? n_tok * n_kv * parts_floats(nb, g, d) : 0;
    return 16 + q + nt * thread_floats(nb, g, d) + shared;
}

/* Scratch for a call whose longest cell list is max_len (counted from the start of the block
 * its first entry is in: len + pos0 % BLOCK), with n_tok queries in all. */
int64_t attn_work_floats(int64_t max_len, int64_t n_tok, int n_kv, int g, int d) {
    return need_floats(max_len, n_tok, n_kv, g, d, omp_get_max_threads(), 1);
}

/* Keys [j0, j1) of a list for the g query heads of one KV head -> part (g rows of max, sum,
 * acc[d]); s: 2 g SSTRIDE floats of scratch, 64-byte aligned. */
ONE_COPY static void attend_block(const uint16_t *q, const uint8_t *kh, const uint8_t *vh,
                                  int kt, int vt, int64_t kb, int64_t vb, const int64_t *cells,
                                  int64_t c0, int64_t j0, int64_t j1, int g, int d, float scale,
                                  float *s, float *part) {
    attend_share(q, kh, vh, kt, vt, kb, vb, cells, c0, j0, j1, g, d, scale, s, SSTRIDE,
                 (uint16_t *)(s + g * SSTRIDE), part); /* the bf16 weights of the V pass */
}

/* e^x for a sink's share, in a copy of its own: inlined, its last product could fuse into the
 * sum it is added to in one build and not in another (aarch64 contracts). */
ONE_COPY static float sink_share(float x) { return exp_clamped(x); }

/* A query's nb block partials -> its g output rows: each block rescaled by e^(m_b - M), summed
 * in block order. sk (NULL: none): the g heads' sinks (gpt-oss), a logit each that joins the
 * softmax's max and sum after the blocks but adds no value, so a head can attend to nothing. */
ONE_COPY static void merge_blocks(const float *parts, int64_t nb, int g, int d, const float *sk,
                                  uint16_t *out) {
    for (int a = 0; a < g; a++) {
        float M = -INFINITY, L = 0.f, o[MAXD];
        for (int64_t b = 0; b < nb; b++) {
            float m = parts[(b * g + a) * (2 + d)];
            M = m > M ? m : M;
        }
        if (sk) M = sk[a] > M ? sk[a] : M;
        for (int x = 0; x < d; x++) o[x] = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const float *pa = parts + (b * g + a) * (2 + d);
            float w = exp_clamped(pa[0] - M);
            L += pa[1] * w;
            for (int x = 0; x < d; x++) o[x] += pa[2 + x] * w;
        }
        if (sk) L += sink_share(sk[a] - M);
        for (int x = 0; x < d; x++) out[a * d + x] = f32_to_bf16(o[x] / L);
    }
}

/* y = x rotated by its position's table row: cos = (c, c), sin = (-s, s) as Rope.cos_sin
 * builds them, NeoX halves, f32 math and one bf16 rounding. The roundings are Rope.apply's
 * (torch's addcmul is one FMA onto the rounded x * cos), so a key stored here has the bits of
 * one rotated and stored by the torch path. */
ONE_COPY static void rope_row(const uint16_t *x, const float *cos, const float *sin, int d,
                              uint16_t *y) {
    int half = d / 2;
    for (int i = 0; i < d; i++) {
        float sw = bf16_to_f32(x[i < half ? i + half : i - half]);
        float xc = bf16_to_f32(x[i]) * cos[i];
        y[i] = f32_to_bf16(__builtin_fmaf(sw, sin[i], xc));
    }
}

/* y = bf16(x * rsqrt(mean(x^2) + eps) * w): a head's RMSNorm (qwen3's and Gemma 3's q/k
 * norms) in f32 with torch's roundings (rms_norm in forward.py: f32 math, one bf16 rounding),
 * its sum of squares in one fixed order. */
ONE_COPY static void norm_row(const uint16_t *x, const float *w, int d, float eps,
                              uint16_t *y) {
    float ss = 0.f;
    for (int i = 0; i < d; i++) {
        float v = bf16_to_f32(x[i]);
        ss += v * v;
    }
    float inv = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = 0; i < d; i++) y[i] = f32_to_bf16(bf16_to_f32(x[i]) * inv * w[i]);
}

/* Query row t -> its sequence, and *i its index among that sequence's new tokens. */
static int seq_of(const int64_t *n_new, int64_t t, int64_t *i) {
    int s = 0;
    while (t >= n_new[s]) t -= n_new[s++];
    *i = t;
    return s;
}

/* What query i of a sequence (len entries from position p0, its n_new queries the last) sees:
 * positions [first, p] (p its own, first > p - window when window > 0), in the blocks first /
 * BLOCK .. p / BLOCK; returns that block count. */
typedef struct { int64_t p0, first, p; } span_t;
static int64_t span_of(int64_t p0, int64_t len, int64_t n_new, int64_t i, int64_t window,
                       span_t *sp) {
    int64_t p = p0 + len - n_new + i, first = p0;
    if (window > 0 && p - window + 1 > first) first = p - window + 1;
    sp->p0 = p0;
    sp->first = first;
    sp->p = p;
    return p / BLOCK - first / BLOCK + 1;
}

/* Block b (0 the first) of a span -> its list entries [*j0, *j1), never empty. */
static void block_of(const span_t *sp, int64_t b, int64_t *j0, int64_t *j1) {
    int64_t lo = (sp->first / BLOCK + b) * BLOCK, hi = lo + BLOCK;
    *j0 = (lo > sp->first ? lo : sp->first) - sp->p0;
    *j1 = (hi < sp->p + 1 ? hi : sp->p + 1) - sp->p0;
}

/* The rows attention reads: rows of types kt, vt (kb, vb bytes), K/V heads ks / vs bytes apart,
 * each sequence's cells or run. */
typedef struct {
    const uint8_t *k, *v;
    int kt, vt;
    int64_t kb, vb, ks, vs;
    const int64_t *const *cells, *c0;
    int64_t total; /* > 0: converted rows, sequence s's at rows c0[s] .. c0[s] + len[s] - 1 */
} bf16_rows_t;

/* The calling thread's scratch for converted rows, grown (never shrunk) to `bytes`: one per
 * thread, as concurrent calls from two threads must not share it; the engine calls from one.
 * 64-byte aligned, as torch's tensors (the pool's rows) are: the plain C's vectorized loops
 * may peel to an alignment, and their sums must not depend on where a row lies. */
static void *thread_scratch(size_t bytes) {
    static _Thread_local void *buf;
    static _Thread_local size_t have;
    if (bytes > have) {
        free(buf);
        bytes = (bytes + 63) & ~(size_t)63;
        buf = aligned_alloc(64, bytes);
        have = buf ? bytes : 0;
    }
    return buf;
}

/* Point rd at a scratch for every list's rows in bf16 (filled inside run's parallel region,
 * after the step's store): per KV head, the sequences' rows one after another. -2: no memory. */
static int to_bf16_scratch(int n_seq, const int64_t *len, int n_kv, int d, bf16_rows_t *rd) {
    int64_t total = 0;
    for (int s = 0; s < n_seq; s++) total += len[s];
    size_t rows = (size_t)(2 * n_kv * total) * (size_t)d * sizeof(uint16_t);
    size_t seqs = (size_t)n_seq * (sizeof(int64_t) + sizeof(int64_t *));
    uint8_t *b = thread_scratch(rows + seqs);
    if (!b) return -2;
    int64_t *c0 = (int64_t *)(b + rows);
    const int64_t **cells = (const int64_t **)(c0 + n_seq);
    for (int s = 0, at = 0; s < n_seq; at += len[s], s++) {
        c0[s] = at;
        cells[s] = NULL;
    }
    rd->k = b;
    rd->v = b + rows / 2;
    rd->kt = rd->vt = KV_BF16;
    rd->kb = rd->vb = 2 * (int64_t)d;
    rd->ks = rd->vs = total * d * 2;
    rd->cells = cells;
    rd->c0 = c0;
    rd->total = total;
    return 0;
}

/* attn_causal_win_bf16, with, when qkv is given, the step's RoPE and K/V store first (q is then
 * the rotated rows, kept in the scratch), each q and k head RMS-normed by qn / kn first when
 * they are given. */
static int run(const uint16_t *qkv, const float *cos, const float *sin, const int64_t *dst,
               const float *qn, const float *kn, float eps,
               const uint16_t *q, uint8_t *k, uint8_t *v, int kt, int vt, int64_t k_hs,
               int64_t v_hs, int n_seq,
               const int64_t *const *cells, const int64_t *c0, const int64_t *len,
               const int64_t *n_new, const int64_t *pos0, int64_t window, int n_kv, int g,
               int d, float scale, const float *sinks, uint16_t *out, float *work,
               int64_t work_floats) {
    if (g < 1 || g > MAXG || d < 2 || d > MAXD || d % 2 || n_kv < 1 || n_seq < 1 || window < 0
        || kv_row_bytes(kt, d) == 0 || kv_row_bytes(vt, d) == 0)
        return -1;
    const int64_t kb = kv_row_bytes(kt, d), vb = kv_row_bytes(vt, d);
    int64_t n_tok = 0, max_len = 0; /* max_len: counted from its first block's start */
    for (int s = 0; s < n_seq; s++) {
        int64_t p0 = pos0 ? pos0[s] : 0;
        if (n_new[s] < 1 || n_new[s] > len[s] || p0 < 0 || p0 > INT64_MAX / 2) return -1;
        n_tok += n_new[s];
        max_len = len[s] + p0 % BLOCK > max_len ? len[s] + p0 % BLOCK : max_len;
    }
    int nt = omp_get_max_threads(), nh = n_kv * g, use_flat = flat(n_tok, n_kv, nt);
    if (need_floats(max_len, n_tok, n_kv, g, d, nt, qkv != NULL) > work_floats) return -2;
    float *w = (float *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    uint16_t *qr = (uint16_t *)w;
    if (qkv) {
        q = qr;
        w += round16((n_tok * nh * d + 1) / 2);
    }
    /* what attention reads: the pool's bf16 rows in place, or the rows of the lists converted
     * (one run of rows a sequence, its lists' order: cells NULL, c0 its first row) */
    bf16_rows_t rd = {k, v, kt, vt, kb, vb, k_hs, v_hs, cells, c0, 0};
    /* other types than bf16: read in place, converted as read, when each row is read about
     * once (a decode step) and this build's path can (f32 never: its subnormals would convert
     * otherwise than kv_load_bf16's); else converted once into the scratch (a prefill chunk,
     * whose rows every query reads). The same bf16 values either way: the same bits. */
    int typed = kt != KV_BF16 || vt != KV_BF16;
    int in_place = READS_TYPED(d) && n_tok <= 2 * (int64_t)n_seq && kt != KV_F32 && vt != KV_F32;
    if (typed && !in_place && to_bf16_scratch(n_seq, len, n_kv, d, &rd) != 0) return -2;
    int64_t nb = n_blocks(max_len), pf = parts_floats(nb, g, d), tf = thread_floats(nb, g, d);
    int64_t n_items = n_tok * n_kv, gd = (int64_t)g * (2 + d);
    float *shared = w + nt * tf;
#pragma omp parallel num_threads(nt)
    {
        float *s = w + omp_get_thread_num() * tf, *mine = s + 2 * g * SSTRIDE;
        if (qkv) {
            int64_t row = (int64_t)(nh + 2 * n_kv) * d;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < n_tok; t++) {
                const uint16_t *x = qkv + t * row;
                const float *ct = cos + t * d, *st = sin + t * d;
                uint16_t nrm[MAXD];
                for (int h = 0; h < nh; h++) {
                    const uint16_t *src = x + h * d;
                    if (qn) {
                        norm_row(src, qn, d, eps, nrm);
                        src = nrm;
                    }
                    rope_row(src, ct, st, d, qr + (t * nh + h) * d);
                }
                for (int h = 0; h < n_kv; h++) {
                    const uint16_t *src = x + (nh + h) * d;
                    uint16_t rot[MAXD];
                    if (kn) {
                        norm_row(src, kn, d, eps, nrm);
                        src = nrm;
                    }
                    rope_row(src, ct, st, d, rot); /* bf16, then stored in the cache type */
                    kv_store_row(kt, rot, d, k + h * k_hs + dst[t] * kb);
                    kv_store_row(vt, x + (nh + n_kv + h) * d, d, v + h * v_hs + dst[t] * vb);
                }
            } /* its barrier: every new key is stored before a query reads it */
        }
        if (rd.total) { /* the rows of every list, in bf16 (the new ones stored just above) */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n_kv * rd.total; r++) {
                int64_t h = r / rd.total, j = r % rd.total;
                int sq = 0;
                while (j >= rd.c0[sq] + len[sq]) sq++;
                int64_t e = j - rd.c0[sq], cell = cells[sq] ? cells[sq][e] : c0[sq] + e;
                kv_load_bf16(kt, k + h * k_hs + cell * kb, d, (uint16_t *)rd.k + r * d);
                kv_load_bf16(vt, v + h * v_hs + cell * vb, d, (uint16_t *)rd.v + r * d);
            }
        }
        /* item p: KV head p / n_tok of query row p % n_tok */
        if (use_flat) {
#pragma omp for schedule(dynamic) collapse(2)
            for (int64_t p = 0; p < n_items; p++)
                for (int64_t b = 0; b < nb; b++) {
                    int64_t t = p % n_tok, h = p / n_tok, i, j0, j1;
                    int sq = seq_of(n_new, t, &i);
                    span_t sp;
                    if (b >= span_of(pos0 ? pos0[sq] : 0, len[sq], n_new[sq], i, window, &sp))
                        continue;
                    block_of(&sp, b, &j0, &j1);
                    attend_block(q + (t * nh + h * g) * d, rd.k + h * rd.ks, rd.v + h * rd.vs,
                                 rd.kt, rd.vt, rd.kb, rd.vb, rd.cells[sq], rd.c0[sq], j0, j1, g,
                                 d, scale,
                                 s, shared + p * pf + b * gd);
                }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < n_items; p++) {
                int64_t t = p % n_tok, h = p / n_tok, i;
                int sq = seq_of(n_new, t, &i);
                span_t sp;
                int64_t nbq = span_of(pos0 ? pos0[sq] : 0, len[sq], n_new[sq], i, window, &sp);
                merge_blocks(shared + p * pf, nbq, g, d, sinks ? sinks + h * g : NULL,
                             out + (t * nh + h * g) * d);
            }
        } else {
            /* consecutive items are neighbouring queries of one KV head: K/V stay in cache */
#pragma omp for schedule(dynamic)
            for (int64_t p = 0; p < n_items; p++) {
                int64_t t = p % n_tok, h = p / n_tok, i, j0, j1;
                int sq = seq_of(n_new, t, &i);
                span_t sp;
                int64_t nbq = span_of(pos0 ? pos0[sq] : 0, len[sq], n_new[sq], i, window, &sp);
                for (int64_t b = 0; b < nbq; b++) {
                    block_of(&sp, b, &j0, &j1);
                    attend_block(q + (t * nh + h * g) * d, rd.k + h * rd.ks, rd.v + h * rd.vs,
                                 rd.kt, rd.vt, rd.kb, rd.vb, rd.cells[sq], rd.c0[sq], j0, j1, g,
                                 d, scale,
                                 s, mine + b * gd);
                }
                merge_blocks(mine, nbq, g, d, sinks ? sinks + h * g : NULL,
                             out + (t * nh + h * g) * d);
            }
        }
    }
    return 0;
}

/* Attention of already rotated queries whose K/V are in the pool, with positions and a sliding
 * window: pos0[s] the position of sequence s's first entry (NULL: 0), window > 0 the window (a
 * query at p sees p - window < k <= p), 0 plain causal. Returns 0, -1 when g, d or a
 * sequence's counts are outside the kernel's bounds or a window or position is negative, -2
 * when work is too small. sinks: f32 [n_kv g], a logit a query head in the softmax (NULL: none).
 */
int attn_causal_win_bf16(const uint16_t *q, const uint8_t *k, const uint8_t *v, int kt, int vt,
                         int64_t k_hs, int64_t v_hs, int n_seq, const int64_t *const *cells,
                         const int64_t *c0, const int64_t *len, const int64_t *n_new,
                         const int64_t *pos0, int64_t window, int n_kv, int g, int d,
                         float scale, const float *sinks, uint16_t *out, float *work,
                         int64_t work_floats) {
    return run(NULL, NULL, NULL, NULL, NULL, NULL, 0.f, q, (uint8_t *)k, (uint8_t *)v, kt, vt,
               k_hs, v_hs, n_seq, cells, c0, len, n_new, pos0, window, n_kv, g, d, scale, sinks,
               out, work, work_floats);
}

/* A layer of a step (radixserve/model/step.py, every architecture), from the fused projection
 * rows to the attention outputs: qkv [T, (n_kv g + 2 n_kv) d] bf16, cos / sin [T, d]
 * (Rope.cos_sin rows), dst [T] each new token's cell (the last n_new cells of its sequence's
 * list). Each q head RMS-normed by qn [d] and each k head by kn [d] (f32 weights, NULL: none,
 * as llama's layers; the norms of attn_head_norm_bf16, bit for bit) before RoPE; q and k
 * rotated, k and v stored at dst, then the attention of attn_causal_win_bf16 with pos0 /
 * window (a sliding layer's window, its list starting at pos0[s]; NULL and 0: plain causal
 * from position 0) and sinks.
 * Saves the ~10 torch ops a layer that norm, rotate, slice and index_copy. */
int attn_step_win_bf16(const uint16_t *qkv, const float *cos, const float *sin, uint8_t *k,
                       uint8_t *v, int kt, int vt, int64_t k_hs, int64_t v_hs,
                       const int64_t *dst, int n_seq,
                       const int64_t *const *cells, const int64_t *c0, const int64_t *len,
                       const int64_t *n_new, const int64_t *pos0, int64_t window,
                       const float *qn, const float *kn, float eps, int n_kv, int g, int d,
                       float scale, const float *sinks, uint16_t *out, float *work,
                       int64_t work_floats) {
    return run(qkv, cos, sin, dst, qn, kn, eps, NULL, k, v, kt, vt, k_hs, v_hs, n_seq, cells,
               c0, len, n_new, pos0, window, n_kv, g, d, scale, sinks, out, work, work_floats);
}

/* y [rows, nh, d] = norm_row of the nh heads of d bf16 that start each row of x (row stride
 * xs elements): the q or k head norms of a step that runs torch's attention (forward.py's
 * general path), the same bits as attn_step_win_bf16's. Returns -1 for d outside
 * (0, MAXD]. */
int attn_head_norm_bf16(const uint16_t *x, int64_t xs, int64_t rows, int nh, int d,
                        const float *w, float eps, uint16_t *y) {
    if (d < 1 || d > MAXD || nh < 1) return -1;
#pragma omp parallel for if (rows >= 64) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < nh; h++)
            norm_row(x + r * xs + (int64_t)h * d, w, d, eps, y + (r * nh + h) * d);
    return 0;
}
