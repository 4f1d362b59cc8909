/*
 * Q4_1 weights of a bf16 model multiplied on their exact values (included by packed_q4.h, whose
 * qt QP_Q4_1X it is; opt-in, PDSERVE_BF16_EXACT_Q4_1). Two layouts of the same blocks, one for
 * few rows of x (decode) and one for many (prefill, large batches), whose outputs are bit for bit
 * the same for every row: no output depends on how many rows a step batches.
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
 * Few rows (pdserve_pack_q4x, 320 bytes per group of 16 outputs and block, as packed_q4.h's
 * Q4_1 layout, pdserve_qp_bytes): [0, 32) d, [32, 64) m of the group's 16 outputs (fp16), then
 * 4 runs of 64 bytes, run c for the pairs p = 4 c .. 4 c + 3: 32 words, word 2 i + h holding in
 * its nibble j the q of output 16 g + i at k = 2 (4 c + j) + h. Shifted right by 4 j and masked,
 * the run is the register of bf16 pairs (w[n][2p], w[n][2p + 1]) for the group's 16 outputs.
 *
 * Many rows (pdserve_pack_q4x_many, Q4X_KB bytes per block of 32 outputs and 32 k): 16 pairs of
 * 32 dwords (bf16 128 + q for k = 2p, 2p + 1 of each output), then for outputs 0-15 and 16-31 in
 * turn 16 fp16 d and 16 fp16 m (the few-rows layout's head, twice). Four times the bytes of the
 * blocks, as a packed bf16 copy: prefill is bound by its multiplications, not by reading weights.
 *
 * On a 2-core Zen 4 (docs/architecture.md): one row 0.73x the bf16-rounded block kernel's step,
 * but prefill 0.89x: the two FMAs per 16 vdpbf16ps of a block's fold are ~12 % more work where
 * the packed bf16 kernel runs near the vdpbf16ps peak. Hence opt-in.
 */
#define Q4X_AHEAD 8     /* blocks prefetched ahead in each group (into L2: T0 ran at 0.6x) */
#define Q4X_MR 6        /* rows of x per micro-tile, many rows */
#define Q4X_NB 32       /* outputs per block, many rows (64: the sums spill, 1.08x slower) */
#define Q4X_REGS (Q4X_NB / 16)
#define Q4X_KB (Q4X_NB * 68) /* bytes per block of outputs and 32 k, many rows */
#define Q4X_M_CHUNK 96  /* rows of x per task when there are many (a multiple of Q4X_MR) */

static inline uint8_t q4x_nibble(const uint8_t *block, int v) { /* GGUF Q4_1: value v of 32 */
    return v < 16 ? block[4 + v] & 15 : block[4 + v - 16] >> 4;
}

void pdserve_pack_q4x(const uint8_t *blocks, int64_t N, int64_t K, uint8_t *out,
                      int32_t num_threads) {
    const int64_t kbs = K / 32, groups = (N + Q4G - 1) / Q4G;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            uint8_t *o = out + (g * kbs + kb) * Q4GB;
            memset(o, 0, Q4GB);
            for (int i = 0; i < Q4G; i++) {
                const int64_t n = g * Q4G + i;
                if (n >= N) continue; /* d = m = 0, q = 0 */
                const uint8_t *b = blocks + (n * kbs + kb) * 20;
                memcpy(o + 2 * i, b, 2), memcpy(o + 32 + 2 * i, b + 2, 2);
                for (int v = 0; v < 32; v++) { /* k = 2 (4 c + j) + h */
                    const int p = v / 2, c = p / 4, j = p % 4, h = v % 2;
                    uint16_t *word = (uint16_t *)(o + 64 + 64 * c) + 2 * i + h;
                    *word |= (uint16_t)(q4x_nibble(b, v) << (4 * j));
                }
            }
        }
}

int64_t pdserve_q4x_many_bytes(int64_t N, int64_t K) {
    return (N + Q4X_NB - 1) / Q4X_NB * (K / 32) * Q4X_KB;
}

void pdserve_pack_q4x_many(const uint8_t *blocks, int64_t N, int64_t K, uint8_t *out,
                           int32_t num_threads) {
    const int64_t kbs = K / 32, nbs = (N + Q4X_NB - 1) / Q4X_NB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            uint8_t *o = out + (nb * kbs + kb) * Q4X_KB;
            memset(o, 0, Q4X_KB);
            for (int j = 0; j < Q4X_NB; j++) {
                const int64_t n = nb * Q4X_NB + j;
                if (n >= N) continue;
                const uint8_t *b = blocks + (n * kbs + kb) * 20;
                uint8_t *dm = o + Q4X_NB * 64 + 64 * (j / 16) + 2 * (j % 16);
                memcpy(dm, b, 2), memcpy(dm + 32, b + 2, 2);
                for (int v = 0; v < 32; v++)
                    ((uint16_t *)o)[2 * (Q4X_NB * (v / 2) + j) + v % 2] =
                        (uint16_t)(0x4300 | q4x_nibble(b, v));
            }
        }
}

/* xs[b] = sum of x[32 b .. 32 b + 31] (bf16), b < K / 32: the one order both layouts use. */
static inline void q4x_sums(const uint16_t *x, int64_t K, float *xs) {
    for (int64_t b = 0; b < K / 32; b++) {
        const __m256i *p = (const __m256i *)(x + 32 * b);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p + 1));
        xs[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                                   _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
    }
}

/* bias[n0 .. n0 + 15] (masked) widened, or 0: added to every output, so -0 sums alike */
static inline __m512 q4x_bias(const uint16_t *bias, int64_t n0, __mmask16 mask) {
    if (!bias) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16));
}

static inline __mmask16 q4x_mask(int64_t rem) {
    return rem >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1);
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
    const __m512i low = _mm512_set1_epi16(0x000f), one28 = _mm512_set1_epi16(0x4300);
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
                    /* (run >> 4p) & 0xf | 0x4300 */
                    const __m512bh wv = (__m512bh)_mm512_ternarylogic_epi32(
                        _mm512_srli_epi16(run, 4 * p), low, one28, 0xEA);
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
    UNROLL for (int j = 0; j < Q4NG; j++) {
        if (j >= ng) break;
        const int64_t n0 = (g + j) * Q4G;
        const __mmask16 mask = q4x_mask(N - n0);
        const __m512 bv = q4x_bias(bias, n0, mask);
        UNROLL for (int r = 0; r < Q4MR; r++) {
            if (r >= mr) break;
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j][r], bv));
            _mm256_mask_storeu_epi16(y + r * N + n0, mask, out);
        }
    }
}


/* Many rows: rows 0 .. mr-1 of x against the block of 32 outputs at wb (outputs n0 ..). */
static inline __attribute__((always_inline)) void q4x_many_tile(
    const uint16_t *x, const float *xs, int64_t K, const uint8_t *wb, int mr, const uint16_t *bias,
    uint16_t *y, int64_t N, int64_t n0, const char *next) {
    const int64_t kbs = K / 32;
    __m512 acc[Q4X_MR][Q4X_REGS];
    UNROLL for (int r = 0; r < Q4X_MR; r++)
        UNROLL for (int c = 0; c < Q4X_REGS; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        const uint8_t *b = wb + kb * Q4X_KB;
        __m512 s[Q4X_MR][Q4X_REGS];
        UNROLL for (int r = 0; r < Q4X_MR; r++)
            UNROLL for (int c = 0; c < Q4X_REGS; c++) s[r][c] = _mm512_setzero_ps();
        UNROLL for (int p = 0; p < 16; p++) {
            __m512bh w[Q4X_REGS];
            UNROLL for (int c = 0; c < Q4X_REGS; c++) {
                w[c] = (__m512bh)_mm512_loadu_si512((const void *)(b + Q4X_NB * 4 * p + 64 * c));
                if (next) /* the next block's same bytes into L2, as the packed kernel does */
                    _mm_prefetch(next + kb * Q4X_KB + Q4X_NB * 4 * p + 64 * c, _MM_HINT_T1);
            }
            UNROLL for (int r = 0; r < Q4X_MR; r++) {
                if (r >= mr) break;
                int32_t pair;
                memcpy(&pair, x + r * K + kb * 32 + 2 * p, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                UNROLL for (int c = 0; c < Q4X_REGS; c++)
                    s[r][c] = _mm512_dpbf16_ps(s[r][c], xb, w[c]);
            }
        }
        UNROLL for (int c = 0; c < Q4X_REGS; c++) {
            Q4X_SCALES(d, mp, b + Q4X_NB * 64 + 64 * c);
            UNROLL for (int r = 0; r < Q4X_MR; r++) {
                if (r >= mr) break;
                acc[r][c] = q4x_fold(acc[r][c], s[r][c], d, mp, xs[r * kbs + kb]);
            }
        }
    }
    UNROLL for (int c = 0; c < Q4X_REGS; c++) {
        const int64_t rem = N - n0 - 16 * c;
        if (rem <= 0) break;
        const __mmask16 mask = q4x_mask(rem);
        const __m512 bv = q4x_bias(bias, n0 + 16 * c, mask);
        UNROLL for (int r = 0; r < Q4X_MR; r++) {
            if (r >= mr) break;
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][c], bv));
            _mm256_mask_storeu_epi16(y + r * N + n0 + 16 * c, mask, out);
        }
    }
}

static void q4x_many_rows(const Blocks *b, int64_t nb, int64_t m0, int64_t m1, const char *next) {
    const int64_t K = b->K, kbs = K / 32, n0 = nb * Q4X_NB;
    const uint8_t *wb = (const uint8_t *)b->w + nb * b->block_bytes;
    for (int64_t j = 0, m = m0, mr; m < m1; j++, m += mr) {
        mr = pass_rows(m0, m1, Q4X_MR, j);
        const uint16_t *xm = b->x + m * K;
        uint16_t *ym = b->y + m * b->N;
        PASS_CASES(mr, q4x_many_tile(xm, b->xs + m * kbs, K, wb, MR, b->bias, ym, b->N, n0, next))
    }
}

/* y [M, N] = x [M, K] @ w^T (+ bias), w in the many-rows layout; x, y, bias bf16. Returns 0, or
 * -1 if the block sums could not be allocated (nothing written). */
int pdserve_linear_q4x_many(const uint16_t *x, const uint8_t *w, const uint16_t *bias,
                            uint16_t *y, int64_t M, int64_t N, int64_t K, int32_t num_threads) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t kbs = K / 32;
    float *xs = malloc((size_t)(M * kbs) * sizeof *xs + 1);
    if (!xs) return -1;
    if ((double)M * N * K < MIN_PARALLEL || num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < M; r++) q4x_sums(x + r * K, K, xs + r * kbs);
    const Blocks b = {x, w, bias, y, N, K, kbs * Q4X_KB, xs};
    by_blocks(&b, M, (N + Q4X_NB - 1) / Q4X_NB, q4x_many_rows, num_threads);
    free(xs);
    return 0;
}
