/*
 * Q4_1 weights multiplied as bf16 (included by linear.c where the CPU has AVX512-BF16): the
 * same arithmetic as pdserve_linear_packed on the bf16 rounding of the dequantized weight, so
 * the two give bit-identical outputs, while this one reads the 4-bit blocks (20 bytes per 32
 * weights, as GGUF stores them) instead of 64 bytes of bf16.
 *
 * Why: a bf16 model whose weights came as Q4_1 (the default model) streams its projections per
 * decode step as bf16 through the packed kernel. With few rows of x that step is the speed of
 * memory, and 4-bit blocks are 3.2x fewer bytes. With many rows the packed kernel is compute
 * bound and quicker (no unpacking), so pdserve_linear_hybrid picks by the number of rows; the
 * results cannot depend on that choice, because every output is the same chain of vdpbf16ps
 * over the same bf16 pairs, k in order, from 0.
 *
 * Layout (pdserve_pack_blocks), groups of 16 outputs g, then blocks of 32 k, 320 bytes each:
 *
 *   [0, 32)     d of outputs 16 g .. 16 g + 15 (fp16, the Q4_1 block's scale)
 *   [32, 64)    m of the same (fp16, the block's minimum)
 *   [64, 320)   4 runs of 64 bytes, run c for the pairs of k (2p, 2p + 1), p = 4 c .. 4 c + 3:
 *               16 dwords, dword i holding 8 nibbles, nibble 2 (p - 4 c) = lo_p(i) and nibble
 *               2 (p - 4 c) + 1 = hi_p(i), where lo_p(i) = q[16 g + i / 2][2 p + i % 2] and
 *               hi_p(i) = q[16 g + 8 + i / 2][2 p + i % 2]
 *
 * so that one 64-byte load serves four pairs of k: shifted right by 4 j, its 16 dwords give in
 * their low 4 bits, nibble j of each (through a 16-entry table, vpermps, which reads no other
 * bits), the values of outputs 0-7 of the group at k and k + 1 interleaved (j even) or of
 * outputs 8-15 (j odd);
 * their fp32 values q d + m (exact: q d is) rounded by vcvtne2ps2bf16 are then the dwords
 * (w[n][k], w[n][k + 1]) for n = 16 g .. 16 g + 15 in order: the packed kernel's register.
 * (Until 2026-11-28 each pair of k had 16 bytes, widened to dwords by vpmovzxbd: one shuffle
 * more per 32 weights, which a 1-row step, bound by its instructions and not by memory on a
 * Zen 5, paid: the 1-row kernel ran ~20 % slower from cache.)
 *
 * That is how a prompt's tokens are multiplied. A generated token's rows (decode) multiply
 * Q4_1 on its exact values instead (exact_q4.h: qt QP_Q4_1X, its own layout), the same bits at
 * every row count too (pdserve_linear_hybrid_rows).
 *
 * Q8_0 (the default GGUF's tied embedding and lm_head) the same way, 34 bytes per 32 weights:
 * d, then per pair of k 16 int8 for outputs 0-7 and 16 for outputs 8-15 (pdserve_pack_blocks);
 * q d is exact in fp32 too.
 */
#define Q4G 16           /* outputs per group */
#define Q4GB 320         /* bytes per group and block of 32 k: Q4_1 */
#define Q8GB 544         /* Q8_0: d, then 16 pairs of 32 int8 (outputs 0-7's pair, 8-15's) */
#define QP_Q4_1 3        /* GGML's type ids, as kernels/quantized.py */
#define QP_Q8_0 8
#define QP_Q4_1X 103     /* Q4_1 in exact_q4.h's layout, multiplied on its exact values */
#define Q4MR 12          /* rows of x per pass over the weights (8 for a prompt's: its limit) */
#define Q4NG 4           /* groups side by side, at most */
#ifndef QP_AHEAD
#define QP_AHEAD 8       /* blocks prefetched ahead in each group */
#endif

int64_t pdserve_qp_bytes(int64_t N, int64_t K, int32_t qt) {
    return (N + Q4G - 1) / Q4G * (K / 32) * (qt == QP_Q8_0 ? Q8GB : Q4GB);
}

#include "exact_q4.h" /* QP_Q4_1X */

/* GGUF blocks of format qt [N, K/32] into the layouts above (Q4_1: fp16 d, fp16 m, 16 bytes,
 * value j low nibble, value j + 16 high; Q8_0: fp16 d, 32 int8). For Q8_0, after the 16 d, each
 * pair p has 32 bytes: byte i < 16 = q[16 g + i / 2][2 p + i % 2], byte 16 + i = q[16 g + 8 +
 * i / 2][2 p + i % 2]. QP_Q4_1X: Q4_1 blocks into exact_q4.h's layout. Outputs past N get d = m
 * = 0. K must be a multiple of 32. */
void pdserve_pack_blocks(const uint8_t *blocks, int64_t N, int64_t K, uint8_t *out, int32_t qt,
                         int32_t num_threads) {
    const int q8 = qt == QP_Q8_0, q4x = qt == QP_Q4_1X;
    const int64_t kbs = K / 32, groups = (N + Q4G - 1) / Q4G, gb = q8 ? Q8GB : Q4GB;
    const int64_t block_bytes = q8 ? 34 : 20, head = q8 ? 32 : 64;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            uint8_t *o = out + (g * kbs + kb) * gb;
            memset(o, 0, gb);
            int8_t q[Q4G][32]; /* Q4_1: 0-15; Q8_0: as stored */
            memset(q, 0, sizeof q);
            for (int j = 0; j < Q4G; j++) {
                const int64_t n = g * Q4G + j;
                if (n >= N) continue;
                const uint8_t *b = blocks + (n * kbs + kb) * block_bytes;
                memcpy(o + 2 * j, b, 2); /* d */
                if (q8) {
                    memcpy(q[j], b + 2, 32);
                    continue;
                }
                memcpy(o + 32 + 2 * j, b + 2, 2); /* m */
                for (int v = 0; v < 16; v++) {
                    q[j][v] = (int8_t)(b[4 + v] & 15);
                    q[j][v + 16] = (int8_t)(b[4 + v] >> 4);
                }
            }
            if (q4x) { /* exact_q4.h's runs: q of output i at k = 2 (4 c + j) + h, word 2 i + h of
                        * run c, nibble j */
                for (int i = 0; i < Q4G; i++)
                    for (int v = 0; v < 32; v++) {
                        const int p = v / 2, c = p / 4, j = p % 4, h = v % 2;
                        uint16_t *word = (uint16_t *)(o + 64 + 64 * c) + 2 * i + h;
                        *word |= (uint16_t)((uint8_t)q[i][v] << (4 * j));
                    }
                continue;
            }
            for (int p = 0; p < 16; p++)
                for (int i = 0; i < 16; i++) {
                    const uint8_t lo = (uint8_t)q[i / 2][2 * p + i % 2], hi = (uint8_t)q[8 + i / 2][2 * p + i % 2];
                    if (q8)
                        o[head + 32 * p + i] = lo, o[head + 32 * p + 16 + i] = hi;
                    else
                        o[head + 64 * (p / 4) + 4 * i + p % 4] = (uint8_t)(lo | hi << 4);
                }
        }
}

/* Rows 0 .. mr-1 of x against groups g .. g + ng - 1 (ng * mr <= 8 independent vdpbf16ps chains:
 * one chain is bound by the instruction's latency, not by the bytes), y[r][16 (g + j) + i], masked
 * past N. Each output's chain is the same whatever ng and mr are. */
static inline __attribute__((always_inline)) void qp_tile(const uint16_t *x, int64_t K,
                                                           const uint8_t *w, int qt, int64_t g,
                                                           int ng, int mr, const uint16_t *bias,
                                                           uint16_t *y, int64_t N) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const int64_t gb = qt == QP_Q8_0 ? Q8GB : Q4GB, kbs = K / 32, group_bytes = kbs * gb;
    __m512 acc[Q4NG][Q4MR];
    UNROLL for (int j = 0; j < Q4NG; j++)
        UNROLL for (int r = 0; r < Q4MR; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        const uint8_t *b[Q4NG];
        __m512 dlo[Q4NG], dhi[Q4NG], mlo[Q4NG], mhi[Q4NG]; /* m: Q4_1 only */
        UNROLL for (int j = 0; j < Q4NG; j++) {
            if (j >= ng) break;
            b[j] = w + (g + j) * group_bytes + kb * gb;
            /* QP_AHEAD blocks ahead; near a group's end, into the next tile's group j (which
             * follows in memory only for the last group): no stream starts cold */
            const int64_t ahead = kb + QP_AHEAD;
            const uint8_t *pf = ahead < kbs ? b[j] + QP_AHEAD * gb
                                            : w + (g + j + ng) * group_bytes + (ahead - kbs) * gb;
            /* into L2, not L1 (as exact_q4.h): the Q8_0 lm_head at 1-4 rows, cold, 2 threads,
             * a Zen 4, ran 0.66-0.8x T0's time, its lines no longer evicting each other's */
            for (int c = 0; c < gb; c += 64) _mm_prefetch((const char *)pf + c, _MM_HINT_T1);
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b[j]));
            dlo[j] = _mm512_permutexvar_ps(lo_idx, d), dhi[j] = _mm512_permutexvar_ps(hi_idx, d);
            if (qt == QP_Q4_1) {
                const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b[j] + 32)));
                mlo[j] = _mm512_permutexvar_ps(lo_idx, m), mhi[j] = _mm512_permutexvar_ps(hi_idx, m);
            }
        }
        __m512i run[Q4NG]; /* Q4_1: the 64 bytes of four pairs of k */
        UNROLL for (int p = 0; p < 16; p++) {
            const int64_t k = kb * 32 + 2 * p;
            UNROLL for (int j = 0; j < Q4NG; j++) {
                if (j >= ng) break;
                __m512 lo, hi;
                if (qt == QP_Q4_1) {
                    if (p % 4 == 0) run[j] = _mm512_loadu_si512((const void *)(b[j] + 64 + 16 * p));
                    const int s = 8 * (p % 4);
                    lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(run[j], s), table), dlo[j], mlo[j]);
                    hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(run[j], s + 4), table), dhi[j], mhi[j]);
                } else {
                    const uint8_t *qb = b[j] + 32 + 32 * p;
                    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qb))), dlo[j]);
                    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16)))), dhi[j]);
                }
                const __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);
                UNROLL for (int r = 0; r < Q4MR; r++) {
                    if (r >= mr) break;
                    int32_t pair;
                    memcpy(&pair, x + r * K + k, sizeof pair);
                    acc[j][r] = _mm512_dpbf16_ps(acc[j][r], (__m512bh)_mm512_set1_epi32(pair), wv);
                }
            }
        }
    }
    q4_tile_store(acc, g, ng, mr, bias, y, N);
}

/* The rows of pass j when M rows go in passes of at most Q4MR, as even as can be (32 = 10 + 11 +
 * 11, not 12 + 12 + 8). Passes of 12 rows rather than 8 measured 0.96x at 32 and 64 generated
 * rows (exact_q4.h; the default model's 120 projections from memory, 2 threads, a Zen 4). */
static inline int64_t pass_rows(int64_t M, int64_t j) {
    const int64_t passes = (M + Q4MR - 1) / Q4MR;
    return (M + j) / passes;
}

/* TILE with NG and MR constant for each (groups side by side, rows) a pass takes: one instance
 * each, so the chains stay in registers. */
#define QP_CASE(TILE, ng_, mr_) case ng_ * 16 + mr_: { enum { NG = ng_, MR = mr_ }; TILE; } break;
#define QP_CASES(TILE)                                                                             \
    switch (ng * 16 + mr) {                                                                        \
        QP_CASE(TILE, 4, 1) QP_CASE(TILE, 4, 2) QP_CASE(TILE, 3, 1) QP_CASE(TILE, 3, 2)            \
        QP_CASE(TILE, 2, 1) QP_CASE(TILE, 2, 2) QP_CASE(TILE, 2, 3) QP_CASE(TILE, 2, 4)            \
        QP_CASE(TILE, 1, 1) QP_CASE(TILE, 1, 2) QP_CASE(TILE, 1, 3) QP_CASE(TILE, 1, 4)            \
        QP_CASE(TILE, 1, 5) QP_CASE(TILE, 1, 6) QP_CASE(TILE, 1, 7) QP_CASE(TILE, 1, 8)            \
        QP_CASE(TILE, 1, 9) QP_CASE(TILE, 1, 10) QP_CASE(TILE, 1, 11) QP_CASE(TILE, 1, 12)         \
    }

/* y [M, N] = x [M, K] @ w^T (+ bias), w packed by pdserve_pack_blocks (qt 3: Q4_1, 8: Q8_0, 103:
 * Q4_1 exact); x, y, bias bf16. */
void pdserve_linear_qp(const uint16_t *x, const uint8_t *w, int32_t qt, const uint16_t *bias,
                       uint16_t *y, int64_t M, int64_t N, int64_t K, int32_t num_threads) {
    if (M <= 0 || N <= 0) return;
    const int64_t groups = (N + Q4G - 1) / Q4G, kbs = K / 32;
    if ((double)M * N * K < MIN_PARALLEL || num_threads < 1) num_threads = 1;
    if (num_threads > groups) num_threads = (int32_t)groups;
    float xs[qt == QP_Q4_1X ? M * kbs : 1]; /* exact Q4_1: x's block sums (M <= Q4X_RUN) */
    if (qt == QP_Q4_1X)
        for (int64_t r = 0; r < M; r++) q4x_sums(x + r * K, K, xs + r * kbs);
    /* Each thread an equal run of groups, walked ng at a time (4 for 1-2 rows, 2 for 3-4); more
     * than Q4MR rows in passes over each group while it is in L1. */
    const int64_t passes = (M + Q4MR - 1) / Q4MR, first = pass_rows(M, 0);
    const int most = passes > 1 ? 1 : first <= 2 ? 4 : first <= 4 ? 2 : 1;
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int64_t t = 0; t < num_threads; t++) {
        const int64_t g1 = groups * (t + 1) / num_threads;
        for (int64_t g = groups * t / num_threads; g < g1;) {
            const int ng = g1 - g < most ? (int)(g1 - g) : most;
            for (int64_t j = 0, m = 0, mr; m < M; j++, m += mr) {
                mr = pass_rows(M, j);
                const uint16_t *xm = x + m * K;
                uint16_t *ym = y + m * N;
                if (qt == QP_Q8_0)
                    QP_CASES(qp_tile(xm, K, w, QP_Q8_0, g, NG, MR, bias, ym, N))
                else if (qt == QP_Q4_1)
                    QP_CASES(qp_tile(xm, K, w, QP_Q4_1, g, NG, MR, bias, ym, N))
                else
                    QP_CASES(q4x_tile(xm, xs + m * kbs, K, w, g, NG, MR, bias, ym, N))
            }
            g += ng;
        }
    }
}
#undef QP_CASES
#undef QP_CASE

/* A projection the layer loop hands to pdserve_linear_hybrid in place of a packed weight: up to
 * qp_max_rows rows of x through pdserve_linear_qp on qp, more through the packed bf16 copy; and
 * (pdserve_linear_hybrid_rows) a Q4_1 weight's generated rows on its exact values, qx. */
typedef struct {
    const uint32_t *packed; /* pdserve_pack_bf16's, of the dequantized weight rounded to bf16 */
    const uint8_t *qp;      /* pdserve_pack_blocks of the same weight */
    int64_t qp_max_rows;    /* qp for at most this many rows of x, packed for more */
    int64_t qt;             /* the blocks' format: QP_Q4_1 or QP_Q8_0 */
    const uint8_t *qx;      /* Q4_1: the blocks in exact_q4.h's layout (QP_Q4_1X); or NULL */
} HybridWeight;

/* Every row as a prompt token's: the bf16 rounding of the weights. */
void pdserve_linear_hybrid(const uint16_t *x, const void *weight, const uint16_t *bias,
                           uint16_t *y, int64_t M, int64_t N, int64_t K, int32_t num_threads) {
    const HybridWeight *h = (const HybridWeight *)weight;
    if (h->qp && M <= h->qp_max_rows)
        pdserve_linear_qp(x, h->qp, (int32_t)h->qt, bias, y, M, N, K, num_threads);
    else
        pdserve_linear_packed(x, h->packed, bias, y, M, N, K, num_threads);
}

/* Rows 0 .. prompt_rows-1 as prompt tokens (pdserve_linear_hybrid), the rest as generated ones:
 * on qx's exact values where the weight has them, in runs of at most Q4X_RUN rows. Either kind's
 * outputs are the same bits whatever the other rows are. */
void pdserve_linear_hybrid_rows(const uint16_t *x, const void *weight, const uint16_t *bias,
                                uint16_t *y, int64_t M, int64_t N, int64_t K, int32_t num_threads,
                                int64_t prompt_rows) {
    const HybridWeight *h = (const HybridWeight *)weight;
    const int64_t p = !h->qx ? M : prompt_rows < 0 ? 0 : prompt_rows > M ? M : prompt_rows;
    if (p) pdserve_linear_hybrid(x, weight, bias, y, p, N, K, num_threads);
    for (int64_t m = p; m < M; m += Q4X_RUN) {
        const int64_t rows = M - m < Q4X_RUN ? M - m : Q4X_RUN;
        pdserve_linear_qp(x + m * K, h->qx, QP_Q4_1X, bias, y + m * N, rows, N, K, num_threads);
    }
}
