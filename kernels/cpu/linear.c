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
        if (next) /* as many bytes of the next tile as this step read of this one */
            for (int b = 0; b < R * 8 * elem; b += 64)
                _mm_prefetch(next + k * R * elem + b, _MM_HINT_T0);
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
/*
 * bf16 on CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and later): vdpbf16ps multiplies 32
 * bf16 pairs and adds them into 16 fp32 lanes in one instruction, so nothing is widened. A tile
 * is 4 weight rows against up to 4 rows of x: 16 accumulators of 16 partial sums each (every
 * 32nd element of K); a K tail is a masked load. The 16 are reduced together by a tree of lane
 * shuffles (reduce16), which leaves y's 4 x 4 outputs in one register, row after row, to round to
 * bf16 in one instruction (vcvtneps2bf16: nearest even, as torch rounds).
 *
 * Measured on a 2-core Zen 4 (all of the default model's projections, 269 MB of bf16 weights,
 * 2 threads): at 4-64 rows as fast as oneDNN with pre-packed weights and 1.4-2x torch's
 * F.linear; at 1-2 rows the fp32 path above streams the weights faster (~26 vs ~22 GB/s), so
 * pdserve_linear sends those there.
 */
#define LINEAR_BF16_NATIVE 1
#define NATIVE_MIN_ROWS 3
#define UNROLL _Pragma("GCC unroll 16")

/* z[4 * c + r] = sum of every lane of a[4 * r + c], for c, r < 4. */
static inline __m512 reduce16(const __m512 a[16]) {
    __m512 s[8], u[4], x[2];
    UNROLL for (int i = 0; i < 8; i++) /* 512 -> 256 bits: [p0+p2, p1+p3, q0+q2, q1+q3] */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    UNROLL for (int i = 0; i < 4; i++) /* 256 -> 128: 128-bit lane l of u[j] sums a[4j + l] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    UNROLL for (int i = 0; i < 2; i++) /* 128 -> 64, within lanes */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]),
                             _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[0]), _mm512_castps_pd(x[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[0]), _mm512_castps_pd(x[1]));
    return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

static inline __m512bh load32bh(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* One K step of a tile: acc[4 * r + c] += x[c, k:k+32] . w[r, k:k+32] (masked). */
static inline __attribute__((always_inline)) void step_bf16(const uint16_t *x,
                                                            const uint16_t *w, int64_t K,
                                                            int64_t k, int nc, int nr,
                                                            __mmask32 mask, __m512 acc[16]) {
    __m512bh xv[4], wv[4];
    UNROLL for (int c = 0; c < nc; c++) xv[c] = load32bh(x + c * K + k, mask);
    UNROLL for (int r = 0; r < nr; r++) wv[r] = load32bh(w + r * K + k, mask);
    UNROLL for (int r = 0; r < nr; r++)
        UNROLL for (int c = 0; c < nc; c++)
            acc[4 * r + c] = _mm512_dpbf16_ps(acc[4 * r + c], xv[c], wv[r]);
}

/*
 * out[4 * c + r] = x[c] . w[r] for c < nc rows of x and r < nr rows of w (row stride K both);
 * the others are 0. While it runs, as many bytes at `next` as it reads of w are prefetched.
 */
static inline __attribute__((always_inline)) __m512 tile_dot_bf16(const uint16_t *x,
                                                                  const uint16_t *w, int64_t K,
                                                                  int nc, int nr,
                                                                  const char *next) {
    __m512 acc[16];
    UNROLL for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        step_bf16(x, w, K, k, nc, nr, ~(__mmask32)0, acc);
        if (next) UNROLL for (int b = 0; b < 4 * 64; b += 64) _mm_prefetch(next + k * 8 + b, _MM_HINT_T0);
    }
    if (k < K) step_bf16(x, w, K, k, nc, nr, (__mmask32)((1ull << (K - k)) - 1), acc);
    return reduce16(acc);
}

static __m512 tile_dot_bf16_any(const uint16_t *x, const uint16_t *w, int64_t K, int nc, int nr,
                                const char *next) {
#define CASE(NC, NR)                                                                           \
    if (nc == NC && nr == NR) return tile_dot_bf16(x, w, K, NC, NR, next);
#define CASES(NC) CASE(NC, 4) CASE(NC, 3) CASE(NC, 2) CASE(NC, 1)
    CASES(4) CASES(3) CASES(2) CASES(1)
#undef CASES
#undef CASE
    return _mm512_setzero_ps();
}

/* Rows n0 .. n1-1 of y^T, for bf16 x, w, bias and y. */
/* Every pass over the tile prefetches the next one (not only the first: measured 1.2x quicker
 * at 16-32 rows; the lines are in cache after the first pass, so the rest cost little). */
static void rows_bf16(const Problem *p, int64_t n0, int64_t n1) {
    const uint16_t *x = (const uint16_t *)p->x, *w = p->w, *bias = p->bias;
    uint16_t *y = p->y;
    const int64_t K = p->K;
    for (int64_t n = n0; n < n1; n += 4) {
        const int nr = n1 - n < 4 ? (int)(n1 - n) : 4;
        const uint16_t *tile = w + n * K;
        const char *next = n + 8 <= n1 ? (const char *)(tile + 4 * K) : NULL;
        __m512 b = _mm512_setzero_ps();
        if (bias) {
            float bf[4] = {0};
            for (int r = 0; r < nr; r++) bf[r] = bf16_to_f32(bias[n + r]);
            b = _mm512_broadcast_f32x4(_mm_loadu_ps(bf)); /* [b0 b1 b2 b3] x 4 rows */
        }
        for (int64_t m = 0; m < p->M; m += 4) {
            const int nc = p->M - m < 4 ? (int)(p->M - m) : 4;
            const __m512 z = tile_dot_bf16_any(x + m * K, tile, K, nc, nr, next);
            uint64_t out[4]; /* row c of the tile: 4 bf16 */
            _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(z, b)));
            for (int c = 0; c < nc; c++) memcpy(y + (m + c) * p->N + n, &out[c], 2 * (size_t)nr);
        }
    }
}
#else
#define LINEAR_BF16_NATIVE 0
#endif

/* 1 if bf16 runs on AVX512-BF16 instructions (no widening to fp32). */
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
#if LINEAR_BF16_NATIVE
    const int native = bf16 && M >= NATIVE_MIN_ROWS; /* bf16 x read as it is, no widening */
#else
    const int native = 0;
#endif
    if (M <= 0 || N <= 0) return 0;
    float *xf = NULL;
    if (bf16 && !native) {
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
        if (bf16 && !native && (M + C - 1) / C >= WIDEN_PASSES) {
            wbuf = malloc((size_t)(R * K) * sizeof *wbuf + 1);
            failed = !wbuf;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_chunks; i++) {
            const int64_t n0 = i * chunk * R, n1 = (i + 1) * chunk * R < N ? (i + 1) * chunk * R : N;
            if (failed) continue;
#if LINEAR_BF16_NATIVE
            if (native) {
                rows_bf16(&p, n0, n1);
                continue;
            }
#endif
            rows(&p, n0, n1, wbuf);
        }
        free(wbuf);
    }
    free(xf);
    return failed ? -1 : 0;
}
