/* KV cache types (radixserve/memory/pool/kv_types.py): one head's K or V row of one token as the pool
 * stores it, in llama.cpp's layouts (bf16 / f16 / f32 values, or ggml's block_q8_0 /
 * block_q4_0: an f16 scale, then 32 int8 values or 16 bytes of nibble pairs). Reading a row as
 * bf16 (kv_load_bf16) is inline here, for attention; storing one (kv_store_row) is kv_rows.c's,
 * compiled without contraction so its roundings are ggml's reference ones. */
#ifndef RADIXSERVE_KV_ROWS_H
#define RADIXSERVE_KV_ROWS_H
#include <stdint.h>
#include <string.h>

#include "common.h"

enum { KV_BF16 = 0, KV_F16 = 1, KV_F32 = 2, KV_Q8_0 = 3, KV_Q4_0 = 4, KV_N_TYPES = 5 };

static inline float f16_to_f32(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* bytes of one row of d values (0: unknown type, or d not whole blocks) */
static inline int64_t kv_row_bytes(int type, int d) {
    switch (type) {
    case KV_BF16: case KV_F16: return 2 * (int64_t)d;
    case KV_F32: return 4 * (int64_t)d;
    case KV_Q8_0: return d % 32 ? 0 : (int64_t)d / 32 * 34;
    case KV_Q4_0: return d % 32 ? 0 : (int64_t)d / 32 * 18;
    default: return 0;
    }
}

/* f32_to_bf16 without a branch (so the loops below vectorize): round to nearest even, a NaN
 * kept quiet, the same bits */
static inline uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : r);
}

/* A stored row -> its d values in bf16: each value in f32 (value times block scale, one exact
 * product: 11-bit scale times a small integer, as gguf-py's dequantize), rounded to nearest
 * even: what attention reads (csrc/decode_attn.c converts the rows of other types so). Inline:
 * out of line (in kv_rows.c's strict build) a prefill's conversion cost 10% of its speed. */
static inline void kv_load_bf16(int type, const uint8_t *src, int d, uint16_t *dst) {
    switch (type) {
    case KV_BF16:
        memcpy(dst, src, (size_t)d * 2);
        return;
    case KV_F16:
        for (int x = 0; x < d; x++) dst[x] = bf16_rne(f16_to_f32(src + 2 * x));
        return;
    case KV_F32:
        for (int x = 0; x < d; x++) {
            float f;
            memcpy(&f, src + 4 * x, 4);
            dst[x] = bf16_rne(f);
        }
        return;
    case KV_Q8_0:
        for (int b = 0; b < d / 32; b++, src += 34, dst += 32) {
            float s = f16_to_f32(src);
            const int8_t *q = (const int8_t *)(src + 2);
            for (int j = 0; j < 32; j++) dst[j] = bf16_rne((float)q[j] * s);
        }
        return;
    default: /* KV_Q4_0 */
        for (int b = 0; b < d / 32; b++, src += 18, dst += 32) {
            float s = f16_to_f32(src);
            const uint8_t *q = src + 2;
            for (int j = 0; j < 16; j++) {
                dst[j] = bf16_rne((float)((int)(q[j] & 15) - 8) * s);
                dst[j + 16] = bf16_rne((float)((int)(q[j] >> 4) - 8) * s);
            }
        }
        return;
    }
}

/* d bf16 values -> one stored row of `type` (kv_rows.c) */
void kv_store_row(int type, const uint16_t *x, int d, uint8_t *dst);

#endif
