/* Storing K/V rows in the pool's cache type (kv_rows.h): ggml's reference quantizers
 * (quantize_row_q8_0_ref, quantize_row_q4_0_ref), so the bytes are llama.cpp's and equal
 * radixserve/memory/pool/kv_types.py's torch ones (tests/model/test_kv_types.py). Compiled with
 * -ffp-contract=off (kernels.py): q4_0's x * id + 8.5 is two roundings there, and a fused
 * multiply-add would move a value across a nibble boundary now and then. */
#include <math.h>

#include "kv_rows.h"

static void put_f16(uint8_t *p, float f) {
    _Float16 h = (_Float16)f; /* round to nearest even, as torch's and numpy's */
    memcpy(p, &h, 2);
}

static void q8_0_row(const float *x, int d, uint8_t *y) {
    for (int b = 0; b < d / 32; b++, x += 32, y += 34) {
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        float s = amax / 127.f, id = s != 0.f ? 1.f / s : 0.f;
        put_f16(y, s);
        for (int j = 0; j < 32; j++) ((int8_t *)(y + 2))[j] = (int8_t)roundf(x[j] * id);
    }
}

static void q4_0_row(const float *x, int d, uint8_t *y) {
    for (int b = 0; b < d / 32; b++, x += 32, y += 18) {
        float amax = 0.f, max = 0.f; /* the first value of largest magnitude, with its sign */
        for (int j = 0; j < 32; j++)
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        float s = max / -8.f, id = s != 0.f ? 1.f / s : 0.f;
        put_f16(y, s);
        for (int j = 0; j < 16; j++) {
            int a = (int)(x[j] * id + 8.5f), c = (int)(x[j + 16] * id + 8.5f);
            a = a > 15 ? 15 : a;
            c = c > 15 ? 15 : c;
            y[2 + j] = (uint8_t)(a | (c << 4));
        }
    }
}

void kv_store_row(int type, const uint16_t *x, int d, uint8_t *dst) {
    float f[256];
    switch (type) {
    case KV_BF16:
        memcpy(dst, x, (size_t)d * 2);
        return;
    case KV_F16:
        for (int i = 0; i < d; i++) put_f16(dst + 2 * i, bf16_to_f32(x[i]));
        return;
    case KV_F32:
        for (int i = 0; i < d; i++) f[i] = bf16_to_f32(x[i]);
        memcpy(dst, f, (size_t)d * sizeof(float));
        return;
    default:
        for (int i = 0; i < d; i++) f[i] = bf16_to_f32(x[i]);
        if (type == KV_Q8_0)
            q8_0_row(f, d, dst);
        else
            q4_0_row(f, d, dst);
    }
}

/* rows bf16 rows of d values -> out, rows stored rows of `type` back to back: the store of a
 * step, for the tests to compare with the torch quantizers. Returns -1 for an unknown type, d
 * outside [1, 256] or not whole blocks. */
int kv_store_rows_bf16(int type, const uint16_t *x, int64_t rows, int d, uint8_t *out) {
    int64_t rb = kv_row_bytes(type, d);
    if (rb == 0 || d < 1 || d > 256) return -1;
    for (int64_t r = 0; r < rows; r++) kv_store_row(type, x + r * d, d, out + r * rb);
    return 0;
}
