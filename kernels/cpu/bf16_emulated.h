/*
 * FOR TESTS ONLY: the two AVX512-BF16 instructions paged_attention.c's bf16 paths use
 * (vdpbf16ps, vcvtneps2bf16), written with AVX-512F/BW instructions, so that a machine without
 * AVX512-BF16 can run those paths' logic (decode_parts.h's bf16 branches, pv_pairs' pairing and
 * unpermute, prefill_bf16.h) in its tests. Included by paged_attention.c only when it is built
 * with -DPDSERVE_EMULATE_AVX512BF16 (tests/kernels/test_kernels_cpu.py); never in a library
 * the engine loads. The arithmetic matches the instructions up to the order of the two products'
 * roundings (vdpbf16ps' own order is not specified to the bit either), and denormals are kept
 * (the instructions flush them).
 */
#ifndef PDSERVE_BF16_EMULATED_H
#define PDSERVE_BF16_EMULATED_H

/* acc + a[2i] * b[2i] + a[2i+1] * b[2i+1] in each fp32 lane i (bf16 is fp32's top half). */
static inline __m512 emulated_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u), ai = (__m512i)a, bi = (__m512i)b;
    const __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(ai, 16));
    const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(bi, 16));
    const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(ai, hi));
    const __m512 b1 = _mm512_castsi512_ps(_mm512_and_si512(bi, hi));
    return _mm512_fmadd_ps(a1, b1, _mm512_fmadd_ps(a0, b0, acc));
}

/* 16 fp32 -> 16 bf16, round to nearest even; NaN stays NaN (quiet). */
static inline __m256bh emulated_cvtneps_pbh(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return (__m256bh)_mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

#define _mm512_dpbf16_ps(acc, a, b) emulated_dpbf16_ps(acc, a, b)
#define _mm512_cvtneps_pbh(x) emulated_cvtneps_pbh(x)

#endif /* PDSERVE_BF16_EMULATED_H */
