/* Vectorisable math shared by the CPU kernels (included, not compiled alone). */
#ifndef KVSKILL_VEC_MATH_H
#define KVSKILL_VEC_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0, branch-free so that a loop over it vectorises (libm's expf is a call per
 * element, which cost more than the rest of the kernel). exp(x) = 2^k exp(r) with
 * k = rint(x / ln 2) and |r| <= ln(2) / 2, r computed in two parts (Cody-Waite), exp(r) by its
 * Taylor series to degree 7 (truncation error < 6e-9). Largest relative error against libm's
 * expf over [-87, 0]: 1.2e-7 (two fp32 ulps). Below -87 the result is exp(-87) ~ 1.6e-38,
 * which adds nothing to a softmax that holds a 1 (its maximum). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float kf = rintf(x * 1.44269504089f);
    float r = x - kf * 0.693145751953125f - kf * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* 2^k from k's bits: adding 1.5 * 2^23 puts the integer k in the low mantissa bits (a bit
     * copy, which vectorises where a float-to-int conversion under a clamp does not). */
    float shifted = kf + 12582912.0f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    bits = (bits - 0x4B400000 + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

/* x . y with sixteen lane-wise partial sums: two vector registers, i.e. two independent
 * chains of multiply-adds, so the loop vectorises (without letting the compiler reassociate
 * sums on its own) and does not wait on one chain's latency. */
static inline float dot(const float *restrict x, const float *restrict y, int64_t n) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += x[i + j] * y[i + j];
    for (int j = 0; j < 8; j++) part[j] += part[j + 8];
    for (int j = 0; j < 4; j++) part[j] += part[j + 4];
    float s = (part[0] + part[2]) + (part[1] + part[3]);
    for (; i < n; i++) s += x[i] * y[i];
    return s;
}

#endif
