/*
 * quant.c's direct path (few rows of x, decode): included by quant.c after its vector macros
 * (V, VL, NV, MRD, RN) and raw_block; not a header of its own to use elsewhere.
 *
 * Per weight row, the block scales are converted SG blocks at a time into fp32 arrays (not one
 * scalar f16 conversion per block, which costs more than the block's arithmetic), each block's
 * quants are widened in registers and multiplied with x, and the block's sum is scaled by d;
 * Q4_1's m times the block's sum of x is added SG blocks per vector operation. With one row of x,
 * RN weight rows run side by side (independent work, x loaded once per block for all of them).
 */
#define U 4     /* blocks in flight per row of x in the direct path (one accumulator each) */
#define PF 8192 /* bytes ahead of the weights' reads that the direct path prefetches */
#define SG 16   /* blocks per group whose scales the direct path converts at once */
#define XS_STRIDE(nb) (((nb) + SG - 1) / SG * SG) /* floats per row of x's block sums */

static inline int32_t load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The scales d (and for Q4_1 m) of the n <= SG blocks from blk as fp32 into d[0 .. SG-1] (m),
 * zero past n: each block's first 4 bytes (d, then m or the first quants) gathered into a vector
 * and converted VL at a time; halves staged through memory instead stall on store forwarding. */
ALWAYS void group_scales(int qt, const uint8_t *blk, int64_t bb, int n, float *d, float *m) {
#if QISA == 512
    __m512i g;
    if (qt == Q4_1) { /* 16 blocks are 5 vectors, d and m of block j their dword 5j: permuted
                         together (masked loads: nothing read past block n) */
        __m512i v[5];
        for (int i = 0; i < 5; i++) {
            const int left = 5 * n - 16 * i;
            v[i] = _mm512_maskz_loadu_epi32(left >= 16  ? 0xffff
                                            : left <= 0 ? 0
                                                        : (__mmask16)((1u << left) - 1),
                                            blk + 64 * i);
        }
        const __m512i a = _mm512_permutex2var_epi32(
            v[0], _mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0), v[1]);
        const __m512i b = _mm512_permutex2var_epi32(
            v[2], _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 3, 8, 13, 18, 23, 28, 0, 0, 0), v[3]);
        const __m512i c = _mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 6, 11), v[4]);
        g = _mm512_mask_blend_epi32(0xe000, _mm512_mask_blend_epi32(0x1f80, a, b), c);
    } else { /* each block's first dword gathered */
        const __m512i at = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32((int)bb));
        g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << n) - 1), at, blk,
                                        1);
    }
    if (qt == Q4_1) { /* the d halves to the low 256 bits, the m halves to the high */
        const __m512i h = _mm512_permutexvar_epi16(
            _mm512_setr_epi32(0x20000, 0x60004, 0xa0008, 0xe000c, 0x120010, 0x160014, 0x1a0018,
                              0x1e001c, 0x30001, 0x70005, 0xb0009, 0xf000d, 0x130011, 0x170015,
                              0x1b0019, 0x1f001d),
            g);
        _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
        _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
    } else {
        _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
    }
#elif QISA == 256
    for (int j0 = 0; j0 < SG; j0 += 8) {
        __m128i v[2]; /* built in registers: an array stored and loaded whole stalls */
        for (int i = 0; i < 2; i++) {
            const uint8_t *b = blk + (j0 + 4 * i) * bb;
            const int left = n - j0 - 4 * i;
            v[i] = left >= 4
                       ? _mm_setr_epi32(load32(b), load32(b + bb), load32(b + 2 * bb),
                                        load32(b + 3 * bb))
                       : _mm_setr_epi32(left > 0 ? load32(b) : 0, left > 1 ? load32(b + bb) : 0,
                                        left > 2 ? load32(b + 2 * bb) : 0, 0);
        }
        const __m256i g = _mm256_setr_m128i(v[0], v[1]);
        for (int i = 0; i < (qt == Q4_1 ? 2 : 1); i++) {
            const __m256i h =
                i ? _mm256_srli_epi32(g, 16) : _mm256_and_si256(g, _mm256_set1_epi32(0xffff));
            const __m128i p =
                _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            _mm256_storeu_ps((i ? m : d) + j0, _mm256_cvtph_ps(p));
        }
    }
#else
    for (int j = 0; j < SG; j++) {
        d[j] = j < n ? f16_to_f32(blk + j * bb) : 0.0f;
        if (qt == Q4_1) m[j] = j < n ? f16_to_f32(blk + j * bb + 2) : 0.0f;
    }
#endif
}

/* acc[c][u] += the block's dot product with rows c < mr of x: the unscaled quants multiplied
 * with x in registers, their sum scaled by d once (I8: the row's scale comes at the end). */
ALWAYS void direct_block(int qt, const uint8_t *blk, float d, const float *x, int64_t K, int64_t b,
                         int mr, int u, V acc[MRD][U]) {
    V q[NV];
    raw_block(qt, blk, q);
    const V dv = vset1(d);
    for (int c = 0; c < mr; c++) {
        const float *xb = x + c * K + b * QK;
        V p = vmul(q[0], vload(xb));
        for (int j = 1; j < NV; j++) p = vfma(q[j], vload(xb + j * VL), p);
        acc[c][u] = qt == I8 ? vadd(p, acc[c][u]) : vfma(p, dv, acc[c][u]);
    }
}

/* out[r * mr + c] = x[c] . dequant(weight row r) for r < nr, c < mr (weight rows row_bytes
 * apart, rs[r] their I8 scales; x rows of stride K; xs: their block sums, Q4_1, rows of
 * XS_STRIDE floats, zero past the last block). The nr weight rows go through the blocks side by
 * side (independent work for the out-of-order core, x loaded once per block for all of them)
 * with U / nr blocks in flight each. Q4_1's m times the block's sum of x goes into macc, SG
 * blocks per vector operation. */
ALWAYS void direct_rows(int qt, int64_t bb, const uint8_t *row, int64_t row_bytes, int nr,
                        const float *rs, const float *x, const float *xs, int64_t K, int mr,
                        float *out) {
    const int64_t nb = K / QK;
    const int ue = U / nr;
    V acc[RN][MRD][U], macc[RN][MRD];
    float d[RN][SG], m[RN][SG];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < mr; c++) {
            macc[r][c] = vzero();
            for (int u = 0; u < ue; u++) acc[r][c][u] = vzero();
        }
    for (int64_t g = 0; g < nb; g += SG) {
        const int n = nb - g < SG ? (int)(nb - g) : SG;
        for (int r = 0; r < nr; r++) {
            if (qt != I8) group_scales(qt, row + r * row_bytes + g * bb, bb, n, d[r], m[r]);
            for (int c = 0; c < (qt == Q4_1 ? mr : 0); c++)
                for (int j = 0; j < SG; j += VL)
                    macc[r][c] =
                        vfma(vload(m[r] + j), vload(xs + c * XS_STRIDE(nb) + g + j), macc[r][c]);
        }
        int j = 0;
        for (; j + ue <= n; j += ue)
            for (int u = 0; u < ue; u++)
                for (int r = 0; r < nr; r++) {
#if QISA
                    /* one row of x into L2 (a Q8_0 lm_head, cold, AVX2 build, 2 threads, a
                     * Zen 4: 0.76x T0's time), more into L1 (2 rows: T1 1.14x) */
                    const char *ahead = (const char *)(row + r * row_bytes + (g + j + u) * bb) + PF;
                    if (mr == 1)
                        _mm_prefetch(ahead, _MM_HINT_T1);
                    else
                        _mm_prefetch(ahead, _MM_HINT_T0);
#endif
                    direct_block(qt, row + r * row_bytes + (g + j + u) * bb,
                                 qt == I8 ? 1.0f : d[r][j + u], x, K, g + j + u, mr, u, acc[r]);
                }
        for (; j < n; j++)
            for (int r = 0; r < nr; r++)
                direct_block(qt, row + r * row_bytes + (g + j) * bb, qt == I8 ? 1.0f : d[r][j], x,
                             K, g + j, mr, 0, acc[r]);
    }
    V a[RN * MRD];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < mr; c++) {
            a[r * mr + c] = qt == Q4_1 ? vadd(acc[r][c][0], macc[r][c]) : acc[r][c][0];
            for (int u = 1; u < ue; u++) a[r * mr + c] = vadd(a[r * mr + c], acc[r][c][u]);
        }
#if QISA == 512
    if (nr * mr == 4) { /* the four sums reduced side by side */
        const __m512 s01 =
            _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
        const __m512 s23 =
            _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
        const __m512 s =
            _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xee));
        const __m256 h =
            _mm256_add_ps(_mm512_castps512_ps256(s),
                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    } else
#endif
        for (int i = 0; i < nr * mr; i++) out[i] = vhsum(a[i]);
    for (int i = 0; qt == I8 && i < nr * mr; i++) out[i] *= rs[i / mr];
}
