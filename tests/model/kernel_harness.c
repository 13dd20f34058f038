/* Runs every kernel of radixserve/model/csrc/ on inputs made here (a fixed pseudo-random
 * stream: random block bytes with valid scales, activations, a KV pool) and writes each
 * output to stdout as a record: u32 name length, the name, u64 byte count, the bytes.
 *
 * Why C: tests/model/test_neon.py links this file with the kernels built for aarch64 (the neon
 * variant and the generic one, by aarch64-linux-gnu-gcc) and runs both under qemu-user, where
 * no Python with torch runs; the test compares the two runs' records.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the kernels' entry points (radixserve/model/csrc) */
int64_t qmm_block(int t, int64_t *bytes);
int qmm_bf16(int t, const uint8_t *w, int64_t row_bytes, const uint16_t *x, int64_t rows,
             int64_t n, int64_t k, uint16_t *y);
int qmm_codes(int t, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, int8_t *c,
              float *d, float *m);
int qmm_rows_f32(int t, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                 const int64_t *ids, int64_t m, float *out);
int qmm_head_dots(int t, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                  const int64_t *ids, int64_t m, const float *h, int64_t nh, float *out);
int int8_head(const int8_t *q, const int32_t *rowsum, const float *scale, const uint8_t *a,
              const float *s, int64_t rows, int64_t d, int nvec, float *y);
int int8_head_bound(const int8_t *q, const int32_t *rowsum, const float *scale,
                    const float *err, const float *amax, const uint8_t *a, const float *s,
                    int64_t rows, int64_t d, int nvec, const float *cw, const float *ca,
                    float rel, float margin, float *up, float *lo, float *lomax);
int64_t head_candidates(const float *up, int64_t rows, float floor, int64_t *ids, float *fill);
int f32_head_dots(const float *w, int64_t v, int64_t d, const int64_t *ids, int64_t m,
                  const float *h, int64_t n, float *out);
int64_t attn_work_floats(int64_t max_len, int64_t n_tok, int n_kv, int g, int d);
int attn_causal_win_bf16(const uint16_t *q, const uint8_t *k, const uint8_t *v, int kt, int vt,
                         int64_t k_hs, int64_t v_hs, int n_seq, const int64_t *const *cells,
                         const int64_t *c0, const int64_t *len, const int64_t *n_new,
                         const int64_t *pos0, int64_t window, int n_kv, int g, int d,
                         float scale, const float *sinks, uint16_t *out, float *work,
                         int64_t work_floats);
int kv_store_rows_bf16(int type, const uint16_t *x, int64_t rows, int d, uint8_t *out);
int attn_step_win_bf16(const uint16_t *qkv, const float *cos, const float *sin, uint8_t *k,
                       uint8_t *v, int kt, int vt, int64_t k_hs, int64_t v_hs,
                       const int64_t *dst, int n_seq,
                       const int64_t *const *cells, const int64_t *c0, const int64_t *len,
                       const int64_t *n_new, const int64_t *pos0, int64_t window,
                       const float *qn, const float *kn, float eps, int n_kv, int g, int d,
                       float scale, const float *sinks, uint16_t *out, float *work,
                       int64_t work_floats);
int attn_head_norm_bf16(const uint16_t *x, int64_t xs, int64_t rows, int nh, int d,
                        const float *w, float eps, uint16_t *y);
void add_rms_norm_bf16(float *x, int64_t xs, const uint16_t *y, const float *w, int64_t rows,
                       int d, float eps, uint16_t *out);
void silu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t ff, uint16_t *out);
void post_norm_add_bf16(float *x, int64_t xs, const uint16_t *y, const float *wp,
                        const float *wn, int64_t rows, int d, float eps, uint16_t *out);
void gelu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t ff, uint16_t *out);
void swiglu_oai_bf16(const uint16_t *gu, int64_t rows, int64_t ff, uint16_t *out);
void short_conv_bf16(const uint16_t *bcx, int64_t T, int e, int L, uint16_t *ck, uint16_t *cv,
                     const int64_t *new_cells, const int64_t *reads, const float *w,
                     uint16_t *out);
int i8a_matmul(int f, const uint8_t *w, const uint16_t *x, int64_t rows, int64_t n, int64_t k,
               uint16_t *y);
int i8a_matmul_rows(int f, int64_t n0, int64_t rb, const uint8_t *w1, const uint8_t *w0,
                    const uint16_t *x, int64_t rows, int64_t n, int64_t k, uint16_t *y);
int bf16_gemm_available(void);
int int8_head_available(void);

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) { /* xorshift64* */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545F4914F6CDD1Dull) >> 32);
}
static float unif(void) { return (float)next() / 4294967296.f * 2.f - 1.f; } /* [-1, 1) */
static uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static uint16_t half(void) { /* a random f16 of magnitude 2^-7 .. 2^-1 */
    return (uint16_t)((next() & 0x8000) | ((8 + next() % 7) << 10) | (next() & 0x3ff));
}
static void put16(uint8_t *p, uint16_t h) { memcpy(p, &h, 2); }

static void emit(const char *name, const void *p, uint64_t n) {
    uint32_t len = (uint32_t)strlen(name);
    fwrite(&len, 4, 1, stdout);
    fwrite(name, 1, len, stdout);
    fwrite(&n, 8, 1, stdout);
    fwrite(p, 1, n, stdout);
}
/* a kernel's return code: record "<name> rc" */
static void emit_rc(const char *name, int64_t v) {
    char full[80];
    snprintf(full, sizeof full, "%s rc", name);
    emit(full, &v, 8);
}

static void *alloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* A matrix [n, k] of type t: random bytes with each block's scales valid halves. */
static uint8_t *matrix(int t, int64_t n, int64_t k, int64_t *row_bytes) {
    int64_t bytes, per = qmm_block(t, &bytes);
    *row_bytes = k / per * bytes;
    uint8_t *w = alloc((size_t)(n * *row_bytes));
    for (int64_t i = 0; i < n * *row_bytes; i++) w[i] = (uint8_t)next();
    for (int64_t b = 0; b < n * k / per; b++) {
        uint8_t *p = w + b * bytes;
        switch (t) {
        case 0: for (int x = 0; x < 32; x++) { float f = unif(); memcpy(p + 4 * x, &f, 4); } break;
        case 1: for (int x = 0; x < 32; x++) put16(p + 2 * x, half()); break;
        case 30: for (int x = 0; x < 32; x++) put16(p + 2 * x, bf16(unif())); break;
        case 14: put16(p + 208, half()); break; /* Q6_K: d last */
        case 3: case 7: case 12: case 13: put16(p + 2, half()); /* fall through: d, m or dmin */
        default: put16(p, half()); break;
        }
    }
    return w;
}

static uint16_t *bf16s(int64_t n, float amp) {
    uint16_t *x = alloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] = bf16(amp * unif());
    return x;
}
static float *f32s(int64_t n, float lo, float hi) {
    float *x = alloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] = lo + (hi - lo) * (unif() + 1.f) / 2.f;
    return x;
}

static void qmm(void) {
    const int types[] = {2, 3, 6, 7, 8, 12, 13, 14, 1, 30, 0};
    const int64_t n = 40, k = 512, rows[] = {1, 3, 5, 9, 130};
    char name[64];
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        int t = types[ti];
        int64_t rb;
        uint8_t *w = matrix(t, n, k, &rb);
        for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri++) {
            uint16_t *x = bf16s(rows[ri] * k, 2.f);
            uint16_t *y = alloc(sizeof(uint16_t) * (size_t)(rows[ri] * n));
            snprintf(name, sizeof name, "qmm_bf16 t%d rows%d", t, (int)rows[ri]);
            emit_rc(name, qmm_bf16(t, w, rb, x, rows[ri], n, k, y));
            emit(name, y, sizeof(uint16_t) * (size_t)(rows[ri] * n));
            free(x), free(y);
        }
        int64_t ids[] = {39, 0, 17, 17, 5};
        float *out = alloc(sizeof(float) * 5 * (size_t)k), *h = f32s(3 * k, -1.f, 1.f);
        snprintf(name, sizeof name, "qmm_rows_f32 t%d", t);
        emit_rc(name, qmm_rows_f32(t, w, rb, n, k, ids, 5, out));
        emit(name, out, sizeof(float) * 5 * (size_t)k);
        float *dots = alloc(sizeof(float) * 3 * (size_t)n);
        snprintf(name, sizeof name, "qmm_head_dots t%d", t);
        emit_rc(name, qmm_head_dots(t, w, rb, n, k, NULL, n, h, 3, dots));
        emit(name, dots, sizeof(float) * 3 * (size_t)n);
        int8_t *c = alloc((size_t)(n * k));
        float *d = alloc(sizeof(float) * (size_t)(n * k / 16));
        float *m = alloc(sizeof(float) * (size_t)(n * k / 32));
        snprintf(name, sizeof name, "qmm_codes t%d", t);
        int rc = qmm_codes(t, w, rb, n, k, c, d, m);
        emit_rc(name, rc);
        if (rc == 0) { /* the types with codes: c, d and m (zero for the symmetric types) */
            snprintf(name, sizeof name, "qmm_codes t%d c", t);
            emit(name, c, (size_t)(n * k));
            snprintf(name, sizeof name, "qmm_codes t%d d", t);
            emit(name, d, sizeof(float) * (size_t)(n * k / 16));
            snprintf(name, sizeof name, "qmm_codes t%d m", t);
            emit(name, m, sizeof(float) * (size_t)(n * k / 32));
        }
        free(w), free(out), free(h), free(dots), free(c), free(d), free(m);
    }
}

static void head(void) {
    const int64_t rows = 300, d = 128;
    int8_t *q = alloc((size_t)(rows * d));
    int32_t *rowsum = alloc(sizeof(int32_t) * (size_t)rows);
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t x = 0; x < d; x++) {
            q[i * d + x] = (int8_t)next();
            rowsum[i] += q[i * d + x];
        }
    }
    float *scale = f32s(rows, 0.001f, 0.01f), *err = f32s(rows, 0.f, 0.01f);
    float *amax = f32s(rows, 0.f, 1.f);
    char name[64];
    for (int nvec = 1; nvec <= 5; nvec += 2) {
        uint8_t *a = alloc((size_t)(2 * nvec * d));
        for (int64_t x = 0; x < 2 * nvec * d; x++) a[x] = (uint8_t)next();
        float *s = f32s(2 * nvec, 0.001f, 0.1f), *cw = f32s(nvec, 0.f, 1.f);
        float *ca = f32s(nvec, 0.f, 1.f);
        float *y = alloc(sizeof(float) * (size_t)(nvec * rows));
        float *up = alloc(sizeof(float) * (size_t)(nvec * rows));
        float *lo = alloc(sizeof(float) * (size_t)(nvec * rows)), *lomax = alloc(sizeof(float) * 8);
        snprintf(name, sizeof name, "int8_head nvec%d", nvec);
        emit_rc(name, int8_head(q, rowsum, scale, a, s, rows, d, nvec, y));
        emit(name, y, sizeof(float) * (size_t)(nvec * rows));
        snprintf(name, sizeof name, "int8_head_bound nvec%d", nvec);
        emit_rc(name, int8_head_bound(q, rowsum, scale, err, amax, a, s, rows, d, nvec, cw, ca,
                                       1e-6f, 1.01f, up, lo, lomax));
        emit(name, up, sizeof(float) * (size_t)(nvec * rows));
        emit(name, lo, sizeof(float) * (size_t)(nvec * rows));
        emit(name, lomax, sizeof(float) * (size_t)nvec);
        int64_t *ids = alloc(sizeof(int64_t) * (size_t)rows);
        float *fill = alloc(sizeof(float) * (size_t)rows);
        snprintf(name, sizeof name, "head_candidates nvec%d", nvec);
        int64_t nc = head_candidates(up, rows, lomax[0], ids, fill);
        emit(name, &nc, 8);
        emit(name, ids, sizeof(int64_t) * (size_t)nc);
        free(a), free(s), free(cw), free(ca), free(y), free(up), free(lo), free(lomax);
        free(ids), free(fill);
    }
    const int64_t v = 50, dd = 96, ids[] = {3, 49, 0, 3};
    float *w = f32s(v * dd, -1.f, 1.f), *h = f32s(3 * dd, -1.f, 1.f);
    float *out = alloc(sizeof(float) * 3 * 4);
    emit_rc("f32_head_dots", f32_head_dots(w, v, dd, ids, 4, h, 3, out));
    emit("f32_head_dots", out, sizeof(float) * 12);
    free(q), free(rowsum), free(scale), free(err), free(amax), free(w), free(h), free(out);
}

/* Two sequences over one pool: one decoding (a permuted cell list of 300, 1 new query), one
 * prefilling a run of 40 cells (40 new queries); plain causal and windowed; the pool's K/V
 * in bf16 and in the quantized cache types (kv_rows.h: 3 q8_0, 4 q4_0; rows of 34 and 18
 * bytes a block). */
static void attention(void) {
    const int n_kv = 2, d = 64, types[3] = {0, 3, 4};
    const int64_t n_cells = 600;
    char name[64];
    for (int ti = 0; ti < 3; ti++)
    for (int g = 1; g <= 3; g += 2) {
        const int t = types[ti];
        const int64_t rb = t == 0 ? 2 * d : t == 3 ? d / 32 * 34 : d / 32 * 18;
        const int64_t stride = n_cells * rb; /* a KV head's bytes */
        uint16_t *k16 = bf16s(n_kv * n_cells * d, 1.f), *v16 = bf16s(n_kv * n_cells * d, 1.f);
        uint8_t *k = alloc((size_t)(n_kv * stride)), *v = alloc((size_t)(n_kv * stride));
        emit_rc("kv_store_rows", kv_store_rows_bf16(t, k16, n_kv * n_cells, d, k));
        emit_rc("kv_store_rows", kv_store_rows_bf16(t, v16, n_kv * n_cells, d, v));
        emit("kv_store_rows", k, (size_t)(n_kv * stride));
        int64_t *list = alloc(sizeof(int64_t) * 300);
        for (int64_t j = 0; j < 300; j++) list[j] = (j * 7 + 11) % 300 + 100;
        const int64_t *cells[2] = {list, NULL};
        const int64_t c0[2] = {0, 500}, len[2] = {300, 40}, n_new[2] = {1, 40};
        const int64_t pos0[2] = {0, 260}, T = 41;
        uint16_t *q = bf16s(T * n_kv * g * d, 2.f);
        uint16_t *out = alloc(sizeof(uint16_t) * (size_t)(T * n_kv * g * d));
        int64_t wf = attn_work_floats(300, T, n_kv, g, d);
        float *work = alloc(sizeof(float) * (size_t)wf);
        float *sinks = f32s(n_kv * g, -3.f, 3.f);
        for (int64_t window = 0; window <= 100; window += 100) {
            snprintf(name, sizeof name, "attn_causal t%d g%d window%d", t, g, (int)window);
            emit_rc(name, attn_causal_win_bf16(q, k, v, t, t, stride, stride,
                                                2, cells, c0, len, n_new,
                                                window ? pos0 : NULL, window, n_kv, g, d,
                                                0.125f, window ? sinks : NULL, out, work, wf));
            emit(name, out, sizeof(uint16_t) * (size_t)(T * n_kv * g * d));
        }
        /* a step: rotate, norm and store the new tokens' q and k, then attend */
        const int64_t width = (n_kv * g + 2 * n_kv) * d;
        uint16_t *qkv = bf16s(T * width, 2.f);
        float *cs = f32s(T * d, -1.f, 1.f), *sn = f32s(T * d, -1.f, 1.f);
        float *qn = f32s(d, 0.5f, 1.5f), *kn = f32s(d, 0.5f, 1.5f);
        int64_t dst[41];
        dst[0] = list[299];
        for (int64_t j = 0; j < 40; j++) dst[1 + j] = 500 + j;
        snprintf(name, sizeof name, "attn_step t%d g%d", t, g);
        emit_rc(name, attn_step_win_bf16(qkv, cs, sn, k, v, t, t, stride, stride, dst, 2, cells,
                                          c0, len, n_new, pos0, 100, qn, kn, 1e-6f, n_kv, g, d,
                                          0.125f, sinks, out, work, wf));
        emit(name, out, sizeof(uint16_t) * (size_t)(T * n_kv * g * d));
        snprintf(name, sizeof name, "stored by attn_step t%d g%d", t, g);
        emit(name, k, (size_t)(n_kv * stride));
        emit(name, v, (size_t)(n_kv * stride));
        snprintf(name, sizeof name, "attn_head_norm g%d", g);
        emit_rc(name, attn_head_norm_bf16(qkv, width, T, n_kv * g, d, qn, 1e-6f, out));
        emit(name, out, sizeof(uint16_t) * (size_t)(T * n_kv * g * d));
        free(k), free(v), free(k16), free(v16), free(list), free(q), free(out), free(work);
        free(qkv), free(cs);
        free(sn), free(qn), free(kn), free(sinks);
    }
}

static void rowwise(void) {
    const int64_t rows = 20, d = 96, ff = 200;
    float *x = f32s(rows * d, -2.f, 2.f), *w = f32s(d, 0.5f, 1.5f), *wn = f32s(d, 0.5f, 1.5f);
    uint16_t *y = bf16s(rows * d, 2.f), *out = alloc(sizeof(uint16_t) * (size_t)(rows * ff));
    add_rms_norm_bf16(x, d, y, w, rows, (int)d, 1e-6f, out);
    emit("add_rms_norm", x, sizeof(float) * (size_t)(rows * d));
    emit("add_rms_norm", out, sizeof(uint16_t) * (size_t)(rows * d));
    post_norm_add_bf16(x, d, y, w, wn, rows, (int)d, 1e-6f, out);
    emit("post_norm_add", x, sizeof(float) * (size_t)(rows * d));
    emit("post_norm_add", out, sizeof(uint16_t) * (size_t)(rows * d));
    uint16_t *gu = bf16s(rows * 2 * ff, 6.f);
    silu_mul_bf16(gu, rows, ff, out);
    emit("silu_mul", out, sizeof(uint16_t) * (size_t)(rows * ff));
    gelu_mul_bf16(gu, rows, ff, out);
    emit("gelu_mul", out, sizeof(uint16_t) * (size_t)(rows * ff));
    swiglu_oai_bf16(gu, rows, ff, out);
    emit("swiglu_oai", out, sizeof(uint16_t) * (size_t)(rows * ff));
    free(x), free(w), free(wn), free(y), free(out), free(gu);
}
/* The tiles with 8-bit activations, each format (i8act.c: 0 4-bit, f16 scales and offsets;
 * 1-3 8-bit, f32 scales, offsets in 3; 4 MXFP4's 4-bit codes, f32 scales; 5-8 the file's
 * Q8_0, MXFP4, Q4_K and Q6_K rows): random code bytes, valid scales, 3 tiles of 7 groups
 * (the K-quants: of 16). */
static void tiles(void) {
    const int64_t n = 48, k = 224, rows[] = {1, 3, 5, 9, 130}, blocks = n / 16 * (k / 32);
    const int64_t size[] = {320, 576, 640, 640, 320};
    char name[64];
    for (int f = 0; f < 5; f++) {
        uint8_t *w = alloc((size_t)(blocks * size[f]));
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *p = w + b * size[f];
            int64_t codes = f == 1 || f == 2 || f == 3 ? 512 : 256;
            for (int64_t i = 0; i < codes; i++) p[i] = (uint8_t)next();
            for (int64_t i = codes; i < size[f]; i += f ? 4 : 2) {
                float v = unif() * 0.05f;
                if (f) memcpy(p + i, &v, 4);
                else put16(p + i, half());
            }
        }
        for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri++) {
            uint16_t *x = bf16s(rows[ri] * k, 2.f);
            uint16_t *y = alloc(sizeof(uint16_t) * (size_t)(rows[ri] * n));
            snprintf(name, sizeof name, "i8a_matmul f%d rows%d", f, (int)rows[ri]);
            emit_rc(name, i8a_matmul(f, w, x, rows[ri], n, k, y));
            emit(name, y, sizeof(uint16_t) * (size_t)(rows[ri] * n));
            free(x), free(y);
        }
        free(w);
    }
    /* the file's own rows, rows 0-15 from one buffer and 16-47 from another: 5 Q8_0 (an f16
     * scale and 32 codes), 6 MXFP4 (an E8M0 byte near 2^0 and 16 code bytes), 7 Q4_K (144 bytes
     * a super-block of 256: f16 d and dmin, scales, codes), 8 Q6_K (210 bytes: codes, int8
     * scales, f16 d last; the K-quants two super-blocks a row) */
    for (int f = 5; f < 9; f++) {
        const int64_t per = f < 7 ? 32 : 256, kf = f < 7 ? k : 512;
        const int64_t bb = f == 5 ? 34 : f == 6 ? 17 : f == 7 ? 144 : 210, rb = kf / per * bb;
        uint8_t *w = alloc((size_t)(n * rb));
        for (int64_t b = 0; b < n * (kf / per); b++) {
            uint8_t *p = w + b * bb;
            for (int64_t i = 0; i < bb; i++) p[i] = (uint8_t)next();
            if (f == 5) put16(p, half());
            else if (f == 6) p[0] = (uint8_t)(122 + next() % 8);
            else if (f == 7) put16(p, half()), put16(p + 2, half());
            else put16(p + 208, half());
        }
        uint8_t *w1 = alloc((size_t)((n - 16) * rb));
        memcpy(w1, w + 16 * rb, (size_t)((n - 16) * rb));
        for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri++) {
            uint16_t *x = bf16s(rows[ri] * kf, 2.f);
            uint16_t *y = alloc(sizeof(uint16_t) * (size_t)(rows[ri] * n));
            snprintf(name, sizeof name, "i8a_matmul_rows f%d rows%d", f, (int)rows[ri]);
            emit_rc(name, i8a_matmul_rows(f, 16, rb, w1, w, x, rows[ri], n, kf, y));
            emit(name, y, sizeof(uint16_t) * (size_t)(rows[ri] * n));
            free(x), free(y);
        }
        free(w), free(w1);
    }
}

/* 20 tokens (the threaded path) of width 96, kernel length 3, over 40 cells: each token's
 * row into its own cell, each output reading earlier cells, the step's own ones, or none (-1) */
static void short_conv(void) {
    const int64_t T = 20, e = 96, L = 3, n_cells = 40;
    uint16_t *bcx = bf16s(T * 3 * e, 3.f), *ck = bf16s(n_cells * e / 2, 2.f);
    uint16_t *cv = bf16s(n_cells * e / 2, 2.f), *out = alloc(sizeof(uint16_t) * (size_t)(T * e));
    float *w = f32s(e * L, -1.f, 1.f);
    int64_t *cells = alloc(sizeof(int64_t) * (size_t)T), *reads = alloc(sizeof(int64_t) * (size_t)(T * L));
    for (int64_t t = 0; t < T; t++) cells[t] = n_cells - T + t;
    for (int64_t i = 0; i < T * L; i++) reads[i] = (int64_t)(next() % (n_cells + 1)) - 1;
    short_conv_bf16(bcx, T, (int)e, (int)L, ck, cv, cells, reads, w, out);
    emit("short_conv", out, sizeof(uint16_t) * (size_t)(T * e));
    emit("short_conv", ck, sizeof(uint16_t) * (size_t)(n_cells * e / 2));
    emit("short_conv", cv, sizeof(uint16_t) * (size_t)(n_cells * e / 2));
    free(bcx), free(ck), free(cv), free(out), free(w), free(cells), free(reads);
}

int main(void) {
    int64_t avail = bf16_gemm_available() * 10 + int8_head_available();
    emit("available bf16_gemm int8_head", &avail, 8);
    qmm();
    head();
    attention();
    rowwise();
    short_conv();
    tiles(); /* last: the earlier kernels' inputs stay the stream's first values */
    return fflush(stdout) != 0;
}
