/*
 * Linear layer for a few rows of x on CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]).
 *
 * A decode step multiplies every weight by only a few token rows, so its speed is the speed of
 * streaming the weights from memory. Threads take chunks of CHUNK_BYTES of consecutive weight
 * rows (OpenMP over N, handed out as threads free up) and walk them in tiles of R = 4 rows. A
 * tile is read from memory once, while the next one is prefetched, and multiplied with every
 * row of x, C = 2 rows per pass, from cache:
 *
 *     for each tile n .. n+R-1 of w:                   (from memory once)
 *       for each pass over rows m .. m+nc-1 of x:      (nc <= C; tile and x stay in cache)
 *         acc[c][r] += x[m+c, k:k+8] * w[n+r, k:k+8]   k = 0, 8, ...   (R*C independent FMAs)
 *         y[m+c, n+r] = hsum(acc[c][r]) + tail + bias[n+r]
 *
 * fp32 weights go with fp32 x; bf16 weights with bf16 x, which is widened to fp32 once per call
 * (a 16-bit shift), as are the weights as they are loaded, or, when x takes WIDEN_PASSES passes
 * or more, once per tile into per-thread scratch (converting on every pass instead measured
 * quicker at up to 4 passes, as quick at 8, slower at 32). Sums run in fp32; bf16 outputs round
 * to nearest even, as torch does. The summation order is not torch's, so fp32 results differ
 * from F.linear's in the last bits.
 *
 * On the 2-core Zen 3 this was written on, the default model's projections for one token read
 * fp32 weights at ~24-27 GB/s (torch's GEMV: ~14 GB/s; a plain sum of the same bytes: ~29 GB/s).
 *
 * AVX2+FMA intrinsics where the compiler targets them (-march=native); otherwise a plain C loop
 * with the same tiling, correct but not fast: pdserve_linear_simd() tells the caller which.
 *
 * Where the CPU has AVX512-BF16 there is a second kernel, for bf16 only and any number of rows:
 * pdserve_linear_packed on weights packed once by pdserve_pack_bf16 (below).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LINEAR_SIMD 1
#else
#define LINEAR_SIMD 0
#endif

#define R 4                     /* weight rows per tile */
#define C 2                     /* rows of x per pass over a tile */
#define CHUNK_BYTES (256 << 10) /* weights per unit of work handed to a thread */
#define MIN_PARALLEL 32768      /* multiply-adds (M * N * K) below which one thread is quicker */
#define WIDEN_PASSES 8          /* bf16 tiles taking this many passes are widened to fp32 first */

enum { F32 = 0, BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7fc0; /* NaN stays NaN (rounding could carry into the sign bit) */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of an fp32 or bf16 array, as fp32. */
static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if LINEAR_SIMD
/* Elements i .. i+7 of an fp32 or bf16 array, as fp32. */
static inline __m256 load8(const void *p, int64_t i, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)] */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline float hsum1(__m256 a) {
    float l[8];
    _mm256_storeu_ps(l, a);
    return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}
#endif

/* dst[i] = src[i] widened from bf16, i < n. */
static void widen(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#if LINEAR_SIMD
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src, i, 1));
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/*
 * out[c * R + r] = x[c] . w[r] for rows c < nc of x (fp32, row stride ldx) and rows r < nr of w
 * (fp32 or bf16, row stride K). While it runs, the R * K weights at `next` (or nothing if NULL)
 * are prefetched. Inlined with constant nc, nr and bf16 (tile_dot_any), so the loops unroll and
 * the accumulators live in registers.
 */
static inline __attribute__((always_inline)) void tile_dot(const float *x, int64_t ldx,
                                                           const void *w, int64_t K, int nc,
                                                           int nr, int bf16, const char *next,
                                                           float *out) {
    const int elem = bf16 ? 2 : 4;
    int64_t k = 0;
#if LINEAR_SIMD
    __m256 acc[C][R];
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < nr; r++) acc[c][r] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        __m256 xv[C];
        for (int c = 0; c < nc; c++) {
            xv[c] = _mm256_loadu_ps(x + c * ldx + k);
            /* Opaque to the compiler, so it keeps x and w in registers instead of folding a
             * load into every FMA: 12 loads per 8 FMAs would cap the throughput at 2/3. */
            __asm__("" : "+x"(xv[c]));
        }
        for (int r = 0; r < nr; r++) {
            __m256 wv = load8((const char *)w + r * K * elem, k, bf16);
            __asm__("" : "+x"(wv));
            for (int c = 0; c < nc; c++) acc[c][r] = _mm256_fmadd_ps(xv[c], wv, acc[c][r]);
        }
        if (next) /* as many bytes of the next tile as this step read of this one, into L2 (the
                   * default model's 120 projections dense, AVX2 and AVX-512 builds, 2 threads,
                   * a Zen 4: fp32 0.75-0.89x L1's time at 1-16 rows, bf16 0.84-0.88x at 4-16
                   * and 0.89-1.04x at one row) */
            for (int b = 0; b < R * 8 * elem; b += 64)
                _mm_prefetch(next + k * R * elem + b, _MM_HINT_T1);
    }
    for (int c = 0; c < nc; c++) {
        if (nr == R)
            _mm_storeu_ps(out + c * R, hsum4(acc[c][0], acc[c][1], acc[c][2], acc[c][3]));
        else
            for (int r = 0; r < nr; r++) out[c * R + r] = hsum1(acc[c][r]);
    }
#else
    (void)next;
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < nr; r++) out[c * R + r] = 0.0f;
#endif
    for (; k < K; k++) {
        for (int r = 0; r < nr; r++) {
            const float wk = load1((const char *)w + r * K * elem, k, bf16);
            for (int c = 0; c < nc; c++) out[c * R + r] += x[c * ldx + k] * wk;
        }
    }
}

static void tile_dot_any(const float *x, int64_t ldx, const void *w, int64_t K, int nc, int nr,
                         int bf16, const char *next, float *out) {
#define CASE(NC, NR, BF)                                                                       \
    if (nc == NC && nr == NR && bf16 == BF) {                                                  \
        tile_dot(x, ldx, w, K, NC, NR, BF, next, out);                                         \
        return;                                                                                \
    }
#define CASES(NR) CASE(1, NR, 0) CASE(2, NR, 0) CASE(1, NR, 1) CASE(2, NR, 1)
    CASES(4) CASES(3) CASES(2) CASES(1)
#undef CASES
#undef CASE
}

typedef struct {
    const float *x; /* [M, K] fp32 (bf16 x already widened) */
    const void *w;  /* [N, K] fp32 or bf16 */
    const void *bias;
    void *y; /* [M, N] */
    int64_t M, N, K;
    int bf16;
} Problem;

/* Rows n0 .. n1-1 of y^T: weight rows n0 .. n1-1 against every row of x. wbuf: R * K floats
 * of scratch for bf16 tiles that take WIDEN_PASSES passes or more, else NULL. */
static void rows(const Problem *p, int64_t n0, int64_t n1, float *wbuf) {
    const int elem = p->bf16 ? 2 : 4;
    const int64_t passes = (p->M + C - 1) / C;
    float out[C * R];
    for (int64_t n = n0; n < n1; n += R) {
        const int nr = n1 - n < R ? (int)(n1 - n) : R;
        const char *next = n + 2 * R <= n1 ? (const char *)p->w + (n + R) * p->K * elem : NULL;
        const void *w = (const char *)p->w + n * p->K * elem;
        int w_bf16 = p->bf16;
        if (w_bf16 && passes >= WIDEN_PASSES && wbuf) { /* widen once, not once per pass */
            widen(w, nr * p->K, wbuf);
            w = wbuf;
            w_bf16 = 0;
        }
        /* x's rows in passes of nc <= C rows, as even as can be: 5 = 1 + 2 + 2 */
        for (int64_t j = 0, m = 0, nc; j < passes; j++, m += nc) {
            nc = (p->M + j) / passes;
            tile_dot_any(p->x + m * p->K, p->K, w, p->K, (int)nc, nr, w_bf16, j ? NULL : next,
                         out);
            for (int c = 0; c < nc; c++) {
                for (int r = 0; r < nr; r++) {
                    float v = out[c * R + r];
                    if (p->bias) v += load1(p->bias, n + r, p->bf16);
                    const int64_t i = (m + c) * p->N + n + r;
                    if (p->bf16)
                        ((uint16_t *)p->y)[i] = f32_to_bf16(v);
                    else
                        ((float *)p->y)[i] = v;
                }
            }
        }
    }
}

#if LINEAR_SIMD && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LINEAR_BF16_NATIVE 1 /* vdpbf16ps: bf16 pairs multiplied and summed into fp32 lanes */
#define UNROLL _Pragma("GCC unroll 16")
#else
#define LINEAR_BF16_NATIVE 0
#endif

#if LINEAR_BF16_NATIVE
/*
 * Pre-packed bf16 weights: y = x @ w^T without any reduction across lanes.
 *
 *   packed[nb][kp][j] = the dword (w[64 nb + j][2 kp], w[64 nb + j][2 kp + 1])   j < 64
 *
 * (zero past N and K). For a block of 64 outputs and up to 6 rows of x, each step kp loads the
 * block's 4 registers of 16 pairs and multiplies each with the dword (x[m][2kp], x[m][2kp+1])
 * broadcast (vdpbf16ps with an embedded broadcast): 24 accumulators of 16 finished outputs, 4
 * loads and 6 broadcasts per 24 instructions, the weights read front to back. Measured on the
 * 2-core Zen 4 against torch's F.linear: see gemm.py.
 */
#define PMR 6  /* rows of x per micro-tile */
#define PNB 64 /* outputs per block */

int64_t pdserve_packed_words(int64_t N, int64_t K) {
    return ((N + PNB - 1) / PNB) * ((K + 1) / 2) * PNB;
}

void pdserve_pack_bf16(const uint16_t *w, int64_t N, int64_t K, uint32_t *packed,
                       int32_t num_threads) {
    const int64_t kps = (K + 1) / 2, blocks = (N + PNB - 1) / PNB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++)
        for (int64_t kp = 0; kp < kps; kp++)
            for (int64_t j = 0; j < PNB; j++) {
                const int64_t n = nb * PNB + j, k = 2 * kp;
                uint32_t lo = 0, hi = 0;
                if (n < N) {
                    lo = w[n * K + k];
                    hi = k + 1 < K ? w[n * K + k + 1] : 0;
                }
                packed[(nb * kps + kp) * PNB + j] = lo | (hi << 16);
            }
}

/* Rows m .. m+mr-1 of x against block nb: y[m + r][64 nb + 16 c + i], masked past N. */
static inline __attribute__((always_inline)) void packed_tile(
    const uint16_t *x, int64_t K, const uint32_t *wb, int64_t kps, int mr, const uint16_t *bias,
    uint16_t *y, int64_t N, int64_t n0, const char *next) {
    __m512 acc[PMR][4];
    UNROLL for (int r = 0; r < PMR; r++)
        UNROLL for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t full = K / 2; /* dwords of x that are whole pairs */
    for (int64_t kp = 0; kp < kps; kp++) {
        __m512bh w[4];
        UNROLL for (int c = 0; c < 4; c++) w[c] = (__m512bh)_mm512_loadu_si512(wb + kp * PNB + 16 * c);
        /* the next block into L2 (into L1 it would evict this block): 1.03x, every pass */
        if (next) UNROLL for (int c = 0; c < 4; c++) _mm_prefetch(next + kp * PNB * 4 + 64 * c, _MM_HINT_T1);
        UNROLL for (int r = 0; r < PMR; r++) {
            if (r >= mr) break;
            const uint16_t *xr = x + r * K;
            int32_t pair;
            if (kp < full)
                memcpy(&pair, xr + 2 * kp, sizeof pair);
            else /* odd K: (x[K-1], 0) */
                pair = xr[2 * kp];
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            UNROLL for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, w[c]);
        }
    }
    const int64_t left = N - n0;
    UNROLL for (int c = 0; c < 4; c++) {
        const int64_t rem = left - 16 * c;
        if (rem <= 0) break;
        const __mmask16 mask = rem >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0 + 16 * c)), 16));
        UNROLL for (int r = 0; r < PMR; r++) {
            if (r >= mr) break;
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][c], b));
            _mm256_mask_storeu_epi16(y + r * N + n0 + 16 * c, mask, out);
        }
    }
}

static void packed_rows(const uint16_t *x, int64_t K, const uint32_t *wb, int64_t kps,
                        const uint16_t *bias, uint16_t *y, int64_t N, int64_t n0, int64_t m0,
                        int64_t m1, const char *next) {
    /* passes of at most PMR rows, as even as can be: 32 = 5 + 5 + 5 + 5 + 6 + 6, not 6 x 5 + 2 */
    const int64_t passes = (m1 - m0 + PMR - 1) / PMR;
    for (int64_t j = 0, m = m0, mr; j < passes; j++, m += mr) {
        mr = (m1 - m0 + j) / passes;
        const uint16_t *xm = x + m * K;
        uint16_t *ym = y + m * N;
        switch ((int)mr) {
        case 6: packed_tile(xm, K, wb, kps, 6, bias, ym, N, n0, next); break;
        case 5: packed_tile(xm, K, wb, kps, 5, bias, ym, N, n0, next); break;
        case 4: packed_tile(xm, K, wb, kps, 4, bias, ym, N, n0, next); break;
        case 3: packed_tile(xm, K, wb, kps, 3, bias, ym, N, n0, next); break;
        case 2: packed_tile(xm, K, wb, kps, 2, bias, ym, N, n0, next); break;
        default: packed_tile(xm, K, wb, kps, 1, bias, ym, N, n0, next); break;
        }
    }
}

#define PACKED_M_CHUNK 96 /* rows of x per task when there are many (a multiple of PMR) */

/* y [M, N] = x [M, K] @ w^T (+ bias [N]), w packed by pdserve_pack_bf16; all bf16. */
void pdserve_linear_packed(const uint16_t *x, const uint32_t *packed, const uint16_t *bias,
                           uint16_t *y, int64_t M, int64_t N, int64_t K, int32_t num_threads) {
    if (M <= 0 || N <= 0) return;
    const int64_t kps = (K + 1) / 2, blocks = (N + PNB - 1) / PNB, block_words = kps * PNB;
    if ((double)M * N * K < MIN_PARALLEL || num_threads < 1) num_threads = 1;
    if (M <= PACKED_M_CHUNK) {
        /*
         * Few rows (decode): the (block, row) pairs in block-major order, cut into one equal
         * range per thread, so a block may be shared between two threads by rows: 9 blocks of
         * 32 rows on 2 threads are 4.5 blocks each, not 5 and 4. Each thread walks its blocks
         * front to back and prefetches its own next one.
         */
        const int64_t units = blocks * M;
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
        for (int64_t t = 0; t < num_threads; t++) {
            const int64_t end = units * (t + 1) / num_threads;
            for (int64_t u = units * t / num_threads; u < end;) {
                const int64_t nb = u / M, m0 = u % M;
                const int64_t m1 = end - nb * M < M ? end - nb * M : M;
                const char *next = (nb + 1) * M < end ? (const char *)(packed + (nb + 1) * block_words) : NULL;
                packed_rows(x, K, packed + nb * block_words, kps, bias, y, N, nb * PNB, m0, m1, next);
                u = nb * M + m1;
            }
        }
        return;
    }
    /* Many rows (prefill): tasks of one block x PACKED_M_CHUNK rows, handed out as threads free up. */
    const int64_t chunks = (M + PACKED_M_CHUNK - 1) / PACKED_M_CHUNK;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < blocks * chunks; t++) {
        const int64_t nb = t % blocks, mc = t / blocks;
        const int64_t m0 = mc * PACKED_M_CHUNK;
        const int64_t m1 = m0 + PACKED_M_CHUNK < M ? m0 + PACKED_M_CHUNK : M;
        const char *next = nb + 1 < blocks ? (const char *)(packed + (nb + 1) * block_words) : NULL;
        packed_rows(x, K, packed + nb * block_words, kps, bias, y, N, nb * PNB, m0, m1, next);
    }
}

#include "packed_q4.h" /* Q4_1 and Q8_0 blocks (and exact_q4.h, which it includes) */
#endif

/* 1 if pdserve_pack_bf16 / pdserve_linear_packed exist (AVX512-BF16). */
int pdserve_linear_bf16_native(void) { return LINEAR_BF16_NATIVE; }

/* 1 if the kernel was built with its AVX2 path, 0 for the plain C fallback. */
int pdserve_linear_simd(void) { return LINEAR_SIMD; }

/*
 * y = x @ w^T (+ bias): x [M, K], w [N, K], bias [N] or NULL, y [M, N], all contiguous and of
 * one dtype (0 fp32, 1 bf16), on up to num_threads threads. Returns 0, or -1 if scratch memory
 * could not be allocated (y is then incomplete).
 */
int pdserve_linear(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                   int64_t K, int32_t dtype, int32_t num_threads) {
    const int bf16 = dtype == BF16;
    if (M <= 0 || N <= 0) return 0;
    float *xf = NULL;
    if (bf16) {
        xf = malloc((size_t)(M * K) * sizeof *xf + 1);
        if (!xf) return -1;
        widen(x, M * K, xf);
    }
    const Problem p = {xf ? xf : (const float *)x, w, bias, y, M, N, K, bf16};
    if ((double)M * N * K < MIN_PARALLEL || num_threads < 1) num_threads = 1;
    /* chunks of whole tiles: CHUNK_BYTES of weights, but at least 4 chunks per thread */
    const int64_t tiles = (N + R - 1) / R;
    const int64_t tile_bytes = R * K * (bf16 ? 2 : 4);
    int64_t chunk = CHUNK_BYTES / (tile_bytes > 0 ? tile_bytes : 1);
    const int64_t spread = (tiles + 4 * num_threads - 1) / (4 * num_threads);
    if (chunk > spread) chunk = spread;
    if (chunk < 1) chunk = 1;
    const int64_t num_chunks = (tiles + chunk - 1) / chunk;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *wbuf = NULL;
        if (bf16 && (M + C - 1) / C >= WIDEN_PASSES) {
            wbuf = malloc((size_t)(R * K) * sizeof *wbuf + 1);
            failed = !wbuf;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_chunks; i++) {
            const int64_t n0 = i * chunk * R, n1 = (i + 1) * chunk * R < N ? (i + 1) * chunk * R : N;
            if (!failed) rows(&p, n0, n1, wbuf);
        }
        free(wbuf);
    }
    free(xf);
    return failed ? -1 : 0;
}
