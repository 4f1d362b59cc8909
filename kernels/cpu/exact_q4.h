/*
 * Q4_1 weights of a bf16 model multiplied on their exact values, for the rows of generated tokens
 * (decode; included by packed_q4.h, whose qt QP_Q4_1X it is, pdserve_linear_hybrid_rows). A
 * prompt's rows keep the bf16 rounding of the weights (packed_q4.h), whose prefill runs on the
 * packed bf16 kernel near the vdpbf16ps peak: this arithmetic's fold, two FMAs per 16 vdpbf16ps,
 * made prefill 0.89x where every row took it (with a copy for many rows; 2026-11-30, a Zen 4).
 * Each kind's outputs are the same bits whatever else a step batches.
 *
 * The arithmetic. A Q4_1 weight is d q + m (q = 0..15, d and m fp16). 128 + q is exact in bf16,
 * and its bits are 0x4300 | q, so a nibble becomes a bf16 weight in one shift and one
 * vpternlogd, where the bf16 rounding of d q + m (packed_q4.h) costs two lookups, two FMAs and a
 * conversion. Per output n, row of x r and block b of 32 k:
 *
 *   S     = vdpbf16ps chain over the block's 16 pairs of k, in order, from 0: sum (128 + q) x
 *   X     = the block's sum of x (q4x_sums: one fixed order, once per row and block)
 *   acc   = fma(m - 128 d, X, fma(S, d, acc))                     acc from 0, b in order
 *   y     = bf16(acc + bias)                                      (bias 0 if none)
 *
 * Every product is exact (8 by 8 significant bits), so the only roundings are the chain's sums,
 * the two FMAs per block and the last conversion: the weights are exact, not their bf16
 * rounding. The 128 adds 128 X to S and the m - 128 d term takes it off again: S is larger than
 * sum q x by up to ~16x, which costs ~4 bits of its 24, far under the output's bf16 rounding.
 *
 * Few rows (pdserve_pack_blocks' QP_Q4_1X, 320 bytes per group of 16 outputs and block, as packed_q4.h's
 * Q4_1 layout, pdserve_qp_bytes): [0, 32) d, [32, 64) m of the group's 16 outputs (fp16), then
 * 4 runs of 64 bytes, run c for the pairs p = 4 c .. 4 c + 3: 32 words, word 2 i + h holding in
 * its nibble j the q of output 16 g + i at k = 2 (4 c + j) + h. Shifted right by 4 j and masked,
 * the run is the register of bf16 pairs (w[n][2p], w[n][2p + 1]) for the group's 16 outputs.
 *
 * On a 2-core Zen 4 (docs/architecture.md) one row ran 0.73x the bf16-rounded block kernel's
 * step: a third of its instructions, memory-bound with its prefetches into L2.
 */
#define Q4X_AHEAD 8     /* blocks prefetched ahead in each group (into L2: T0 ran at 0.6x) */
#define Q4X_RUN 128     /* rows of x per call at most (their block sums live on the stack) */
/* Nibble p of each 16-bit word of a run as the bf16 weight 128 + q: (run >> 4p) & 0xf | 0x4300.
 * The top nibble, for one row of x where there is vpshldw (AVX512-VBMI2: Zen 4 and 5, Ice Lake
 * and later; not Cooper Lake), in one instruction whose shift brings in no other bits, 0x0430 << 4
 * | run >> 12: the same bits. On a Zen 4 a one-row tile (4 groups) took 0.91-0.94x the time, from
 * cache or memory, where the unpacking sets the pace; 2 rows 1.01x; from 4 rows, where the
 * vdpbf16ps chains do, 1.03-1.06x (vpshldw competes with them). */
static inline __attribute__((always_inline)) __m512bh q4x_weights(__m512i run, int p, int mr) {
#ifdef __AVX512VBMI2__
    if (p == 3 && mr == 1)
        return (__m512bh)_mm512_shldi_epi16(_mm512_set1_epi16(0x0430), run, 4);
#endif
    return (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(run, 4 * p),
                                               _mm512_set1_epi16(0x000f),
                                               _mm512_set1_epi16(0x4300), 0xEA);
}

/* xs[b] = sum of x[32 b .. 32 b + 31] (bf16), b < K / 32, in one fixed order. */
static inline void q4x_sums(const uint16_t *x, int64_t K, float *xs) {
    for (int64_t b = 0; b < K / 32; b++) {
        const __m256i *p = (const __m256i *)(x + 32 * b);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p + 1));
        xs[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                                   _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
    }
}

/* The outputs of a tile, groups g .. g + ng - 1 and rows 0 .. mr-1 (this kernel's and
 * packed_q4.h's qp_tile): y[r][16 (g + j) + i] = bf16(acc[j][r] + bias), masked past N; the bias
 * (or 0) is added to every output, so that -0 sums alike in every kernel. */
static inline __attribute__((always_inline)) void q4_tile_store(__m512 acc[Q4NG][Q4MR], int64_t g,
                                                                 int ng, int mr,
                                                                 const uint16_t *bias,
                                                                 uint16_t *y, int64_t N) {
    UNROLL for (int j = 0; j < Q4NG; j++) {
        if (j >= ng) break;
        const int64_t n0 = (g + j) * Q4G, rem = N - n0;
        const __mmask16 mask = rem >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1);
        __m512 bv = _mm512_setzero_ps();
        if (bias)
            bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16));
        UNROLL for (int r = 0; r < Q4MR; r++) {
            if (r >= mr) break;
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j][r], bv));
            _mm256_mask_storeu_epi16(y + r * N + n0, mask, out);
        }
    }
}

/* A block's d and m - 128 d for 16 outputs, from their fp16 d at dm and m at dm + 32. */
#define Q4X_SCALES(d, mp, dm)                                                                      \
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm)));                 \
    const __m512 mp = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f),                                 \
                                       _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((dm) + 32))))

/* One block into an accumulator: fma(m - 128 d, X, fma(S, d, acc)). */
static inline __m512 q4x_fold(__m512 acc, __m512 s, __m512 d, __m512 mp, float xsum) {
    return _mm512_fmadd_ps(mp, _mm512_set1_ps(xsum), _mm512_fmadd_ps(s, d, acc));
}

/* Few rows: rows 0 .. mr-1 of x (block sums xs) against groups g .. g + ng - 1. */
static inline __attribute__((always_inline)) void q4x_tile(const uint16_t *x, const float *xs,
                                                            int64_t K, const uint8_t *w, int64_t g,
                                                            int ng, int mr, const uint16_t *bias,
                                                            uint16_t *y, int64_t N) {
    const int64_t kbs = K / 32, group_bytes = kbs * Q4GB;
    __m512 acc[Q4NG][Q4MR];
    UNROLL for (int j = 0; j < Q4NG; j++)
        UNROLL for (int r = 0; r < Q4MR; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        const uint8_t *b[Q4NG];
        __m512 s[Q4NG][Q4MR];
        UNROLL for (int j = 0; j < Q4NG; j++) {
            if (j >= ng) break;
            b[j] = w + (g + j) * group_bytes + kb * Q4GB;
            const int64_t ahead = kb + Q4X_AHEAD; /* past the group's end: the next tile's */
            const uint8_t *pf = ahead < kbs ? b[j] + Q4X_AHEAD * Q4GB
                                            : w + (g + j + ng) * group_bytes + (ahead - kbs) * Q4GB;
            for (int c = 0; c < Q4GB; c += 64) _mm_prefetch((const char *)pf + c, _MM_HINT_T1);
            UNROLL for (int r = 0; r < Q4MR; r++) s[j][r] = _mm512_setzero_ps();
        }
        UNROLL for (int c = 0; c < 4; c++)
            UNROLL for (int j = 0; j < Q4NG; j++) {
                if (j >= ng) break;
                const __m512i run = _mm512_loadu_si512((const void *)(b[j] + 64 + 64 * c));
                UNROLL for (int p = 0; p < 4; p++) {
                    const int64_t k = kb * 32 + 2 * (4 * c + p);
                    const __m512bh wv = q4x_weights(run, p, mr);
                    UNROLL for (int r = 0; r < Q4MR; r++) {
                        if (r >= mr) break;
                        int32_t pair;
                        memcpy(&pair, x + r * K + k, sizeof pair);
                        s[j][r] = _mm512_dpbf16_ps(s[j][r], (__m512bh)_mm512_set1_epi32(pair), wv);
                    }
                }
            }
        UNROLL for (int j = 0; j < Q4NG; j++) {
            if (j >= ng) break;
            Q4X_SCALES(d, mp, b[j]);
            UNROLL for (int r = 0; r < Q4MR; r++) {
                if (r >= mr) break;
                acc[j][r] = q4x_fold(acc[j][r], s[j][r], d, mp, xs[r * kbs + kb]);
            }
        }
    }
    q4_tile_store(acc, g, ng, mr, bias, y, N);
}
