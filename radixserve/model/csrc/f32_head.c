/* Exact f32 logits of the output head (radixserve/model/head.py), one dot product each.
 *
 * Why our own: torch's f32 matmul picks its kernel and blocking by shape, so a logit came out
 * with other last bits when the head ran 1 row or 4, or re-scored 7 tokens or 100 (measured on
 * torch 2.13); a near tie could then go the other way. Here every logit is the same function of
 * (weight row, hidden state): one dot product in a fixed order, whatever the rows, the tokens
 * or the threads sharing the call. It also reads the 113 MB f32 head once for all rows of a
 * step (memory-bound: ~2x torch's one-row matvec here). Built by radixserve/model/kernels.py.
 */
#include <omp.h>
#include <stdint.h>

/* Rows of the head in parallel only when there are enough of them to pay for the pool. */
#define PAR_TOKENS 2048

#if defined(__AVX512F__)
#include <immintrin.h>

/* noinline: every caller runs this very code (the build allows reassociation, so inlined
 * copies might sum in other orders) */
__attribute__((noinline)) static float dot(const float *a, const float *b, int64_t d) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
    }
    for (; i < d; i += 16) {
        __mmask16 m = d - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - i)) - 1);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i),
                             s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
#else
__attribute__((noinline)) static float dot(const float *a, const float *b, int64_t d) {
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}
#endif

/* The dot product every exact logit is (qmm.c's qmm_head_dots calls it on the rows it decodes
 * from the file's blocks, so a head held in them gives these very bits). */
float f32_head_dot(const float *a, const float *b, int64_t d) { return dot(a, b, d); }

/* out[r][j] = w[id_j] . h[r] for r < n, j < m, with id_j = ids[j] (or j when ids is NULL):
 * w [v, d] f32, h [n, d] f32, out [n, m] f32. Returns 0, or -1 (nothing computed) for an id
 * outside [0, v). */
int f32_head_dots(const float *w, int64_t v, int64_t d, const int64_t *ids, int64_t m,
                  const float *h, int64_t n, float *out) {
    if (ids)
        for (int64_t j = 0; j < m; j++)
            if (ids[j] < 0 || ids[j] >= v) return -1;
#pragma omp parallel for if (m >= PAR_TOKENS) schedule(static)
    for (int64_t j = 0; j < m; j++) {
        const float *wr = w + (ids ? ids[j] : j) * d;
        for (int64_t r = 0; r < n; r++) out[r * m + j] = dot(wr, h + r * d, d);
    }
    return 0;
}
