/*
 * Eight fp32 lanes in GNU C vector extensions (AVX registers where there are, NEON or SSE pairs
 * elsewhere), for the kernels that include it: the vector types, a lane-wise select, bf16 -> fp32
 * widening, and exp's core — Cephes expf's range reduction and polynomial, exp(x) = 2^n e^r with
 * |r| <= ln2/2 (~1 ulp). The includer clamps x before and scales by 2^n after, each its own way;
 * products and sums fuse or not as the includer compiles (fused.c: fp-contract off, so its lanes
 * equal its scalar operations bit for bit).
 */
#ifndef PDSERVE_VEC8_H
#define PDSERVE_VEC8_H

#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h_u __attribute__((vector_size(16), aligned(2), may_alias));
/* Unaligned, aliasing-safe vector access (memcpy here gets merged into byte-copy loops). */
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline v8f select8(v8i mask, v8f a, v8f b) { /* mask ? a : b, lane by lane */
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* Eight bf16 values from p as fp32 (bf16 is the top half of an fp32). */
static inline v8f widen_bf16_8(const uint16_t *p) {
#if defined(__AVX2__) /* gcc splits __builtin_convertvector into 128-bit halves */
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (v8f)_mm256_slli_epi32(h, 16);
#else
    return (v8f)(__builtin_convertvector(*(const v8h_u *)p, v8u) << 16);
#endif
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
