/*
 * exp's core on eight fp32 lanes (GNU C vector extensions: AVX registers where there are, NEON or
 * SSE pairs elsewhere), for the kernels that include it: Cephes expf's range reduction and
 * polynomial, exp(x) = 2^n e^r with |r| <= ln2/2 (~1 ulp). The includer clamps x before and
 * scales by 2^n after, each its own way; products and sums fuse or not as the includer compiles
 * (fused.c: fp-contract off, so its lanes equal its scalar operations bit for bit).
 */
#ifndef PDSERVE_EXP8_H
#define PDSERVE_EXP8_H

#include <stdint.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
/* Unaligned, aliasing-safe vector access (memcpy here gets merged into byte-copy loops). */
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline v8f select8(v8i mask, v8f a, v8f b) { /* mask ? a : b, lane by lane */
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* e^r where x = n ln2 + r (x clamped by the caller to where 2^n is finite); n into *n_out. */
static inline v8f exp8_reduced(v8f x, v8f *n_out) {
    const v8f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    v8f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8f p = splat8(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    *n_out = n;
    return p * r * r + r + 1.0f;
}

#endif
