/* y = x W^T with 8-bit activations: every quantized weight matrix's product, many rows
 * (prefill) and one row (decode) alike, on the 16-column tiles quant.py packs at load.
 *
 * Why 8 bits: an 8-bit integer dot product multiplies 4 pairs a 32-bit lane (vpdpbusd on
 * AVX512-VNNI and AVX-VNNI, vpmaddubsw + vpmaddwd on AVX2, sdot on NEON), twice the products an
 * instruction of 16-bit activations (pmaddwd, vdpbf16ps), which is what a prefill chunk is
 * bound by. llama.cpp's CPU kernels multiply the same way (its Q8_0 / Q8_K activation blocks).
 *
 * The activations: each half group of 16 of a row (bf16) is quantized on its own, as llama.cpp's
 * quantize_row_q8_0 quantizes a block of 32: d = amax / 127, a = rint(x (1 / d)) in
 * [-127, 127]; a group keeps its halves' d0 and d1, d0 (sum a) + d1 (sum a) of its halves, and
 * each half's sum of a times 128. Halves rather than llama.cpp's 32 (or 256, its Q8_K for the
 * K-quants): the activations are bf16 here, rounded once more than llama.cpp's f32 rows, and
 * the finer scale more than makes up for it (docs/PERFORMANCE.md: the KL divergence from f32
 * transformers, below llama-server's); the two scales cost one conversion and three f32 operations
 * a row and group, and Q6_K's sub-blocks of 16 take them anyway. A row's codes depend on that
 * row only. A half of zeros has d = 0; a group holding an infinity or a NaN has d0 = d1 = NaN,
 * so every output it reaches is NaN. The codes of each 8 activations are stored in the order
 * 0 4 1 5 2 6 3 7, the order of the 4-bit tiles' nibbles (below), so that both tile kinds take 4
 * of them as one 32-bit operand.
 *
 * The tiles (quant.py's pack_q4, pack_i8): rows of W in tiles of 16 (an output column a 32-bit
 * lane); per (tile, group of 32 weights) a block of 8 weight operands of 64 bytes, operand t
 * holding the 4 codes of each column that meet activation codes 4t..4t+3 (in the stored order):
 *   F_Q4 (Q4_0, Q4_1, Q4_K): 4 chunks of 64 bytes, chunk c's low nibbles operand 2c, high
 *        nibbles 2c + 1 (column j's 4 bytes at 4j: weights 8c + 0 4 1 5 low, 2 6 3 7
 *        high), then 16 f16 scales d
 *        and 16 f16 offsets m: w = d q + m, q in 0..15;
 *   F_I8 (Q8_0, Q5_0), F_I8H (Q6_K), F_I8M (Q5_1, Q5_K): 8 operands of codes c (F_I8: int8,
 *        F_I8H: -32..31, F_I8M: 0..31, which the builds rely on), then 16 f32 scales (F_I8H:
 *        those of the first half group, then the second's; F_I8M: then 16 f32 offsets m):
 *        w = d_h c (+ m).
 *   F_MX (MXFP4): F_Q4's nibbles, each an index into MXFP4's E2M1 values doubled (MX_VALUES:
 *        -12..12), then 16 f32 scales d (the E8M0 scale halved): w = d c. The nibbles are
 *        looked up in registers (a byte shuffle) into the codes F_I8 would hold, so its
 *        products are F_I8's of those codes bit for bit, from half the bytes.
 *
 * The file's own rows (i8a_matmul_rows: a mixture-of-experts model's expert tensors, read where
 * the mapped GGUF holds them instead of copied into tiles): F_FQ8 (Q8_0: per 32 weights an f16
 * scale, then 32 int8 codes) and F_FMX (MXFP4: an E8M0 scale byte, then 16 bytes, weight i in
 * byte i's low nibble and weight 16 + i in its high one). Each (tile, group) is gathered from
 * its 16 rows into the block F_I8 / F_MX would hold, then runs as that block does: the same
 * products bit for bit, from the file's 1.0625 / 0.53 bytes a weight. And F_FQ4K (Q4_K: per
 * 256 weights f16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes, group s's
 * the low (s even) or high nibbles of bytes 32 (s / 2)..+31) as F_Q4 holds it: its scale and
 * offset f16(d sc) and f16(-dmin m), rounded to nearest even as quant.py's split_blocks and
 * pack_q4 round them, computed once a super-block for the tile's 16 rows (0.5625 bytes a
 * weight against the 4-bit tiles' 0.625). And F_FQ6K (Q6_K: per 256 weights 128 bytes of low
 * nibbles, 64 of 2-bit highs, 16 int8 scales a half group, f16 d; qmm.c's q6k_at) as F_I8H
 * holds it: codes q - 32, a half group's scale d sc (0.82 bytes a weight against 1.25).
 *
 * The arithmetic of one output (row r, column j), the same sequence in every path and at any
 * row or thread count, so a row's bits never depend on what shares its call: per group, in
 * order, the exact integer sums of its halves (operands 0-3 and 4-7), then
 *     out = out + float(sum_0) * (d_0 s_0)
 *     out = out + float(sum_1) * (d_1 s_1)  (d_h the weights' scale: equal but for F_I8H)
 *     out = out + m (s_0 sum a_0 + s_1 sum a_1)      (the types with offsets)
 * each operation rounded in f32 as written (this file is built without contraction), then the
 * bf16 rounding. The integer sums are exact in every build (|c a| sums stay far inside 32 bits
 * and inside vpmaddubsw's 16-bit pairs: |c| <= 128, |a| <= 127), so every build computes the
 * same bits; tests/model/test_i8act.py checks each against numpy's replay of this sequence.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define ISA_VNNI512 1
#include <immintrin.h>
#elif defined(__AVXVNNI__)
#define ISA_AVXVNNI 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define ISA_AVX2 1
#include <immintrin.h>
#endif

enum { F_Q4 = 0, F_I8 = 1, F_I8H = 2, F_I8M = 3, F_MX = 4, F_FQ8 = 5, F_FMX = 6, F_FQ4K = 7,
       F_FQ6K = 8 };
/* a file format's block: its weights (a group, or a K-quant super-block of 8) and bytes */
#define FILE_W(f) ((f) >= F_FQ4K ? 256 : 32)
#define FILE_B(f) ((f) == F_FQ8 ? 34 : (f) == F_FMX ? 17 : (f) == F_FQ4K ? 144 : 210)
#define BLOCK(f) ((f) == F_Q4 || (f) == F_MX ? 320 : (f) == F_I8 ? 576 : 640)
/* MXFP4's E2M1 values, doubled (ggml's kvalues_mxfp4), by code */
static const int8_t MX_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* f16 -> f32 (exact) by hand: the x86-64 baseline has no conversion instruction, and the
 * compiler's library call for each was half of a decode step's time; the file formats' Q8_0
 * scales too, on every build (a scalar a row) */
static inline float half_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, u = s;
    if (e == 31) /* infinity, NaN (made quiet, as the conversion instructions do) */
        u |= 0x7f800000u | m << 13 | (m ? 0x400000u : 0);
    else if (e)
        u |= (e + 112) << 23 | m << 13;
    else if (m) { /* subnormal: m 2^-24, a normal float */
        float f = (float)m * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= s;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* f32 -> f16 rounded to nearest even (numpy's astype(float16)): overflow to infinity, NaN kept
 * a NaN, subnormal halves rounded by the scaling (exact) and rint (the default rounding) */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00;
    if (x >= 0x477ff000u) return sign | 0x7c00; /* 65520 and up: infinity */
    if (x < 0x38800000u) {                      /* below 2^-14: a subnormal half (or 0) */
        float v;
        memcpy(&v, &x, 4);
        return sign | (uint16_t)__builtin_rintf(v * 16777216.f);
    }
    x -= 0x38000000u; /* the exponent rebiased */
    x += 0xfffu + ((x >> 13) & 1);
    return sign | (uint16_t)(x >> 13);
}
/* MXFP4's E8M0 scale halved, 2^(e - 128), as ggml's e8m0_to_fp32_half (e < 2: subnormal) */
static inline float e8m0_half(uint8_t e) {
    uint32_t u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* tiles ahead whose groups are prefetched into L2, at every row count: a decode step's matrices
 * are small, and the stream prefetcher is still ramping up when one ends; a prefill block
 * spends long enough on a tile for the next ones' bytes to arrive (1.15-2.1x on the 8-bit
 * tiles' prefill in process, docs/PERFORMANCE.md) */
#define PF_TILES 4
/* rows a thread keeps hot while it walks its tiles: about RB_BYTES of activation codes (L2),
 * and at most RB_MAX, so the block's f32 outputs of a tile (RB_MAX * 64 bytes) stay in L1 */
#define RB_BYTES (256 * 1024)
#define RB_MAX 128

/* A row's group: its halves' scales d0, d1, d0 (sum a_0) + d1 (sum a_1), and 128 (sum a) of
 * each half (the VNNI builds' signed codes go in as c + 128, so the products gain 128 a, taken
 * back out exactly). */
typedef struct {
    float s0, s1, ssum;
    int32_t h0, h1;
} gmeta;

/* --- Each build's 16 lanes (columns): the integer step += 4 codes x 4 activation codes, and
 * the f32 operations after it. ---
 * wv: one 64-byte weight operand as the build holds it; iv: 16 int32 lanes; fv: 16 floats in
 * the build's registers (GCC's generic 16-float vectors go through memory on AVX2). dpu takes
 * the 4-bit tiles' unsigned codes, dps the signed ones (VNNI: c + 128, corrected by fix). */
#if defined(ISA_VNNI512)
typedef __m512i wv;
typedef __m512i iv;
static inline iv izero(void) { return _mm512_setzero_si512(); }
/* the activations as an embedded-broadcast operand: gcc 12 adds a vpbroadcastd for the
 * intrinsic (the same bits: the broadcast is a copy) */
static inline iv dpu(iv acc, wv w, const int8_t *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)a));
    return acc;
}
#define HAVE_FIX 1 /* signed codes go in as c + 128: their 128 a taken back out */
static inline iv fix(iv acc, int32_t h) { return _mm512_sub_epi32(acc, _mm512_set1_epi32(h)); }
typedef __m512 fv;
static inline fv tof(iv a) { return _mm512_cvtepi32_ps(a); }
static inline fv fadd(fv a, fv b) { return _mm512_add_ps(a, b); }
static inline fv fmul(fv a, fv b) { return _mm512_mul_ps(a, b); }
static inline fv fscale(fv a, float s) { return _mm512_mul_ps(a, _mm512_set1_ps(s)); }
static inline fv fzero(void) { return _mm512_setzero_ps(); }
static inline fv fload(const void *p) { return _mm512_loadu_ps(p); }
static inline void fstore(float *p, fv a) { _mm512_storeu_ps(p, a); }
static inline fv fhalves(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void unpack_q4(const uint8_t *blk, wv w[8]) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        __m512i v = _mm512_loadu_si512(blk + 64 * c);
        w[2 * c] = _mm512_and_si512(v, low);
        w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}
static inline void unpack_i8(const int f, const uint8_t *blk, wv w[8]) {
    const __m512i top = _mm512_set1_epi8(f == F_I8M ? 0 : (char)0x80);
    for (int t = 0; t < 8; t++) w[t] = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * t), top);
}
/* F_I8's operand from its columns 0-7 and 8-15 (signed codes, in as c + 128), and 16 floats */
static inline wv i8_operand(__m256i lo, __m256i hi) {
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                            _mm512_set1_epi8((char)0x80));
}
/* F_Q4's operand (unsigned codes, as unpack_q4 leaves them) from its columns 0-7 and 8-15 */
static inline wv u4_operand(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
/* F_I8H's (Q6_K's codes -32..31), as unpack_i8 leaves them: as F_I8's here */
static inline wv i8h_operand(__m256i lo, __m256i hi) { return i8_operand(lo, hi); }
static inline fv fpair(__m256 lo, __m256 hi) {
    return _mm512_castsi512_ps(_mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_castps_si256(lo)), _mm256_castps_si256(hi), 1));
}
/* F_MX: the nibbles looked up as F_I8's codes go in (c + 128) */
static inline void unpack_mx(const uint8_t *blk, wv w[8]) {
    unpack_q4(blk, w);
    const __m512i lut = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_VALUES)),
        _mm512_set1_epi8((char)0x80));
    for (int t = 0; t < 8; t++) w[t] = _mm512_shuffle_epi8(lut, w[t]);
}
#elif defined(ISA_AVXVNNI) || defined(ISA_AVX2)
/* two ymm halves: columns 0-7 and 8-15; AVX2 keeps the signed codes' magnitudes in v and the
 * codes themselves in s (vpmaddubsw's unsigned operand, and the signs it moves to a) */
typedef struct {
    __m256i v[2];
#if defined(ISA_AVX2)
    __m256i s[2];
#endif
} wv;
typedef struct {
    __m256i v[2];
} iv;
static inline iv izero(void) { return (iv){{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
static inline __m256i bcast(const int8_t *a) {
    int32_t x;
    memcpy(&x, a, 4);
    return _mm256_set1_epi32(x);
}
#if defined(ISA_AVXVNNI)
static inline iv dpu(iv acc, wv w, const int8_t *a) {
    __m256i x = bcast(a);
    return (iv){{_mm256_dpbusd_avx_epi32(acc.v[0], w.v[0], x),
                 _mm256_dpbusd_avx_epi32(acc.v[1], w.v[1], x)}};
}
#define HAVE_FIX 1
static inline iv fix(iv acc, int32_t h) {
    __m256i x = _mm256_set1_epi32(h);
    return (iv){{_mm256_sub_epi32(acc.v[0], x), _mm256_sub_epi32(acc.v[1], x)}};
}
#else
static inline iv dpu(iv acc, wv w, const int8_t *a) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256i x = bcast(a);
    for (int i = 0; i < 2; i++)
        acc.v[i] = _mm256_add_epi32(
            acc.v[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w.v[i], x), one));
    return acc;
}
/* The unsigned codes' half group (4 steps) at once: vpmaddubsw's pair sums added in 16 bits
 * (codes <= 31: the 4-bit tiles' and Q5's, |a| <= 127: at most 4 x 2 x 31 x 127 = 31,496,
 * exact), widened once, where the step-by-step path widens each step. */
#define HAVE_DPU4 1
static inline iv dpu4(const wv *w, const int8_t *a) {
    const __m256i one = _mm256_set1_epi16(1);
    iv acc;
    for (int i = 0; i < 2; i++) {
        __m256i s = _mm256_maddubs_epi16(w[0].v[i], bcast(a));
        for (int t = 1; t < 4; t++)
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[t].v[i], bcast(a + 4 * t)));
        acc.v[i] = _mm256_madd_epi16(s, one);
    }
    return acc;
}
/* Q6_K's half group: its codes (-32..31) go in as c + 32 (0..63), pairs of steps added in 16
 * bits (at most 2 x 2 x 63 x 127 = 32,004, exact), the 32 a taken back out (h / 4: h is 128
 * sum a): half the instructions of the signs moved to the activations, exactly the same sum */
#define HAVE_DPH 1
static inline iv dph(const wv *w, const int8_t *a, int32_t h) {
    const __m256i one = _mm256_set1_epi16(1), fix = _mm256_set1_epi32(h / 4);
    iv acc;
    for (int i = 0; i < 2; i++) {
        __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0].v[i], bcast(a)),
                                      _mm256_maddubs_epi16(w[1].v[i], bcast(a + 4)));
        __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2].v[i], bcast(a + 8)),
                                      _mm256_maddubs_epi16(w[3].v[i], bcast(a + 12)));
        acc.v[i] = _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(s0, one),
                                                     _mm256_madd_epi16(s1, one)), fix);
    }
    return acc;
}
#define HAVE_DPS 1 /* the signs moved to the activations: vpmaddubsw's first operand is unsigned */
static inline iv dps(iv acc, wv w, const int8_t *a) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256i x = bcast(a);
    for (int i = 0; i < 2; i++)
        acc.v[i] = _mm256_add_epi32(
            acc.v[i],
            _mm256_madd_epi16(_mm256_maddubs_epi16(w.v[i], _mm256_sign_epi8(x, w.s[i])), one));
    return acc;
}
#endif
typedef struct {
    __m256 v[2];
} fv;
static inline fv tof(iv a) { return (fv){{_mm256_cvtepi32_ps(a.v[0]), _mm256_cvtepi32_ps(a.v[1])}}; }
static inline fv fadd(fv a, fv b) {
    return (fv){{_mm256_add_ps(a.v[0], b.v[0]), _mm256_add_ps(a.v[1], b.v[1])}};
}
static inline fv fmul(fv a, fv b) {
    return (fv){{_mm256_mul_ps(a.v[0], b.v[0]), _mm256_mul_ps(a.v[1], b.v[1])}};
}
static inline fv fscale(fv a, float s) {
    __m256 x = _mm256_set1_ps(s);
    return (fv){{_mm256_mul_ps(a.v[0], x), _mm256_mul_ps(a.v[1], x)}};
}
static inline fv fzero(void) { return (fv){{_mm256_setzero_ps(), _mm256_setzero_ps()}}; }
static inline fv fload(const void *p) {
    return (fv){{_mm256_loadu_ps(p), _mm256_loadu_ps((const float *)p + 8)}};
}
static inline void fstore(float *p, fv a) {
    _mm256_storeu_ps(p, a.v[0]);
    _mm256_storeu_ps(p + 8, a.v[1]);
}
static inline fv fhalves(const uint8_t *p) {
    return (fv){{_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))}};
}
static inline void unpack_q4(const uint8_t *blk, wv w[8]) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 2; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * i));
            w[2 * c].v[i] = _mm256_and_si256(v, low);
            w[2 * c + 1].v[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
}
static inline void unpack_i8(const int f, const uint8_t *blk, wv w[8]) {
    for (int t = 0; t < 8; t++)
        for (int i = 0; i < 2; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * t + 32 * i));
            if (f == F_I8M) {
                w[t].v[i] = v;
                continue;
            }
#if defined(ISA_AVXVNNI)
            w[t].v[i] = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
#else
            if (f == F_I8H) {
                w[t].v[i] = _mm256_add_epi8(v, _mm256_set1_epi8(32));
                continue;
            }
            w[t].v[i] = _mm256_abs_epi8(v);
            w[t].s[i] = v;
#endif
        }
}
/* F_I8's operand from its columns 0-7 and 8-15 (signed codes), as unpack_i8 leaves them */
static inline wv i8_operand(__m256i lo, __m256i hi) {
    wv w;
    __m256i c[2] = {lo, hi};
    for (int i = 0; i < 2; i++) {
#if defined(ISA_AVXVNNI)
        w.v[i] = _mm256_xor_si256(c[i], _mm256_set1_epi8((char)0x80));
#else
        w.v[i] = _mm256_abs_epi8(c[i]);
        w.s[i] = c[i];
#endif
    }
    return w;
}
static inline fv fpair(__m256 lo, __m256 hi) { return (fv){{lo, hi}}; }
static inline wv u4_operand(__m256i lo, __m256i hi) {
    wv w;
    w.v[0] = lo, w.v[1] = hi;
    return w;
}
/* F_I8H's operand (Q6_K's codes -32..31), as unpack_i8 leaves them: c + 128 (AVX-VNNI), c + 32
 * (AVX2, for dph) */
static inline wv i8h_operand(__m256i lo, __m256i hi) {
#if defined(ISA_AVXVNNI)
    return i8_operand(lo, hi);
#else
    const __m256i k = _mm256_set1_epi8(32);
    return u4_operand(_mm256_add_epi8(lo, k), _mm256_add_epi8(hi, k));
#endif
}
/* F_MX: the nibbles looked up as unpack_i8 leaves F_I8's codes */
static inline void unpack_mx(const uint8_t *blk, wv w[8]) {
    unpack_q4(blk, w);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX_VALUES));
    for (int t = 0; t < 8; t++)
        for (int i = 0; i < 2; i++) {
            __m256i c = _mm256_shuffle_epi8(lut, w[t].v[i]);
#if defined(ISA_AVXVNNI)
            w[t].v[i] = _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80));
#else
            w[t].v[i] = _mm256_abs_epi8(c);
            w[t].s[i] = c;
#endif
        }
}
#elif defined(RS_NEON)
/* four q registers of 4 columns; sdot multiplies signed bytes, and the 4-bit codes (<= 15)
 * are signed bytes as they are */
typedef struct {
    int8x16_t v[4];
} wv;
typedef struct {
    int32x4_t v[4];
} iv;
static inline iv izero(void) {
    return (iv){{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}};
}
static inline iv dpu(iv acc, wv w, const int8_t *a) {
    int32_t x;
    memcpy(&x, a, 4);
    int8x16_t b = vreinterpretq_s8_s32(vdupq_n_s32(x));
    for (int i = 0; i < 4; i++) acc.v[i] = vdotq_s32(acc.v[i], w.v[i], b);
    return acc;
}
typedef struct {
    float32x4_t v[4];
} fv;
static inline fv tof(iv a) {
    fv f;
    for (int i = 0; i < 4; i++) f.v[i] = vcvtq_f32_s32(a.v[i]);
    return f;
}
static inline fv fadd(fv a, fv b) {
    for (int i = 0; i < 4; i++) a.v[i] = vaddq_f32(a.v[i], b.v[i]);
    return a;
}
static inline fv fmul(fv a, fv b) {
    for (int i = 0; i < 4; i++) a.v[i] = vmulq_f32(a.v[i], b.v[i]);
    return a;
}
static inline fv fscale(fv a, float s) {
    for (int i = 0; i < 4; i++) a.v[i] = vmulq_n_f32(a.v[i], s);
    return a;
}
static inline fv fzero(void) {
    fv f;
    for (int i = 0; i < 4; i++) f.v[i] = vdupq_n_f32(0.f);
    return f;
}
static inline fv fload(const void *p) {
    fv f;
    for (int i = 0; i < 4; i++) f.v[i] = vld1q_f32((const float *)p + 4 * i);
    return f;
}
static inline void fstore(float *p, fv a) {
    for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, a.v[i]);
}
static inline fv fhalves(const uint8_t *p) {
    fv f;
    for (int i = 0; i < 4; i++) f.v[i] = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p + 8 * i)));
    return f;
}
static inline void unpack_q4(const uint8_t *blk, wv w[8]) {
    const uint8x16_t low = vdupq_n_u8(15);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            uint8x16_t v = vld1q_u8(blk + 64 * c + 16 * i);
            w[2 * c].v[i] = vreinterpretq_s8_u8(vandq_u8(v, low));
            w[2 * c + 1].v[i] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        }
}
static inline void unpack_i8(const int f, const uint8_t *blk, wv w[8]) {
    (void)f;
    for (int t = 0; t < 8; t++)
        for (int i = 0; i < 4; i++) w[t].v[i] = vld1q_s8((const int8_t *)blk + 64 * t + 16 * i);
}
/* F_MX: the nibbles looked up as signed codes (sdot takes them as they are) */
static inline void unpack_mx(const uint8_t *blk, wv w[8]) {
    unpack_q4(blk, w);
    const int8x16_t lut = vld1q_s8(MX_VALUES);
    for (int t = 0; t < 8; t++)
        for (int i = 0; i < 4; i++) w[t].v[i] = vqtbl1q_s8(lut, vreinterpretq_u8_s8(w[t].v[i]));
}
#else
/* plain C, in floats: every product and partial sum of a half is an integer of magnitude below
 * 2^24 (16 products of at most 128 x 127), so float arithmetic gives the exact integer sums in
 * any order. In GCC's 4-float vectors (SSE2 on the x86-64 baseline, NEON on aarch64, scalar
 * code elsewhere) it runs several times faster than bytes multiplied one at a time. A tile
 * group's codes are converted once, operand t's code for activation i of columns 4q..4q+3 at
 * w[t].v[i][q], so a step is 4 vector multiply-adds a quarter of the columns. */
typedef float f4 __attribute__((vector_size(16)));
typedef struct {
    f4 v[4][4];
} wv;
typedef struct {
    f4 v[4];
} fv;
typedef fv iv;
static inline fv fzero(void) { return (fv){{{0}, {0}, {0}, {0}}}; }
static inline iv izero(void) { return fzero(); }
static inline iv dpu(iv acc, wv w, const int8_t *a) {
    for (int i = 0; i < 4; i++) {
        const f4 x = {a[i], a[i], a[i], a[i]};
        for (int q = 0; q < 4; q++) acc.v[q] += w.v[i][q] * x;
    }
    return acc;
}
static inline fv tof(iv a) { return a; }
static inline fv fadd(fv a, fv b) {
    for (int q = 0; q < 4; q++) a.v[q] += b.v[q];
    return a;
}
static inline fv fmul(fv a, fv b) {
    for (int q = 0; q < 4; q++) a.v[q] *= b.v[q];
    return a;
}
static inline fv fscale(fv a, float s) {
    const f4 x = {s, s, s, s};
    for (int q = 0; q < 4; q++) a.v[q] *= x;
    return a;
}
static inline fv fload(const void *p) {
    fv f;
    memcpy(&f, p, sizeof f);
    return f;
}
static inline void fstore(float *p, fv a) { memcpy(p, &a, sizeof a); }
static inline fv fhalves(const uint8_t *p) {
    float f[16];
    for (int j = 0; j < 16; j++) {
        uint16_t h;
        memcpy(&h, p + 2 * j, 2);
        f[j] = half_f32(h);
    }
    return fload(f);
}
/* the 4 codes of a column are the bytes of a 32-bit word: each is shifted out of 4 columns'
 * words at once */
typedef uint32_t u4 __attribute__((vector_size(16)));
typedef int32_t i4 __attribute__((vector_size(16)));
static inline void unpack_q4(const uint8_t *blk, wv w[8]) {
    for (int c = 0; c < 4; c++)
        for (int q = 0; q < 4; q++) {
            u4 x;
            memcpy(&x, blk + 64 * c + 16 * q, 16);
            for (int i = 0; i < 4; i++) {
                w[2 * c].v[i][q] = __builtin_convertvector((x >> (8 * i)) & 15, f4);
                w[2 * c + 1].v[i][q] = __builtin_convertvector((x >> (8 * i + 4)) & 15, f4);
            }
        }
}
static inline void unpack_i8(const int f, const uint8_t *blk, wv w[8]) {
    (void)f;
    for (int t = 0; t < 8; t++)
        for (int q = 0; q < 4; q++) {
            i4 x;
            memcpy(&x, blk + 64 * t + 16 * q, 16);
            for (int i = 0; i < 4; i++) /* byte i, sign-extended (an arithmetic shift) */
                w[t].v[i][q] = __builtin_convertvector((x << (24 - 8 * i)) >> 24, f4);
        }
}
/* F_MX: the nibbles (unpack_q4's floats 0..15) looked up lane by lane */
static inline void unpack_mx(const uint8_t *blk, wv w[8]) {
    unpack_q4(blk, w);
    for (int t = 0; t < 8; t++)
        for (int i = 0; i < 4; i++)
            for (int q = 0; q < 4; q++)
                for (int l = 0; l < 4; l++) w[t].v[i][q][l] = MX_VALUES[(int)w[t].v[i][q][l]];
}
#endif

/* The builds that multiply signed codes as they are (dps = dpu) and need no correction */
#if !defined(HAVE_DPS)
static inline iv dps(iv acc, wv w, const int8_t *a) { return dpu(acc, w, a); }
#endif
#if !defined(HAVE_FIX)
static inline iv fix(iv acc, int32_t h) {
    (void)h;
    return acc;
}
#endif

/* A (tile, group)'s block decoded for its rows: the weight operands, d0 and d1 (the halves'
 * scales; equal but for F_I8H) and m (zero for F_I8, F_I8H). */
typedef struct {
    wv w[8];
    fv d0, d1, m;
} tgroup;

static inline __attribute__((always_inline)) void load_group(const int f, const uint8_t *blk,
                                                             tgroup *g) {
    if (f == F_Q4) {
        unpack_q4(blk, g->w);
        g->d0 = g->d1 = fhalves(blk + 256);
        g->m = fhalves(blk + 288);
        return;
    }
    if (f == F_MX) {
        unpack_mx(blk, g->w);
        g->d0 = g->d1 = fload(blk + 256);
        g->m = fzero();
        return;
    }
    unpack_i8(f, blk, g->w);
    g->d0 = g->d1 = fload(blk + 512);
    g->m = fzero();
    if (f == F_I8H) g->d1 = fload(blk + 576);
    if (f == F_I8M) g->m = fload(blk + 576);
}

/* The weights' order in a tile's group (PERM, below) as the weight each position holds */
static const int PERM[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/* A tile's Q4_K scales and offsets for one super-block (sb: its first row's block, rb bytes a
 * row), as F_Q4's f16: kc[0][s][j] f16(d sc_s) of row j, kc[1][s][j] f16(-dmin m_s), the
 * 6-bit sc and m unpacked as ggml's get_scale_min_k4. */
static inline void q4k_scales_c(const uint8_t *sb, int64_t rb, uint16_t kc[2][8][16]) {
    for (int j = 0; j < 16; j++) {
        const uint8_t *b = sb + j * rb, *q = b + 4;
        uint16_t h0, h1;
        memcpy(&h0, b, 2);
        memcpy(&h1, b + 2, 2);
        float d = half_f32(h0), dmin = half_f32(h1);
        for (int s = 0; s < 8; s++) {
            int sc = s < 4 ? q[s] & 63 : (q[s + 4] & 15) | (q[s - 4] >> 6) << 4;
            int m = s < 4 ? q[s + 4] & 63 : q[s + 4] >> 4 | (q[s] >> 6) << 4;
            kc[0][s][j] = f32_to_f16(d * (float)sc);
            kc[1][s][j] = f32_to_f16(-dmin * (float)m);
        }
    }
}

#if defined(__AVX2__)
/* Eight 32-bit lanes of 8 registers transposed: r[i] lane t -> r[t] lane i */
static inline void transpose8(__m256i r[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            b[i + h] = _mm256_unpacklo_epi64(a[i + h], a[i + 2 + h]);
            b[i + 2 + h] = _mm256_unpackhi_epi64(a[i + h], a[i + 2 + h]);
        }
    /* b[0..3]: rows 0-3, lanes (0 4) (2 6) (1 5) (3 7) in their 128-bit halves; b[4..7]: rows
     * 4-7 */
    static const int at[4] = {0, 2, 1, 3};
    for (int q = 0; q < 4; q++) {
        r[at[q]] = _mm256_permute2x128_si256(b[q], b[4 + q], 0x20);
        r[at[q] + 4] = _mm256_permute2x128_si256(b[q], b[4 + q], 0x31);
    }
}

/* A file group (load_file_group's) straight into the build's registers, 8 rows (lanes) at a
 * time: Q8_0's 32 codes of each row in the tiles' order (PERM within each 8), transposed by
 * 32-bit lanes into operand t's columns; MXFP4's 16 bytes of each row in that order (weights i
 * and 16 + i share a byte, so both halves are in order), 4 rows to a register transposed into
 * operands 0-3 (their low nibbles) and 4-7 (the high ones), the nibbles looked up into
 * MX_VALUES, so the products are F_I8's on those codes, as F_MX's are. The scales are
 * inserted from the rows one by one (a load of bytes just stored would wait for them). */
/* q4k_scales_c in registers: each row's 8 scales and 8 offsets as 8 floats, 8 rows transposed
 * into a register a sub-block, rounded to f16 by the conversion instruction (nearest even). */
static inline void q4k_scales_x86(const uint8_t *sb, int64_t rb, uint16_t kc[2][8][16]) {
    const __m128i ia = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m128i ib = _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
    const __m128i m47 = _mm_setr_epi8(0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i m1215 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1);
    __m256i sc[2][8], mn[2][8];
    for (int half = 0; half < 2; half++) {
        for (int i = 0; i < 8; i++) {
            const uint8_t *b = sb + (8 * half + i) * rb;
            int32_t dd;
            memcpy(&dd, b, 4); /* d, dmin */
            __m128 df = _mm_cvtph_ps(_mm_cvtsi32_si128(dd));
            __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
            __m128i a = _mm_shuffle_epi8(q, ia), h = _mm_shuffle_epi8(q, ib);
            __m128i top = _mm_and_si128(_mm_srli_epi16(h, 2), _mm_set1_epi8(0x30));
            __m128i v = _mm_and_si128(a, _mm_set1_epi8(63));
            v = _mm_blendv_epi8(v, _mm_or_si128(_mm_and_si128(a, _mm_set1_epi8(15)), top), m47);
            v = _mm_blendv_epi8(v, _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4),
                                                              _mm_set1_epi8(15)), top), m1215);
            __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
            __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
            __m256 d = _mm256_broadcastss_ps(df);
            __m256 dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(df));
            sc[half][i] = _mm256_castps_si256(_mm256_mul_ps(d, scf));
            mn[half][i] = _mm256_castps_si256(
                _mm256_mul_ps(_mm256_xor_ps(dmin, _mm256_set1_ps(-0.f)), mnf));
        }
        transpose8(sc[half]);
        transpose8(mn[half]);
    }
    /* a sub-block's 16 rows in one store: the group's 32-byte load then takes it from the
     * store buffer (two 16-byte stores would make it wait for them) */
#define HALVES(v, h) _mm256_cvtps_ph(_mm256_castsi256_ps(v[h][s]), _MM_FROUND_TO_NEAREST_INT)
    for (int s = 0; s < 8; s++) {
        _mm256_storeu_si256((__m256i *)kc[0][s], _mm256_setr_m128i(HALVES(sc, 0), HALVES(sc, 1)));
        _mm256_storeu_si256((__m256i *)kc[1][s], _mm256_setr_m128i(HALVES(mn, 0), HALVES(mn, 1)));
    }
#undef HALVES
}

static inline __attribute__((always_inline)) void file_group_x86(const int f, const uint8_t *row,
                                                                 int64_t rb, tgroup *g, int s,
                                                                 uint16_t kc[2][8][16]) {
    const __m256i perm = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                          0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    __m256i r[2][8];
    __m256 d[2];
    if (f == F_FQ6K) { /* group s (qmm.c's q6k_at): low bits from ql, high from qh, less 32 */
        const int h = s / 4, s2 = s % 4;
        const __m128i lsh = _mm_cvtsi32_si128(4 * (s2 / 2)), hsh = _mm_cvtsi32_si128(2 * s2);
        const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
        uint64_t dw[4] = {0, 0, 0, 0}, sw[4] = {0, 0, 0, 0}; /* d (4 a word), scale pairs */
        for (int half = 0; half < 2; half++) {
            for (int i = 0; i < 8; i++) {
                const int j = 8 * half + i;
                const uint8_t *b = row + j * rb;
                __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s2 & 1)));
                __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                __m256i q = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srl_epi16(ql, lsh), low),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, hsh), two), 4));
                r[half][i] = _mm256_shuffle_epi8(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), perm);
                uint16_t x, sc;
                memcpy(&x, b + 208, 2);
                memcpy(&sc, b + 192 + 2 * s, 2);
                dw[j / 4] |= (uint64_t)x << (16 * (j % 4));
                sw[j / 4] |= (uint64_t)sc << (16 * (j % 4));
            }
            transpose8(r[half]);
        }
        for (int t = 0; t < 8; t++) g->w[t] = i8h_operand(r[0][t], r[1][t]);
        __m256 d0[2], d1[2];
        for (int q = 0; q < 2; q++) {
            __m256 d = _mm256_cvtph_ps(_mm_set_epi64x((int64_t)dw[2 * q + 1], (int64_t)dw[2 * q]));
            __m128i p = _mm_set_epi64x((int64_t)sw[2 * q + 1], (int64_t)sw[2 * q]);
            __m256i e = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(
                p, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
            __m256i o = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(
                p, _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14)));
            d0[q] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(e));
            d1[q] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(o));
        }
        g->d0 = fpair(d0[0], d0[1]);
        g->d1 = fpair(d1[0], d1[1]);
        g->m = fzero();
        return;
    }
    if (f == F_FQ4K) { /* sub-blocks s and s + 1 (s even): the low and high nibbles of the
                        * same 32 bytes, transposed once; g[1] the second */
        const __m256i low = _mm256_set1_epi8(15);
        for (int half = 0; half < 2; half++) {
            for (int i = 0; i < 8; i++)
                r[half][i] = _mm256_shuffle_epi8(_mm256_loadu_si256(
                    (const __m256i *)(row + (8 * half + i) * rb + 16 + 16 * s)), perm);
            transpose8(r[half]);
        }
        for (int t = 0; t < 8; t++) {
            g[0].w[t] = u4_operand(_mm256_and_si256(r[0][t], low), _mm256_and_si256(r[1][t], low));
            g[1].w[t] = u4_operand(_mm256_and_si256(_mm256_srli_epi16(r[0][t], 4), low),
                                   _mm256_and_si256(_mm256_srli_epi16(r[1][t], 4), low));
        }
        for (int i = 0; i < 2; i++) {
            g[i].d0 = g[i].d1 = fhalves((const uint8_t *)kc[0][s + i]);
            g[i].m = fhalves((const uint8_t *)kc[1][s + i]);
        }
        return;
    }
    if (f == F_FQ8) {
        for (int half = 0; half < 2; half++) {
            __m128i h = _mm_setzero_si128(); /* the scales, unrolled: an insert's place is an
                                               * immediate (scalars packed in a register instead
                                               * cost MXFP4's gather 1.6-2x its time) */
#define Q8_ROW(i)                                                                              \
    {                                                                                          \
        const uint8_t *b = row + (8 * half + (i)) * rb;                                        \
        uint16_t x;                                                                            \
        memcpy(&x, b, 2);                                                                      \
        h = _mm_insert_epi16(h, x, (i));                                                       \
        r[half][i] = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(b + 2)), perm);   \
    }
            Q8_ROW(0) Q8_ROW(1) Q8_ROW(2) Q8_ROW(3) Q8_ROW(4) Q8_ROW(5) Q8_ROW(6) Q8_ROW(7)
#undef Q8_ROW
            transpose8(r[half]);
            d[half] = _mm256_cvtph_ps(h);
        }
    } else {
#if defined(ISA_VNNI512)
        /* the same in 16 lanes: z[m] rows m, m + 4, m + 8, m + 12; the codes go in as c + 128 */
        const __m512i perm5 = _mm512_broadcast_i32x4(_mm256_castsi256_si128(perm));
        const __m512i lut5 = _mm512_xor_si512(
            _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_VALUES)),
            _mm512_set1_epi8((char)0x80));
        const __m512i low5 = _mm512_set1_epi8(15);
        __m128i e5 = _mm_setzero_si128(); /* the scale bytes, row j's at byte j */
        __m512i z[4];
        /* unrolled so each byte's place is a constant (the insert takes an immediate) */
#define MX_ROWS(m)                                                                             \
    {                                                                                          \
        const uint8_t *b0 = row + (m) * rb, *b1 = b0 + 4 * rb, *b2 = b0 + 8 * rb,              \
                      *b3 = b0 + 12 * rb;                                                      \
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b0 + 1)));        \
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b1 + 1)), 1);              \
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b2 + 1)), 2);              \
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b3 + 1)), 3);              \
        z[m] = _mm512_shuffle_epi8(v, perm5);                                                  \
        e5 = _mm_insert_epi8(e5, b0[0], (m));                                                  \
        e5 = _mm_insert_epi8(e5, b1[0], (m) + 4);                                              \
        e5 = _mm_insert_epi8(e5, b2[0], (m) + 8);                                              \
        e5 = _mm_insert_epi8(e5, b3[0], (m) + 12);                                             \
    }
        MX_ROWS(0) MX_ROWS(1) MX_ROWS(2) MX_ROWS(3)
#undef MX_ROWS
        __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
        __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
        __m512i x5[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                         _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
        for (int c = 0; c < 4; c++) {
            g->w[c] = _mm512_shuffle_epi8(lut5, _mm512_and_si512(x5[c], low5));
            g->w[4 + c] = _mm512_shuffle_epi8(
                lut5, _mm512_and_si512(_mm512_srli_epi16(x5[c], 4), low5));
        }
        __m512i ev = _mm512_cvtepu8_epi32(e5);
        __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), ev);
        __m512i nrm = _mm512_slli_epi32(_mm512_sub_epi32(ev, _mm512_set1_epi32(1)), 23);
        g->d0 = g->d1 = _mm512_castsi512_ps(
            _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(ev, _mm512_set1_epi32(2)), nrm, sub));
        g->m = fzero();
        return;
#endif
        const __m256i lut = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)MX_VALUES));
        const __m256i low = _mm256_set1_epi8(15);
        __m128i e[2] = {_mm_setzero_si128(), _mm_setzero_si128()}; /* the scale bytes */
        for (int half = 0; half < 2; half++) {
            __m256i z[4]; /* z[m]: rows 8 half + m, then + 4 */
#define MX_ROWS(m)                                                                             \
    {                                                                                          \
        const uint8_t *b0 = row + (8 * half + (m)) * rb, *b1 = b0 + 4 * rb;                    \
        e[half] = _mm_insert_epi8(_mm_insert_epi8(e[half], b0[0], (m)), b1[0], (m) + 4);       \
        z[m] = _mm256_shuffle_epi8(_mm256_setr_m128i(_mm_loadu_si128((const __m128i *)(b0 + 1)), \
                                                     _mm_loadu_si128((const __m128i *)(b1 + 1))), \
                                   perm);                                                      \
    }
            MX_ROWS(0) MX_ROWS(1) MX_ROWS(2) MX_ROWS(3)
#undef MX_ROWS
            __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
            __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
            __m256i x[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
            for (int c = 0; c < 4; c++) { /* x[c]: the 8 rows' bytes 4c..4c+3 */
                r[half][c] = _mm256_shuffle_epi8(lut, _mm256_and_si256(x[c], low));
                r[half][4 + c] = _mm256_shuffle_epi8(
                    lut, _mm256_and_si256(_mm256_srli_epi16(x[c], 4), low));
            }
        }
        /* the E8M0 scales halved: e < 2 a subnormal 2^21 << e, else (e - 1) << 23 */
        for (int q = 0; q < 2; q++) {
            __m256i ev = _mm256_cvtepu8_epi32(e[q]);
            __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), ev);
            __m256i nrm = _mm256_slli_epi32(_mm256_sub_epi32(ev, _mm256_set1_epi32(1)), 23);
            __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), ev);
            d[q] = _mm256_castsi256_ps(_mm256_blendv_epi8(nrm, sub, small));
        }
    }
    for (int t = 0; t < 8; t++) g->w[t] = i8_operand(r[0][t], r[1][t]);
    g->d0 = g->d1 = fpair(d[0], d[1]);
    g->m = fzero();
}
#endif

/* A (tile, group) of a file format: the group's blocks of the tile's 16 rows (row: its first
 * row's block, rb: bytes a row) as the registers the packed block of F_I8 / F_MX / F_Q4 load
 * into; Q4_K (row: the rows' super-block) two sub-blocks at once, s and s + 1 (s even) into
 * g[0] and g[1], with kc the super-block's scales (q4k_scales_*). Without AVX2, the packed
 * block is written (quant.py's pack_i8, pack_mx, pack_q4: operand or chunk c, column j's 4
 * bytes at 4j) and loaded as that. */
static inline __attribute__((always_inline)) void load_file_group(const int f,
                                                                  const uint8_t *row,
                                                                  int64_t rb, tgroup *g, int s,
                                                                  uint16_t kc[2][8][16]) {
#if defined(__AVX2__)
    file_group_x86(f, row, rb, g, s, kc);
#else
    uint8_t blk[640] __attribute__((aligned(64)));
    float d[16];
    if (f == F_FQ4K) { /* s and s + 1; chunk c: weights 8c + PERM[i] (low), PERM[4 + i] (high) */
        for (int h = 0; h < 2; h++) {
            for (int j = 0; j < 16; j++) {
                const uint8_t *q = row + j * rb + 16 + 16 * s;
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++)
                        blk[64 * c + 4 * j + i] = (uint8_t)((q[8 * c + PERM[i]] >> 4 * h & 15) |
                                                            (q[8 * c + PERM[4 + i]] >> 4 * h & 15)
                                                                << 4);
            }
            memcpy(blk + 256, kc[0][s + h], 32);
            memcpy(blk + 288, kc[1][s + h], 32);
            load_group(F_Q4, blk, g + h);
        }
        return;
    }
    if (f == F_FQ6K) { /* as F_I8H's block: the codes, then d0 at 512, d1 at 576 */
        const int h = s / 4, s2 = s % 4, lsh = 4 * (s2 / 2), hsh = 2 * s2;
        float d1[16];
        for (int j = 0; j < 16; j++) {
            const uint8_t *b = row + j * rb, *ql = b + 64 * h + 32 * (s2 & 1);
            const uint8_t *qh = b + 128 + 32 * h;
            uint16_t x;
            memcpy(&x, b + 208, 2);
            const float dd = half_f32(x);
            d[j] = dd * (float)(int8_t)b[192 + 2 * s];
            d1[j] = dd * (float)(int8_t)b[193 + 2 * s];
            for (int p = 0; p < 32; p++) { /* position p: weight 8 (p / 8) + PERM[p % 8] */
                const int wi = 8 * (p / 8) + PERM[p % 8];
                blk[64 * (p / 4) + 4 * j + p % 4] =
                    (uint8_t)((((ql[wi] >> lsh) & 15) | ((qh[wi] >> hsh) & 3) << 4) - 32);
            }
        }
        memcpy(blk + 512, d, sizeof d);
        memcpy(blk + 576, d1, sizeof d1);
        load_group(F_I8H, blk, g);
        return;
    }
    (void)s, (void)kc;
    for (int j = 0; j < 16; j++) {
        const uint8_t *b = row + j * rb;
        if (f == F_FQ8) {
            uint16_t h;
            memcpy(&h, b, 2);
            d[j] = half_f32(h);
            for (int s = 0; s < 32; s++) /* position s: weight 8 (s / 8) + PERM[s % 8] */
                blk[64 * (s / 4) + 4 * j + s % 4] = b[2 + 8 * (s / 8) + PERM[s % 8]];
        } else {
            d[j] = e8m0_half(b[0]);
            const uint8_t *q = b + 1; /* chunk c: weights 8c + PERM[i] (low), PERM[4 + i] (high) */
            for (int c = 0; c < 4; c++)
                for (int i = 0; i < 4; i++) {
                    uint8_t lo = q[8 * (c & 1) + PERM[i]], hi = q[8 * (c & 1) + PERM[4 + i]];
                    blk[64 * c + 4 * j + i] = c < 2 ? (uint8_t)((lo & 15) | (hi & 15) << 4)
                                                    : (uint8_t)(lo >> 4 | (hi & 0xf0));
                }
        }
    }
    memcpy(blk + (f == F_FQ8 ? 512 : 256), d, sizeof d);
    load_group(f == F_FQ8 ? F_I8 : F_MX, blk, g);
#endif
}

/* A half group of signed codes (4 operands): the sum, corrected where the build needs it */
static inline iv dpsfix(const wv *w, const int8_t *a, int32_t h) {
    iv acc = izero();
    for (int t = 0; t < 4; t++) acc = dps(acc, w[t], a + 4 * t);
    return fix(acc, h);
}
#if !defined(HAVE_DPH)
static inline iv dph(const wv *w, const int8_t *a, int32_t h) { return dpsfix(w, a, h); }
#endif
#if !defined(HAVE_DPU4)
static inline iv dpu4(const wv *w, const int8_t *a) {
    iv acc = izero();
    for (int t = 0; t < 4; t++) acc = dpu(acc, w[t], a + 4 * t);
    return acc;
}
#endif

/* One row's share of a (tile, group): a its 32 codes, gm its group's scales; the sequence
 * every output runs (the header). */
static inline __attribute__((always_inline)) fv group_row(const int f, const tgroup *g,
                                                          const int8_t *a, const gmeta *gm,
                                                          fv out) {
    iv lo, hi;
    if (f == F_Q4 || f == F_FQ4K || f == F_I8M) { /* unsigned codes: 0..15, 0..31 */
        lo = dpu4(g->w, a);
        hi = dpu4(g->w + 4, a + 16);
    } else if (f == F_I8H || f == F_FQ6K) {
        lo = dph(g->w, a, gm->h0);
        hi = dph(g->w + 4, a + 16, gm->h1);
    } else {
        lo = dpsfix(g->w, a, gm->h0);
        hi = dpsfix(g->w + 4, a + 16, gm->h1);
    }
    out = fadd(out, fmul(tof(lo), fscale(g->d0, gm->s0)));
    out = fadd(out, fmul(tof(hi), fscale(g->d1, gm->s1)));
    if (f == F_Q4 || f == F_FQ4K || f == F_I8M) out = fadd(out, fscale(g->m, gm->ssum));
    return out;
}

/* The activations x [rows, k] as codes (in the tiles' order) and gmeta, group-major: group g
 * of row r at a + 32 (g rows + r) and gm[g rows + r]. */

static void quant_groups(const uint16_t *x, int64_t rows, int64_t ng, int8_t *a, gmeta *gm) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * ng; i++) {
        const int64_t at = (i % ng) * rows + i / ng;
        const uint16_t *xg = x + 32 * i;
        int8_t *ag = a + 32 * at;
        float xf[32], mx[2] = {0.f, 0.f};
        for (int j = 0; j < 32; j++) {
            xf[j] = bf16_to_f32(xg[j]);
            float v = __builtin_fabsf(xf[j]), m = mx[j / 16];
            mx[j / 16] = v > m || v != v ? v : m;
        }
        if (!(mx[0] <= 3.4028234663852886e38f && mx[1] <= 3.4028234663852886e38f)) {
            memset(ag, 0, 32);
            float nan = __builtin_nanf("");
            gm[at] = (gmeta){nan, nan, nan, 0, 0};
            continue;
        }
        int32_t q[32], sum[2] = {0, 0};
        float d[2];
        for (int h = 0; h < 2; h++) {
            d[h] = mx[h] / 127.f;
            float id = d[h] > 0.f ? 1.f / d[h] : 0.f;
            for (int j = 16 * h; j < 16 * h + 16; j++) {
                q[j] = (int32_t)__builtin_rintf(xf[j] * id);
                sum[h] += q[j];
            }
        }
        for (int c = 0; c < 4; c++)
            for (int p = 0; p < 8; p++) ag[8 * c + p] = (int8_t)q[8 * c + PERM[p]];
        gm[at] = (gmeta){d[0], d[1], d[0] * (float)sum[0] + d[1] * (float)sum[1], 128 * sum[0],
                         128 * sum[1]};
    }
}

/* One tile (16 output columns) for nr rows (group g of row r: codes a + 32 (g rows + r), gmeta
 * gm[g rows + r], rows the call's row count, so a group's rows lie together): each
 * (tile, group) decoded once, the rows streamed through it, their f32 outputs in o [nr, 16]
 * (L1) across the groups. pf: the same tile PF_TILES ahead, its groups prefetched. */
static inline __attribute__((always_inline)) void tile_rows(
    const int f, const uint8_t *w, int64_t rb, int64_t ng, const int8_t *a, const gmeta *gm,
    int64_t rows, int64_t nr, uint16_t *y, int64_t n, float *o, const uint8_t *pf) {
    /* bytes a group: its block; for the file formats (w the tile's first row) a group's share
     * of the tile's 16 rows (contiguous in the file), so the prefetch walks the tile ahead
     * from its start as the groups go */
    const int gb = f >= F_FQ8 ? 16 * FILE_B(f) / (FILE_W(f) / 32) : BLOCK(f);
    uint16_t kc[2][8][16] __attribute__((aligned(32))); /* F_FQ4K: a super-block's scales */
    tgroup pair[2]; /* F_FQ4K: two sub-blocks gathered together */
    memset(o, 0, sizeof(float) * 16 * (size_t)nr);
    for (int64_t g = 0; g < ng; g++) {
        if (pf)
            for (int c = 0; c < gb; c += 64) __builtin_prefetch(pf + g * gb + c, 0, 2);
        tgroup tg, *cur = &tg; /* F_FQ4K: one of the pair, not copied */
        if (f == F_FQ4K) { /* a pair of sub-blocks at a time, the scales a super-block */
            const uint8_t *sb = w + g / 8 * 144;
            if (g % 8 == 0) {
#if defined(__AVX2__)
                q4k_scales_x86(sb, rb, kc);
#else
                q4k_scales_c(sb, rb, kc);
#endif
            }
            if (g % 2 == 0) load_file_group(f, sb, rb, pair, (int)(g % 8), kc);
            cur = &pair[g % 2];
        } else if (f == F_FQ6K)
            load_file_group(f, w + g / 8 * 210, rb, &tg, (int)(g % 8), kc);
        else if (f >= F_FQ8)
            load_file_group(f, w + g * FILE_B(f), rb, &tg, 0, kc);
        else
            load_group(f, w + g * BLOCK(f), &tg);
        for (int64_t r = 0; r < nr; r++)
            fstore(o + 16 * r, group_row(f, cur, a + 32 * (g * rows + r), gm + g * rows + r,
                                         fload(o + 16 * r)));
    }
    for (int64_t r = 0; r < nr; r++)
        for (int j = 0; j < 16; j++) y[r * n + j] = f32_to_bf16(o[16 * r + j]);
}

/* Where W's tiles are: packed (w0, tile t at t ng BLOCK), or a file format's rows, rows
 * [0, n0) from w0 and the rest from w1 (a fused gate and up: two tensors of the file), rb
 * bytes a row. */
typedef struct {
    const uint8_t *w0, *w1;
    int64_t n0, rb;
} wsrc;

static inline __attribute__((always_inline)) const uint8_t *tile_at(const int f, const wsrc *s,
                                                                    int64_t t, int64_t ng) {
    if (f < F_FQ8) return s->w0 + t * ng * BLOCK(f);
    return 16 * t < s->n0 ? s->w0 + 16 * t * s->rb : s->w1 + (16 * t - s->n0) * s->rb;
}

static inline __attribute__((always_inline)) void run(const int f, const wsrc *s,
                                                      const int8_t *a, const gmeta *gm,
                                                      int64_t rows, int64_t n, int64_t k,
                                                      uint16_t *y) {
    const int64_t ng = k / 32, tiles = n / 16;
    int64_t block = RB_BYTES / k; /* rows a thread keeps hot */
    block = block > RB_MAX ? RB_MAX : (block < 1 ? 1 : block);
    float o[RB_MAX * 16] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        int64_t nr = rows - r0 < block ? rows - r0 : block;
        /* the same tiles for each thread every block: static schedule, no barrier needed */
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *pf = t + PF_TILES < tiles ? tile_at(f, s, t + PF_TILES, ng) : NULL;
            tile_rows(f, tile_at(f, s, t, ng), s->rb, ng, a + 32 * r0, gm + r0, rows, nr,
                      y + r0 * n + 16 * t, n, o, pf);
        }
    }
}

static int matmul(int f, const wsrc *s, const uint16_t *x, int64_t rows, int64_t n, int64_t k,
                  uint16_t *y) {
    if (rows == 0 || n == 0) return 0;
    const int64_t ng = k / 32;
    size_t mbytes = (sizeof(gmeta) * (size_t)(rows * ng) + 63) / 64 * 64;
    gmeta *gm = aligned_alloc(64, mbytes + ((size_t)(rows * k) + 63) / 64 * 64);
    if (!gm) return 2;
    int8_t *a = (int8_t *)((char *)gm + mbytes);
#pragma omp parallel
    {
        quant_groups(x, rows, ng, a, gm); /* its omp for ends in a barrier */
        switch (f) {
        case F_Q4: run(F_Q4, s, a, gm, rows, n, k, y); break;
        case F_I8: run(F_I8, s, a, gm, rows, n, k, y); break;
        case F_I8H: run(F_I8H, s, a, gm, rows, n, k, y); break;
        case F_MX: run(F_MX, s, a, gm, rows, n, k, y); break;
        case F_FQ8: run(F_FQ8, s, a, gm, rows, n, k, y); break;
        case F_FMX: run(F_FMX, s, a, gm, rows, n, k, y); break;
        case F_FQ4K: run(F_FQ4K, s, a, gm, rows, n, k, y); break;
        case F_FQ6K: run(F_FQ6K, s, a, gm, rows, n, k, y); break;
        default: run(F_I8M, s, a, gm, rows, n, k, y); break;
        }
    }
    free(gm);
    return 0;
}

/* y [rows, n] bf16 = x [rows, k] bf16 (contiguous) times W [n, k]^T held in tile format f
 * (the header). Returns 0; 1 for a format or shape the tiles cannot hold, 2 out of memory. */
int i8a_matmul(int f, const uint8_t *w, const uint16_t *x, int64_t rows, int64_t n, int64_t k,
               uint16_t *y) {
    if (f < F_Q4 || f > F_MX || n < 0 || k <= 0 || n % 16 || k % 32 || rows < 0) return 1;
    const wsrc s = {w, w, n, 0};
    return matmul(f, &s, x, rows, n, k, y);
}

/* The same product for W held in a file format f (F_FQ8, F_FMX, F_FQ4K, F_FQ6K): rows [0, n0)
 * of W at w0, the rest at w1 (NULL when n0 = n), each row k / FILE_W blocks of the format, rb
 * bytes. The argument order leaves w0 where i8a_matmul has w. Returns as i8a_matmul. */
int i8a_matmul_rows(int f, int64_t n0, int64_t rb, const uint8_t *w1, const uint8_t *w0,
                    const uint16_t *x, int64_t rows, int64_t n, int64_t k, uint16_t *y) {
    if (f < F_FQ8 || f > F_FQ6K || n < 0 || k <= 0 || n % 16 || k % FILE_W(f) || rows < 0 ||
        n0 < 0 || n0 > n || n0 % 16 || rb != k / FILE_W(f) * FILE_B(f) || !w0 || (n0 < n && !w1))
        return 1;
    const wsrc s = {w0, w1, n0, rb};
    return matmul(f, &s, x, rows, n, k, y);
}
