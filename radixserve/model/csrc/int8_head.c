/* The output head's approximate pass (radixserve/model/head.py): AVX512-VNNI, AVX2, NEON's
 * sdot or plain C.
 *
 * Why: torch's _weight_int8pack_mm reads the default model's 28 MB int8 head copy in ~1.9 ms
 * (compute-bound on this CPU: it converts every weight to float); the integer dot product
 * instruction (vpdpbusd: 64 byte products a step) does the same in ~0.55 ms on 2 threads.
 * The hidden state is split into two int8 parts, h ~ s1 h1 + s2 h2 (s2 = s1 / 254), so the
 * input error is ~max|h| / 64516 per element, and the integer sums are exact; head.py's bound
 * accounts for both parts' rounding and the f32 combination.
 *
 * a: [nvec * 2, d] uint8 = h_part + 128 (vpdpbusd multiplies unsigned by signed bytes);
 * s: [nvec * 2] the parts' scales; rowsum[i] = sum_x q[i][x] removes the +128 offset.
 * y[v][i] = scale_i * (s[2v] * (a[2v] . q_i - 128 rowsum_i) + s[2v+1] * (...)).
 * One row at a time per thread: more rows in flight ran 2x slower (register spills), and 4
 * rows sharing each load of a ran 3x slower on Gemma 3's 262144 x 640 copy (measured); the
 * pass reads the copy at the speed of a plain read of its bytes (168 MB there: it is bound by
 * memory bandwidth, and software prefetching did not help).
 *
 * On aarch64 (the neon variant) sdot takes the parts centred to signed bytes (a - 128).
 * Without VNNI the same integer sums come from vpmaddwd on bytes widened to 16 bits (AVX2: the
 * parts widened once a call, a row's 16 bytes once per 16 weights) or from plain C loops; the
 * sums are exact in every build, and the f32 formula after them is one explicit fused
 * multiply-add (common.h's fma1), so y has the same bits in every build with FMA (x86's AVX2
 * and AVX-512 ones, every aarch64 one). torch's int8 kernel, which CPUs without VNNI ran
 * before, converts every weight to float: Gemma 3's 168 MB copy was a third of an AVX2 decode
 * step.
 *
 * int8_head_bound also applies head.py's bound in the pass (upper / lower bounds of each exact
 * logit and the largest lower bound), so no vocabulary-sized torch pass follows it, and
 * head_candidates picks the tokens whose upper bound reaches a floor in one more pass.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

/* What int8_head_bound adds to each logit (head.py's certified bound): for token i of vector
 * v, B = margin (err_i cw_v + amax_i ca_v + rel |y|); up = y + B and lo = y - B are written
 * instead of y (lo only when given), and lomax[v] = max_i lo. */
typedef struct {
    const float *err, *amax, *cw, *ca;
    float rel, margin;
    float *up, *lo, *lomax;
} bound_t;

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define MAXV 4

/* The sums of 8 vectors' lanes (a transpose-and-add tree: 23 instructions where 8 separate
 * horizontal sums take ~70, which made the pass compute-bound at 2-4 vectors). Integer sums:
 * the same as _mm512_reduce_add_epi32 of each, exactly. */
static inline void sum8(const __m512i *p, int32_t *out) {
    __m512i t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]),
                                _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    /* u[i]'s 128-bit lane L: lane L's partial sums of vectors 4i .. 4i + 3 */
    __m512i w = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    w = _mm512_add_epi32(w, _mm512_shuffle_i32x4(w, w, _MM_SHUFFLE(2, 3, 0, 1)));
    int32_t z[16];
    _mm512_storeu_si512(z, w);
    for (int i = 0; i < 4; i++) out[i] = z[i], out[4 + i] = z[8 + i];
}

/* The integer dot products tot[t] = a_t . q_r of one row against nt parts (nt a constant):
 * vpdpbusd on the +128 bytes as they are. */
typedef uint8_t apart_t;
static inline __attribute__((always_inline)) void row_dots(const int8_t *qr, const apart_t *a,
                                                           int64_t d, const int nt,
                                                           int32_t *tot) {
    __m512i acc[2 * MAXV];
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_si512();
    for (int64_t x = 0; x < d; x += 64) {
        __m512i w = _mm512_loadu_si512(qr + x);
        for (int t = 0; t < nt; t++)
            acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_loadu_si512(a + t * d + x), w);
    }
    if (nt == 2) {
        tot[0] = _mm512_reduce_add_epi32(acc[0]);
        tot[1] = _mm512_reduce_add_epi32(acc[1]);
    } else {
        for (int t = nt; t < 2 * MAXV; t++) acc[t] = _mm512_setzero_si512();
        sum8(acc, tot);
    }
}
#elif defined(__AVX2__)
#include <immintrin.h>

#define MAXV 4
#define WIDE_PARTS 1
/* The parts widened to 16 bits once a call (run); vpmaddwd multiplies 16 x 16 bit pairs and
 * adds each pair exactly (at most 2 x 255 x 128 per 32-bit lane). */
typedef int16_t apart_t;
static inline __attribute__((always_inline)) void row_dots(const int8_t *qr, const apart_t *a,
                                                           int64_t d, const int nt,
                                                           int32_t *tot) {
    __m256i acc[2 * MAXV];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_si256();
    for (int64_t x = 0; x < d; x += 16) {
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qr + x)));
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_add_epi32(
                acc[t], _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a + t * d + x)),
                                          w));
    }
    for (int t = 0; t < nt; t++) {
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[t]),
                                  _mm256_extracti128_si256(acc[t], 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
        tot[t] = _mm_cvtsi128_si32(h);
    }
}
#elif defined(RS_NEON)
#define MAXV 4
#define CENTRED_PARTS 1
/* sdot multiplies signed by signed bytes: the parts are centred once a call (run: a - 128, the
 * byte a ^ 0x80), so the sums are those of the other builds less 128 rowsum, exactly, and
 * one_row subtracts nothing. 16 byte products a step into each of 4 lanes. */
typedef int8_t apart_t;
static inline __attribute__((always_inline)) void row_dots(const int8_t *qr, const apart_t *a,
                                                           int64_t d, const int nt,
                                                           int32_t *tot) {
    int32x4_t acc[2 * MAXV];
    for (int t = 0; t < nt; t++) acc[t] = vdupq_n_s32(0);
    for (int64_t x = 0; x < d; x += 16) {
        int8x16_t w = vld1q_s8(qr + x);
        for (int t = 0; t < nt; t++) acc[t] = vdotq_s32(acc[t], vld1q_s8(a + t * d + x), w);
    }
    for (int t = 0; t < nt; t++) tot[t] = vaddvq_s32(acc[t]);
}
#else
#define MAXV 4
/* Plain C (any CPU): the compiler vectorizes the byte products as it can. */
typedef uint8_t apart_t;
static inline __attribute__((always_inline)) void row_dots(const int8_t *qr, const apart_t *a,
                                                           int64_t d, const int nt,
                                                           int32_t *tot) {
    for (int t = 0; t < nt; t++) {
        int32_t acc = 0;
        for (int64_t x = 0; x < d; x++) acc += (int32_t)a[t * d + x] * (int32_t)qr[x];
        tot[t] = acc;
    }
}
#endif

int int8_head_available(void) { return 1; }

#define PF_ROWS 32 /* rows ahead whose codes each row prefetches */

/* One row i of the copy against nv vectors: y (b NULL) or its bounds (b given), the largest
 * lower bound kept in mx. Inlined into each rows_<nv> below with nv a constant, inside its
 * parallel loop: the accumulators stay in registers (an OpenMP region outlined with nv a
 * variable kept them in memory). */
static inline __attribute__((always_inline)) void one_row(
    const int8_t *q, const int32_t *rowsum, const float *scale, const apart_t *a,
    const float *s, int64_t rows, int64_t d, const int nv, float *y, const bound_t *b,
    int64_t i, float *mx) {
    if (i + PF_ROWS < rows)
        for (int64_t x = 0; x < d; x += 64) __builtin_prefetch(q + (i + PF_ROWS) * d + x, 0, 2);
#ifdef CENTRED_PARTS
    const int32_t off = 0;
    (void)rowsum;
#else
    int32_t off = 128 * rowsum[i];
#endif
    int32_t tot[2 * MAXV];
    row_dots(q + i * d, a, d, 2 * nv, tot);
    for (int v = 0; v < nv; v++) {
        float d1 = (float)(tot[2 * v] - off);
        float d2 = (float)(tot[2 * v + 1] - off);
        /* s1 d1 + (s2 d2) as one fma1: GCC (reassociation allowed here) had contracted the
         * sum one way in one build and the other way in another */
        float yv = fma1(s[2 * v], d1, s[2 * v + 1] * d2) * scale[i];
        if (!b) {
            y[v * rows + i] = yv;
            continue;
        }
        float B = b->margin * (b->err[i] * b->cw[v] + b->amax[i] * b->ca[v]
                               + b->rel * fabsf(yv));
        float low = yv - B;
        b->up[v * rows + i] = yv + B;
        if (b->lo) b->lo[v * rows + i] = low;
        mx[v] = low > mx[v] ? low : mx[v];
    }
}

/* Rows a thread takes at a time: whole chunks of the copy (1.3 MB at Gemma 3's 640) handed
 * out as threads get free, so a thread the OS has paused (a busy machine) does not hold the
 * others at the barrier with half the copy left; rows are independent, so the bits are the
 * same whichever thread computes them. */
#define CHUNK 2048

#define ROWS(NV)                                                                              \
    static void rows_##NV(const int8_t *q, const int32_t *rowsum, const float *scale,        \
                          const apart_t *a, const float *s, int64_t rows, int64_t d, float *y, \
                          const bound_t *bp) {                                                \
        const bound_t bnd = bp ? *bp : (bound_t){0}, *b = bp ? &bnd : NULL;                   \
        _Pragma("omp parallel") {                                                            \
            float mx[NV];                                                                     \
            for (int v = 0; v < NV; v++) mx[v] = -INFINITY;                                   \
            _Pragma("omp for schedule(dynamic, CHUNK)") for (int64_t i = 0; i < rows; i++)   \
                one_row(q, rowsum, scale, a, s, rows, d, NV, y, b, i, mx);                    \
            if (b) {                                                                          \
                _Pragma("omp critical") for (int v = 0; v < NV; v++) b->lomax[v] =           \
                    mx[v] > b->lomax[v] ? mx[v] : b->lomax[v];                               \
            }                                                                                 \
        }                                                                                     \
    }
ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)

static int run(const int8_t *q, const int32_t *rowsum, const float *scale, const uint8_t *a,
               const float *s, int64_t rows, int64_t d, int nvec, float *y, const bound_t *b) {
    if (d % 64) return -1;
#if defined(WIDE_PARTS) || defined(CENTRED_PARTS)
    apart_t *wide = malloc(sizeof(apart_t) * (size_t)(2 * nvec * d));
    if (!wide) return -2;
#ifdef WIDE_PARTS
    for (int64_t x = 0; x < 2 * nvec * d; x++) wide[x] = a[x];
#else
    for (int64_t x = 0; x < 2 * nvec * d; x++) wide[x] = (int8_t)(a[x] ^ 0x80);
#endif
    const apart_t *parts = wide;
#else
    const apart_t *parts = a;
#endif
    for (int v0 = 0; v0 < nvec; v0 += MAXV) {
        int nv = nvec - v0 < MAXV ? nvec - v0 : MAXV;
        const apart_t *av = parts + (int64_t)2 * v0 * d;
        const float *sv = s + 2 * v0;
        float *yv = y ? y + (int64_t)v0 * rows : NULL;
        bound_t bv, *bp = NULL;
        if (b) { /* the bound's per-vector arrays from vector v0 */
            bv = *b;
            bv.cw += v0, bv.ca += v0, bv.up += (int64_t)v0 * rows, bv.lomax += v0;
            if (bv.lo) bv.lo += (int64_t)v0 * rows;
            for (int v = 0; v < nv; v++) bv.lomax[v] = -INFINITY;
            bp = &bv;
        }
        switch (nv) { /* constant trip counts keep the accumulators in registers */
        case 1: rows_1(q, rowsum, scale, av, sv, rows, d, yv, bp); break;
        case 2: rows_2(q, rowsum, scale, av, sv, rows, d, yv, bp); break;
        case 3: rows_3(q, rowsum, scale, av, sv, rows, d, yv, bp); break;
        default: rows_4(q, rowsum, scale, av, sv, rows, d, yv, bp); break;
        }
    }
#if defined(WIDE_PARTS) || defined(CENTRED_PARTS)
    free(wide);
#endif
    return 0;
}

/* Returns 0, -1 when d is not a multiple of 64, -2 out of memory. */
int int8_head(const int8_t *q, const int32_t *rowsum, const float *scale, const uint8_t *a,
              const float *s, int64_t rows, int64_t d, int nvec, float *y) {
    return run(q, rowsum, scale, a, s, rows, d, nvec, y, NULL);
}

/* int8_head with head.py's bound applied in the same pass, so no vocabulary-sized pass of
 * torch follows it: for token i of vector v (y as int8_head's), with B = margin (err[i] cw[v]
 * + amax[i] ca[v] + rel |y|), up[v][i] = y + B, lo[v][i] = y - B (lo may be NULL) and
 * lomax[v] = max_i (y - B) (exact: a max does not depend on the order). Returns as
 * int8_head. */
int int8_head_bound(const int8_t *q, const int32_t *rowsum, const float *scale,
                    const float *err, const float *amax, const uint8_t *a, const float *s,
                    int64_t rows, int64_t d, int nvec, const float *cw, const float *ca,
                    float rel, float margin, float *up, float *lo, float *lomax) {
    bound_t b = {err, amax, cw, ca, rel, margin, up, lo, lomax};
    return run(q, rowsum, scale, a, s, rows, d, nvec, NULL, &b);
}

/* The tokens whose upper bound reaches `floor` (head.py's candidates: up >= floor), in order,
 * into ids; their count is returned. `fill`, when given, is set to -inf on the way (the
 * logits row the exact scores then go into). Plain C: one pass over a row of the vocabulary,
 * in every build. */
int64_t head_candidates(const float *up, int64_t rows, float floor, int64_t *ids,
                        float *fill) {
    int64_t n = 0;
    for (int64_t i = 0; i < rows; i++) {
        ids[n] = i;
        n += up[i] >= floor;
    }
    if (fill)
        for (int64_t i = 0; i < rows; i++) fill[i] = -INFINITY;
    return n;
}
