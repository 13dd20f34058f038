/* Decode attention for one sequence over bf16 K/V held in the KV pool (radixserve/kv/pool.py).
 *
 * Why a kernel of our own: a decode step attends one query row per head over the whole
 * context. torch's SDPA CPU kernel parallelises over (batch x kv-head) only, so the default
 * model's 3 KV heads leave 2 threads with 2 and 1 tasks, and it spends ~170 us a layer on
 * ~1.2 MB of K/V at 1.6k context. Here the context is split across the threads instead
 * (flash-decoding): each thread scores its share of keys for every query head of a KV group
 * (one K/V row load serves the whole group), keeps its own max / sum / accumulator, and the
 * partial results are merged exactly at the end.
 *
 * Built by radixserve/model/kernels.py with the system C compiler; OpenMP calls resolve to the
 * libgomp torch has already loaded, so the kernel shares torch's thread pool.
 *
 * Layout: q [n_kv * g, d] bf16 (query heads of KV head h are rows h*g .. h*g+g-1);
 * k, v: KV head h starts at h * head_stride elements, cell c at row c (d elements);
 * cells: n cell indices, or NULL for the run c0 .. c0+n-1; out [n_kv * g, d] bf16;
 * work: decode_attn_work_floats(n, n_kv, g, d) floats of scratch.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define MAXG 16
#define MAXD 256
#define MAXH 64 /* query heads */

static int64_t share(int64_t n, int nt) { return (n + nt - 1) / nt; }

/* A thread's scratch row per query head: its share of scores, rounded up to even, plus room
 * for the zero partner of an odd last key. */
static int64_t score_stride(int64_t n, int nt) { return (share(n, nt) + 3) & ~(int64_t)1; }

int64_t decode_attn_work_floats(int64_t n, int n_kv, int g, int d) {
    int nt = omp_get_max_threads();
    /* per thread: (max, sum, acc[d]) per query head, scores, and bf16 pairs of the weights */
    return (int64_t)nt * n_kv * g * (2 + d) + (int64_t)nt * 2 * g * score_stride(n, nt);
}

/* One thread's share [j0, j1) of the keys for KV head h: writes (max, sum, acc[d]) per query. */
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

static inline __m512 dot64(__m512bh q0, __m512bh q1, const uint16_t *kr) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(kr));
    return _mm512_dpbf16_ps(acc, q1, (__m512bh)_mm512_loadu_si512(kr + 32));
}

/* attend_share for head_dim 64 with AVX512-BF16: bf16 pair dot products (exact products, f32
 * sums) for q.k; for p.V the weights p are rounded to bf16 (as SDPA's bf16 path does) and key
 * pairs are interleaved so one instruction adds two keys' contributions. */
static void attend_share_d64(const uint16_t *q, const uint16_t *kh, const uint16_t *vh,
                             const int64_t *cells, int64_t c0, int64_t j0, int64_t j1, int g,
                             float scale, float *s, int64_t s_stride, uint32_t *pp,
                             float *part) {
    __m512bh q0[MAXG], q1[MAXG];
    float m[MAXG];
    for (int a = 0; a < g; a++) {
        q0[a] = (__m512bh)_mm512_loadu_si512(q + a * 64);
        q1[a] = (__m512bh)_mm512_loadu_si512(q + a * 64 + 32);
        m[a] = -INFINITY;
    }
    int64_t n = j1 - j0, j = 0;
    __m512 vmax[MAXG];
    for (int a = 0; a < g; a++) vmax[a] = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) {
        __m512 p[MAXG][16];
        for (int jj = 0; jj < 16; jj++) {
            const uint16_t *kr = kh + (cells ? cells[j0 + j + jj] : c0 + j0 + j + jj) * 64;
            if (j + jj + PF < n) { /* a key row is 2 cache lines; fetch PF keys ahead */
                const uint16_t *kp = kh + (cells ? cells[j0 + j + jj + PF] : c0 + j0 + j + jj + PF) * 64;
                _mm_prefetch((const char *)kp, _MM_HINT_T0);
                _mm_prefetch((const char *)(kp + 32), _MM_HINT_T0);
            }
            for (int a = 0; a < g; a++) p[a][jj] = dot64(q0[a], q1[a], kr);
        }
        for (int a = 0; a < g; a++) {
            __m512 sc = _mm512_mul_ps(sum16(p[a]), _mm512_set1_ps(scale));
            _mm512_storeu_ps(s + a * s_stride + j, sc);
            vmax[a] = _mm512_max_ps(vmax[a], sc);
        }
    }
    for (int a = 0; a < g; a++) m[a] = _mm512_reduce_max_ps(vmax[a]);
    for (; j < n; j++) {
        const uint16_t *kr = kh + (cells ? cells[j0 + j] : c0 + j0 + j) * 64;
        for (int a = 0; a < g; a++) {
            float dot = _mm512_reduce_add_ps(dot64(q0[a], q1[a], kr)) * scale;
            s[a * s_stride + j] = dot;
            m[a] = dot > m[a] ? dot : m[a];
        }
    }
    /* p = e^(s - m) in f32 for the sums; bf16 pairs (p_j, p_j+1) packed for the V pass */
    for (int a = 0; a < g; a++) {
        float *sa = s + a * s_stride, sum = 0.f;
        for (int64_t i = 0; i < n; i++) {
            float e = exp_clamped(sa[i] - m[a]);
            sa[i] = e;
            sum += e;
        }
        if (n % 2) sa[n] = 0.f; /* a zero partner for the last key */
        for (int64_t i = 0; i < n; i += 2)
            pp[a * s_stride + i / 2] =
                (uint32_t)f32_to_bf16(sa[i]) | ((uint32_t)f32_to_bf16(sa[i + 1]) << 16);
        part[a * 66] = m[a];
        part[a * 66 + 1] = sum;
    }
    __m512 acc[MAXG][4];
    for (int a = 0; a < g; a++)
        for (int r = 0; r < 4; r++) acc[a][r] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (j = 0; j < n; j += 2) {
        const uint16_t *v0 = vh + (cells ? cells[j0 + j] : c0 + j0 + j) * 64;
        for (int64_t e = j + PF; e < j + PF + 2 && e < n; e++) {
            const uint16_t *vp = vh + (cells ? cells[j0 + e] : c0 + j0 + e) * 64;
            _mm_prefetch((const char *)vp, _MM_HINT_T0);
            _mm_prefetch((const char *)(vp + 32), _MM_HINT_T0);
        }
        __m512i a0 = _mm512_loadu_si512(v0), a1 = _mm512_loadu_si512(v0 + 32), b0 = zero, b1 = zero;
        if (j + 1 < n) {
            const uint16_t *v1 = vh + (cells ? cells[j0 + j + 1] : c0 + j0 + j + 1) * 64;
            b0 = _mm512_loadu_si512(v1);
            b1 = _mm512_loadu_si512(v1 + 32);
        }
        __m512bh x[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0),
                         (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                         (__m512bh)_mm512_unpacklo_epi16(a1, b1),
                         (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
        for (int a = 0; a < g; a++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[a * s_stride + j / 2]);
            for (int r = 0; r < 4; r++) acc[a][r] = _mm512_dpbf16_ps(acc[a][r], x[r], w);
        }
    }
    /* undo the interleave: acc[r] lane 4L + i is dim 32 (r / 2) + 8 L + 4 (r % 2) + i */
    for (int a = 0; a < g; a++) {
        float tmp[64], *o = part + a * 66 + 2;
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(tmp + 16 * r, acc[a][r]);
        for (int r = 0; r < 4; r++)
            for (int L = 0; L < 4; L++)
                for (int i = 0; i < 4; i++)
                    o[32 * (r / 2) + 8 * L + 4 * (r % 2) + i] = tmp[16 * r + 4 * L + i];
    }
}
#endif

static void attend_share(const uint16_t *q, const uint16_t *kh, const uint16_t *vh,
                         const int64_t *cells, int64_t c0, int64_t j0, int64_t j1, int g, int d,
                         float scale, float *s, int64_t s_stride, uint32_t *pairs, float *part) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (d == 64) {
        attend_share_d64(q, kh, vh, cells, c0, j0, j1, g, scale, s, s_stride, pairs, part);
        return;
    }
#else
    (void)pairs;
#endif
    attend_share_generic(q, kh, vh, cells, c0, j0, j1, g, d, scale, s, s_stride, part);
}

/* Returns 0, or -1 when g or d exceed the kernel's fixed bounds (the caller falls back). */
int decode_attn_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                     int64_t head_stride, const int64_t *cells, int64_t c0, int64_t n, int n_kv,
                     int g, int d, float scale, uint16_t *out, float *work) {
    if (g > MAXG || d > MAXD || n <= 0) return -1;
    int nt = omp_get_max_threads();
    int64_t per = share(n, nt), stride = score_stride(n, nt);
    int hg = n_kv * g;
    float *parts = work, *scores = work + (int64_t)nt * hg * (2 + d);
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num();
        int64_t j0 = t * per, j1 = j0 + per < n ? j0 + per : n;
        float *part = parts + (int64_t)t * hg * (2 + d);
        float *s = scores + (int64_t)t * 2 * g * stride;
        uint32_t *pairs = (uint32_t *)(s + g * stride); /* only ever accessed as uint32 */
        for (int h = 0; h < n_kv; h++) {
            if (j0 < j1)
                attend_share(q + h * g * d, k + h * head_stride, v + h * head_stride, cells, c0,
                             j0, j1, g, d, scale, s, stride, pairs, part + h * g * (2 + d));
            else
                for (int a = 0; a < g; a++) part[(h * g + a) * (2 + d) + 1] = 0.f;
        }
    }
    /* merge the threads' partial softmaxes: rescale each by e^(m_t - M) */
    for (int r = 0; r < hg; r++) {
        float M = -INFINITY, L = 0.f, o[MAXD];
        for (int t = 0; t < nt; t++) {
            const float *pa = parts + ((int64_t)t * hg + r) * (2 + d);
            if (pa[1] > 0.f && pa[0] > M) M = pa[0];
        }
        for (int x = 0; x < d; x++) o[x] = 0.f;
        for (int t = 0; t < nt; t++) {
            const float *pa = parts + ((int64_t)t * hg + r) * (2 + d);
            if (pa[1] <= 0.f) continue;
            float w = exp_clamped(pa[0] - M);
            L += pa[1] * w;
            for (int x = 0; x < d; x++) o[x] += pa[2 + x] * w;
        }
        for (int x = 0; x < d; x++) out[r * d + x] = f32_to_bf16(o[x] / L);
    }
    return 0;
}

/* One decode token from its fused projection row to its attention output: rotate q and k
 * (NeoX halves; cos = (c, c), sin = (-s, s) as Rope.cos_sin builds them; f32 math, one bf16
 * rounding like Rope.apply), store k and v in the pool at cell `dst`, then attend over the
 * sequence's cells (which include `dst`). qkv: [(n_kv * g + 2 * n_kv) * d] bf16. Saves the
 * ~10 torch ops a layer that rotate, slice and index_copy one row. */
static int decode_rope_attn_bf16(const uint16_t *qkv, const float *cos, const float *sin,
                          uint16_t *k, uint16_t *v, int64_t head_stride, int64_t dst,
                          const int64_t *cells, int64_t c0, int64_t n, int n_kv, int g, int d,
                          float scale, uint16_t *out, float *work) {
    if (g > MAXG || d > MAXD || d % 2) return -1;
    int nh = n_kv * g, half = d / 2;
    uint16_t q[MAXH * MAXD];
    if (nh > MAXH) return -1;
    for (int h = 0; h < nh + n_kv; h++) {
        const uint16_t *x = qkv + (int64_t)h * d;
        uint16_t *y = h < nh ? q + h * d : k + (h - nh) * head_stride + dst * d;
        for (int i = 0; i < d; i++) {
            float sw = bf16_to_f32(x[i < half ? i + half : i - half]);
            y[i] = f32_to_bf16(bf16_to_f32(x[i]) * cos[i] + sw * sin[i]);
        }
    }
    for (int h = 0; h < n_kv; h++)
        memcpy(v + h * head_stride + dst * d, qkv + (int64_t)(nh + n_kv + h) * d, d * 2);
    return decode_attn_bf16(q, k, v, head_stride, cells, c0, n, n_kv, g, d, scale, out, work);
}

/* decode_rope_attn_bf16 for the n_seq single-token sequences of a decode step, one call a layer:
 * row i of qkv / cos / sin / out is sequence i's; cells[i] (or NULL: the run c0[i] .. c0[i] +
 * n[i] - 1) are its cells and dst[i] its new one. Returns 0, or -1 as decode_rope_attn_bf16. */
int decode_step_attn_bf16(const uint16_t *qkv, const float *cos, const float *sin, uint16_t *k,
                          uint16_t *v, int64_t head_stride, const int64_t *dst,
                          const int64_t *const *cells, const int64_t *c0, const int64_t *n,
                          int n_seq, int n_kv, int g, int d, float scale, uint16_t *out,
                          float *work) {
    int64_t row = (int64_t)(n_kv * g + 2 * n_kv) * d, orow = (int64_t)n_kv * g * d;
    for (int i = 0; i < n_seq; i++) {
        int rc = decode_rope_attn_bf16(qkv + i * row, cos + (int64_t)i * d, sin + (int64_t)i * d,
                                       k, v, head_stride, dst[i], cells[i], c0[i], n[i], n_kv,
                                       g, d, scale, out + i * orow, work);
        if (rc) return rc;
    }
    return 0;
}
