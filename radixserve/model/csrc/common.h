/* Shared by the kernels in this directory: bf16 conversions with torch's rounding, and an
 * exp that vectorizes. Header-only (static inline): each kernel is one translation unit. */
#ifndef RADIXSERVE_COMMON_H
#define RADIXSERVE_COMMON_H
#include <stdint.h>
#include <string.h>

/* The neon variant (kernels.py: -march=armv8.2-a+dotprod): NEON intrinsics where a kernel
 * has them (qmm's integer dot products, the head's int8 pass on sdot, attention's dot products).
 * The generic build on aarch64 (no +dotprod) runs the plain C, which the tests compare it with
 * under qemu-user (tests/model/test_neon.py). */
#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define RS_NEON 1
#include <arm_neon.h>
#endif

/* a b + c rounded once where the CPU fuses (x86's FMA builds, every aarch64 build), so the
 * compiler has no contraction left to choose; twice on the generic x86 build (no FMA). */
static inline float fma1(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to() */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* e^x on [-87, 88] (clamped): 2^(x log2 e) as integer and fraction, degree-6 polynomial for
 * 2^f; relative error < 6e-6, far below bf16's 4e-3; vectorizes, unlike libm's expf. */
static inline float exp_clamped(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    float t = x * 1.44269504088896341f;
    float n = __builtin_floorf(t);
    float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

#endif
