/*
 * Linear layers on quantized weights: y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias[N]).
 *
 * Weight formats (blocks of 32 consecutive k of one output row; a row is K / 32 blocks):
 *
 *   Q4_0 (2)   18 bytes: fp16 d, 16 bytes of nibbles          value = (q - 8) * d
 *   Q4_1 (3)   20 bytes: fp16 d, fp16 m, 16 bytes of nibbles  value = q * d + m
 *   Q8_0 (8)   34 bytes: fp16 d, 32 int8                      value = q * d
 *   I8   (100) 32 bytes: 32 int8; one fp32 scale per row      value = q * scale[n]
 *
 * The first three are GGUF's own blocks, byte for byte (so a GGUF file's tensor is used as it is,
 * rows contiguous); nibble byte j holds element j (low) and element j + 16 (high). I8 is the
 * per-output-channel symmetric int8 made at load for bf16/fp32 models.
 *
 * Where weights are dequantized (the tiled path, pdserve_qdequant), every value is computed
 * exactly as the formula reads in fp32 (a product, then a sum, each
 * rounded: the file is built with -ffp-contract=off so the compiler fuses nothing behind our
 * back), so the kernel computes sum_k w[n, k] * x[m, k] of the very weights a plain torch
 * dequantization gives; the sums run in fp32 in an order of our own.
 *
 * Paths per call, by the number of rows of x and the format:
 *   - direct (M <= 2 passes of MRD rows, decode): each block of a weight row is loaded once, its
 *     quants widened to fp32 in registers and multiplied with every row of x of the pass; each
 *     block's sum is scaled once (d; Q4_1 adds m times the block's sum of x, I8 scales the row's
 *     sum): sum_k w x up to fp32 rounding, in fewer operations than scaling every weight
 *     (1.5-2.5x faster per block). The weights stream from memory once per pass at 0.56-1.06
 *     bytes per weight instead of 4 (fp32). In quant_direct.h: scales converted 16 blocks at a
 *     time, one row of x against RN weight rows side by side.
 *   - integer (Q4_1 and, with AVX-512 VNNI, Q8_0; fp32 x; up to QV_MAX_ROWS rows), in
 *     quant_int.h: on a repacked copy of the blocks, x written exactly as three signed bytes per
 *     value, the products summed in int32 (pdserve_qlinear_v; the layer loop's QDesc carries the
 *     copy).
 *   - tiled (more rows): RT weight rows at a time are dequantized into a per-thread fp32 scratch
 *     (k in chunks of ~16 KiB of them, L1 resident) and multiplied with all rows of x in passes
 *     of TC rows, the sums carried from chunk to chunk; the next tile's blocks are prefetched
 *     into L2 meanwhile.
 *     The Python side sends many rows (prefill) to torch's GEMM on dequantized tiles instead.
 *
 * One source, three instruction sets, chosen at compile time: AVX-512 (F+BW, 16 lanes), AVX2 +
 * FMA + F16C (8 lanes), or portable C (1 lane). quant.py builds the variants it is asked for
 * (-mno-avx512f forces the AVX2 path, -mno-avx the portable one); pdserve_quant_isa() says
 * which one a library holds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
#define QISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QISA 256
#else
#define QISA 0
#endif
#if QISA
#include <immintrin.h>
#endif

#define ALWAYS static inline __attribute__((always_inline))
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, I8 = 100 };
#define QK 32 /* values per block */
#define MIN_PARALLEL 32768

int pdserve_quant_isa(void) { return QISA; }

int64_t pdserve_quant_block_bytes(int32_t qt) {
    switch (qt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case I8: return 32;
    default: return 0;
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if QISA
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while (!(m & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* ---- vectors of VL floats: NV of them hold one block ---- */
#if QISA == 512
typedef __m512 V;
#define VL 16
#define vzero() _mm512_setzero_ps()
#define vset1(a) _mm512_set1_ps(a)
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, a) _mm512_storeu_ps(p, a)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vhsum(a) _mm512_reduce_add_ps(a)
#define MRD 4 /* rows of x per direct pass */
#define RN 4  /* weight rows side by side in the direct path, one row of x */
#define TC 4  /* rows of x per tiled pass */
#define RT 4  /* weight rows per tile of the tiled path */
#elif QISA == 256
typedef __m256 V;
#define VL 8
#define vzero() _mm256_setzero_ps()
#define vset1(a) _mm256_set1_ps(a)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, a) _mm256_storeu_ps(p, a)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vadd(a, b) _mm256_add_ps(a, b)
static inline float vhsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* vhsum of a, b, c and d side by side: the same pairs added in the same order (the same bits) */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ac =
        _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
    const __m256 bd =
        _mm256_add_ps(_mm256_permute2f128_ps(b, d, 0x20), _mm256_permute2f128_ps(b, d, 0x31));
    /* ac: a's four (lo + hi) sums, then c's; bd: b's, then d's */
    const __m256 t =
        _mm256_add_ps(_mm256_shuffle_ps(ac, bd, 0x44), _mm256_shuffle_ps(ac, bd, 0xee));
    /* t: a0 a1 b0 b1 | c0 c1 d0 d1, each the (s0 + s2) or (s1 + s3) of vhsum */
    const __m128 lo = _mm256_castps256_ps128(t), hi = _mm256_extractf128_ps(t, 1);
    return _mm_add_ps(_mm_shuffle_ps(lo, hi, 0x88), _mm_shuffle_ps(lo, hi, 0xdd));
}
#define MRD 2
#define RN 4
#define TC 2
/* 6 weight rows a tile: 12 accumulators, 15 of the 16 registers. One thread, 20 MB of Q4_1 at
 * 9-64 rows of x on a Zen 4: 0.87-0.98x the time of 4 rows a tile (one run of two 1.05x at 32
 * and at 64 rows); 3 rows of x a pass (with 4 or 5 weight rows) spilled: 1.3-1.5x. */
#define RT 6
#else
typedef float V;
#define VL 1
#define vzero() 0.0f
#define vset1(a) (a)
#define vload(p) (*(p))
#define vstore(p, a) (*(p) = (a))
#define vfma(a, b, c) ((a) * (b) + (c))
#define vmul(a, b) ((a) * (b))
#define vadd(a, b) ((a) + (b))
#define vhsum(a) (a)
#define MRD 2
#define RN 2
#define TC 2
#define RT 4
#endif
#define NV (QK / VL)
/* Blocks of k per chunk of the tiled path: RT rows of them (fp32) in ~16 KiB of L1 (6 or 8 KiB
 * took 1.03-1.18x the time, 12 KiB 1.00-1.07x; one thread, AVX2 build, Zen 4). KEEP: where the sums kept between
 * chunks start in the scratch, in floats (64-byte aligned). */
#define KCB ((16 << 10) / (RT * QK * 4))
#define KEEP ((RT * KCB * QK + 15) / 16 * 16)

/* The 32 quants of block b as floats, unscaled (Q4_0: q - 8), into q[0 .. NV-1]. */
ALWAYS void raw_block(int qt, const uint8_t *b, V *q) {
#if QISA == 512
    if (qt == Q4_0 || qt == Q4_1) { /* byte j widened into lane j; the table lookup reads only
                                       the index's low 4 bits: nibble j, then (>> 4) j + 16 */
        const __m512 tbl =
            qt == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                       : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i v =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (qt == Q4_1 ? 4 : 2))));
        q[0] = _mm512_permutexvar_ps(v, tbl);
        q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
    } else {
        const uint8_t *p = qt == Q8_0 ? b + 2 : b;
        for (int j = 0; j < 2; j++)
            q[j] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * j))));
    }
#elif QISA == 256
    if (qt == Q4_0 || qt == Q4_1) { /* bytes 0-7 and 8-15 widened: elements 0-15 low, 16-31 high */
        const uint8_t *p = b + (qt == Q4_1 ? 4 : 2);
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
        const __m256i mask = _mm256_set1_epi32(15);
        const __m256i iv[4] = {_mm256_and_si256(lo, mask), _mm256_and_si256(hi, mask),
                               _mm256_srli_epi32(lo, 4), _mm256_srli_epi32(hi, 4)};
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtepi32_ps(qt == Q4_0 ? _mm256_sub_epi32(iv[j], _mm256_set1_epi32(8))
                                                 : iv[j]);
    } else {
        const uint8_t *p = qt == Q8_0 ? b + 2 : b;
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * j))));
    }
#else
    if (qt == Q4_0 || qt == Q4_1) {
        const uint8_t *p = b + (qt == Q4_1 ? 4 : 2);
        const int off = qt == Q4_0 ? 8 : 0;
        for (int j = 0; j < 16; j++) {
            q[j] = (float)((p[j] & 15) - off);
            q[j + 16] = (float)((p[j] >> 4) - off);
        }
    } else {
        const int8_t *p = (const int8_t *)(qt == Q8_0 ? b + 2 : b);
        for (int j = 0; j < 32; j++) q[j] = (float)p[j];
    }
#endif
}

/* The 32 values of block b (format qt; rs: the row's scale for I8) into w[0 .. NV-1]: the
 * quants times d (plus m), each operation rounded as fp32. */
ALWAYS void dequant_block(int qt, const uint8_t *b, float rs, V *w) {
    raw_block(qt, b, w);
    const V d = vset1(qt == I8 ? rs : f16_to_f32(b));
    if (qt == Q4_1) {
        const V m = vset1(f16_to_f32(b + 2));
        for (int j = 0; j < NV; j++) w[j] = vadd(vmul(w[j], d), m);
    } else {
        for (int j = 0; j < NV; j++) w[j] = vmul(w[j], d);
    }
}

#include "quant_direct.h"
#include "quant_int.h"

/* x[c] . w[r] over one chunk of k (kc values) for c < nc, r < nr: fp32 rows w (stride kc) from
 * scratch, x rows of stride K. The sums start at zero on the first chunk, else from keep; on the
 * last they go to out[c * RT + r], else back to keep (so each is one chain over all of k).
 * The empty asm holds each row of x and of w in a register for all its multiplies: left alone the
 * compiler folds the loads into the FMAs, 14 loads for 12 FMAs in the AVX2 build and every x
 * loaded again for each w in the AVX-512 one (which then took 1.5-1.9x the time). */
ALWAYS void tile_dot(const float *w, const float *x, int64_t K, int64_t kc, int nc, int nr,
                     V *keep, int first, int last, float *out) {
    V acc[TC][RT], xv[TC] = {vzero()}; /* xv's init: only for -Wmaybe-uninitialized */
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < nr; r++) acc[c][r] = first ? vzero() : keep[c * RT + r];
    for (int64_t k = 0; k < kc; k += VL) {
        for (int c = 0; c < nc; c++) {
            xv[c] = vload(x + c * K + k);
#if QISA
            __asm__("" : "+v"(xv[c]));
#endif
        }
        for (int r = 0; r < nr; r++) {
            V wv = vload(w + r * kc + k);
#if QISA
            __asm__("" : "+v"(wv));
#endif
            for (int c = 0; c < nc; c++) acc[c][r] = vfma(xv[c], wv, acc[c][r]);
        }
    }
#if QISA == 256
    if (last && nr == RT) { /* four sums at a time, each added up in vhsum's order */
        const V *a = &acc[0][0];
        int i = 0;
        for (; i + 4 <= nc * RT; i += 4)
            _mm_storeu_ps(out + i, hsum4(a[i], a[i + 1], a[i + 2], a[i + 3]));
        for (; i < nc * RT; i++) out[i] = vhsum(a[i]);
        return;
    }
#endif
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < nr; r++)
            if (last)
                out[c * RT + r] = vhsum(acc[c][r]);
            else
                keep[c * RT + r] = acc[c][r];
}

typedef struct {
    const float *x; /* [M, K] fp32 */
    const uint8_t *w;
    const float *scale; /* I8: [N] */
    const float *xs;    /* Q4_1, direct path: x's block sums [M, XS_STRIDE(K / 32)] */
    const void *bias;
    void *y;
    int64_t M, N, K, row_bytes;
    int qt, bf16;
} Problem;

static inline void store(const Problem *p, int64_t m, int64_t n, float v) {
    if (p->bias)
        v += p->bf16 ? bf16_to_f32(((const uint16_t *)p->bias)[n]) : ((const float *)p->bias)[n];
    if (p->bf16)
        ((uint16_t *)p->y)[m * p->N + n] = f32_to_bf16(v);
    else
        ((float *)p->y)[m * p->N + n] = v;
}

/* Dequantize blocks b0 .. b1-1 of rows n0 .. n0+nr-1 into dst (nr rows of (b1 - b0) * 32). */
ALWAYS void dequant_rows_qt(int qt, const uint8_t *w, const float *scale, int64_t row_bytes,
                            int64_t n0, int64_t nr, int64_t b0, int64_t b1, float *dst) {
    const int64_t bb = pdserve_quant_block_bytes(qt), kc = (b1 - b0) * QK;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *row = w + (n0 + r) * row_bytes;
        const float rs = scale ? scale[n0 + r] : 0.0f;
        for (int64_t b = b0; b < b1; b++) {
            V v[NV];
            dequant_block(qt, row + b * bb, rs, v);
            for (int j = 0; j < NV; j++) vstore(dst + r * kc + (b - b0) * QK + j * VL, v[j]);
        }
    }
}

ALWAYS void rows_qt(int qt, const Problem *p, int64_t n0, int64_t n1, float *scratch) {
    const int64_t bb = pdserve_quant_block_bytes(qt), K = p->K, M = p->M;
    float out[TC * RT > MRD * RN ? TC * RT : MRD * RN];
    if (!scratch) { /* direct: passes of at most MRD rows of x; one row: RN weight rows at once */
        for (int64_t n = n0; n < n1;) {
            const int nr = M == 1 && n1 - n >= RN ? RN : 1;
            const uint8_t *row = p->w + n * p->row_bytes;
            float rs[RN] = {0};
            for (int r = 0; r < nr && p->scale; r++) rs[r] = p->scale[n + r];
            for (int64_t m = 0; m < M; m += MRD) {
                const float *xs = p->xs ? p->xs + m * XS_STRIDE(K / QK) : NULL, *xm = p->x + m * K;
                const int mr = M - m < MRD ? (int)(M - m) : MRD;
                const int64_t rb = p->row_bytes;
                switch (nr == RN ? 0 : mr) {
                case 0: direct_rows(qt, bb, row, rb, RN, rs, xm, xs, K, 1, out); break;
#if MRD == 4
                case 4: direct_rows(qt, bb, row, rb, 1, rs, xm, xs, K, 4, out); break;
                case 3: direct_rows(qt, bb, row, rb, 1, rs, xm, xs, K, 3, out); break;
#endif
                case 2: direct_rows(qt, bb, row, rb, 1, rs, xm, xs, K, 2, out); break;
                default: direct_rows(qt, bb, row, rb, 1, rs, xm, xs, K, 1, out); break;
                }
                for (int r = 0; r < nr; r++)
                    for (int c = 0; c < mr; c++) store(p, m + c, n + r, out[r * mr + c]);
            }
            n += nr;
        }
        return;
    }
    /* tiled: k in chunks of at most KCB blocks, so that a tile of weights stays in L1 */
    const int64_t nb = K / QK, nk = (nb + KCB - 1) / KCB, kcb = (nb + nk - 1) / nk;
    V *keep = (V *)(scratch + KEEP);
    for (int64_t n = n0; n < n1; n += RT) {
        const int nr = n1 - n < RT ? (int)(n1 - n) : RT;
        if (n + RT < n1) { /* the next tile's weights, while this one is multiplied */
            const char *nx = (const char *)(p->w + (n + RT) * p->row_bytes);
            const int64_t bytes = (n1 - n - RT < RT ? n1 - n - RT : RT) * p->row_bytes;
            for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(nx + o, 0, 2);
        }
        for (int64_t b0 = 0; b0 < nb; b0 += kcb) {
            const int64_t b1 = b0 + kcb < nb ? b0 + kcb : nb, kc = (b1 - b0) * QK;
            const int first = b0 == 0, last = b1 == nb;
            dequant_rows_qt(qt, p->w, p->scale, p->row_bytes, n, nr, b0, b1, scratch);
            for (int64_t m = 0; m < M; m += TC) {
                const int nc = M - m < TC ? (int)(M - m) : TC;
                const float *xm = p->x + m * K + b0 * QK;
                V *kp = keep + m * RT;
                if (nr == RT) {
                    switch (nc) {
#if TC == 4
                    case 4: tile_dot(scratch, xm, K, kc, 4, RT, kp, first, last, out); break;
                    case 3: tile_dot(scratch, xm, K, kc, 3, RT, kp, first, last, out); break;
#endif
                    case 2: tile_dot(scratch, xm, K, kc, 2, RT, kp, first, last, out); break;
                    default: tile_dot(scratch, xm, K, kc, 1, RT, kp, first, last, out); break;
                    }
                } else { /* the last, partial tile */
                    tile_dot(scratch, xm, K, kc, nc, nr, kp, first, last, out);
                }
                if (last)
                    for (int c = 0; c < nc; c++)
                        for (int r = 0; r < nr; r++) store(p, m + c, n + r, out[c * RT + r]);
            }
        }
    }
}

static void rows_any(const Problem *p, int64_t n0, int64_t n1, float *scratch) {
    switch (p->qt) {
    case Q4_0: rows_qt(Q4_0, p, n0, n1, scratch); break;
    case Q4_1: rows_qt(Q4_1, p, n0, n1, scratch); break;
    case Q8_0: rows_qt(Q8_0, p, n0, n1, scratch); break;
    default: rows_qt(I8, p, n0, n1, scratch); break;
    }
}

/*
 * y = x @ dequant(w)^T (+ bias). x, bias, y: fp32 (dtype 0) or bf16 (1); w: N rows of row_bytes
 * (K / 32 blocks of format qt); scale: I8's per-row scales, else NULL. K must be a multiple of
 * 32. Returns 0; -1 if scratch memory could not be had; -2 for an unknown format or bad K.
 */
int pdserve_qlinear(const void *x, const uint8_t *w, int32_t qt, const float *scale,
                    const void *bias, void *y, int64_t M, int64_t N, int64_t K, int32_t dtype,
                    int32_t num_threads) {
    const int64_t bb = pdserve_quant_block_bytes(qt);
    if (!bb || K % QK) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int bf16 = dtype == 1;
    float *xf = NULL;
    if (bf16) {
        xf = malloc((size_t)(M * K) * sizeof *xf);
        if (!xf) return -1;
        for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    const int tiled = M > 2 * MRD;
    const float *xin = xf ? xf : (const float *)x;
    float *xs = NULL;
    if (qt == Q4_1 && !tiled) { /* the block sums of x, for m */
        const int64_t nb = K / QK, stride = XS_STRIDE(nb);
        xs = calloc((size_t)(M * stride), sizeof *xs);
        if (!xs) {
            free(xf);
            return -1;
        }
        for (int64_t r = 0; r < M; r++)
            for (int64_t b = 0; b < nb; b++) {
                float t = 0.0f;
                for (int j = 0; j < QK; j++) t += xin[(r * nb + b) * QK + j];
                xs[r * stride + b] = t;
            }
    }
    const Problem p = {xin, w, scale, xs, bias, y, M, N, K, (K / QK) * bb, qt, bf16};
    if ((double)M * N * K < MIN_PARALLEL || num_threads < 1) num_threads = 1;
    /* chunks of RT rows' multiples: ~64 KiB of weights, at least 4 chunks per thread */
    int64_t chunk = (64 << 10) / (p.row_bytes > 0 ? p.row_bytes : 1);
    const int64_t spread = (N + 4 * num_threads - 1) / (4 * num_threads);
    if (chunk > spread) chunk = spread;
    chunk = (chunk + RT - 1) / RT * RT;
    const int64_t num_chunks = (N + chunk - 1) / chunk;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = NULL;
        if (tiled) {
            /* a tile's chunk of weights, then the sums kept between chunks for every row */
            const size_t keep = (size_t)((M + TC - 1) / TC * TC) * RT * VL;
            scratch = aligned_alloc(64, (KEEP + keep) * sizeof(float) + 64);
            failed = !scratch;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_chunks; i++) {
            const int64_t n0 = i * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            if (!failed) rows_any(&p, n0, n1, scratch);
        }
        free(scratch);
    }
    free(xs);
    free(xf);
    return failed ? -1 : 0;
}

/*
 * dst[i, :] = dequant(w row ids[i]) for i < n (ids NULL: rows first .. first+n-1), fp32; used
 * for the embedding lookup, the prefill tiles and the tests. Returns -2 on a bad format or K.
 */
int pdserve_qdequant(const uint8_t *w, int32_t qt, const float *scale, const int64_t *ids,
                     int64_t first, int64_t n, int64_t K, float *dst, int32_t num_threads) {
    const int64_t bb = pdserve_quant_block_bytes(qt);
    if (!bb || K % QK) return -2;
    const int64_t row_bytes = (K / QK) * bb;
    if ((double)n * K < MIN_PARALLEL || num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids ? ids[i] : first + i;
        switch (qt) {
        case Q4_0: dequant_rows_qt(Q4_0, w, scale, row_bytes, r, 1, 0, K / QK, dst + i * K); break;
        case Q4_1: dequant_rows_qt(Q4_1, w, scale, row_bytes, r, 1, 0, K / QK, dst + i * K); break;
        case Q8_0: dequant_rows_qt(Q8_0, w, scale, row_bytes, r, 1, 0, K / QK, dst + i * K); break;
        default: dequant_rows_qt(I8, w, scale, row_bytes, r, 1, 0, K / QK, dst + i * K); break;
        }
    }
    return 0;
}

/* A quantized weight as the layer loop hands it over, in place of a packed bf16 weight; v: its
 * copy in quant_int.h's layout, or NULL. */
typedef struct {
    const uint8_t *w;
    const float *scale;
    int32_t qt;
    const uint8_t *v;
} QDesc;

/* layer_loop.c's linear_fn on a QDesc: bf16 x, bias and y. */
void pdserve_qlinear_desc(const void *x, const QDesc *d, const void *bias, void *y, int64_t M,
                          int64_t N, int64_t K, int32_t num_threads) {
    pdserve_qlinear(x, d->w, d->qt, d->scale, bias, y, M, N, K, 1, num_threads);
}

/* The same with fp32 x, bias and y (the fp32 layer loop's linear_fn). */
void pdserve_qlinear_desc_f32(const void *x, const QDesc *d, const void *bias, void *y, int64_t M,
                              int64_t N, int64_t K, int32_t num_threads) {
    if (d->v && M <= QV_MAX_ROWS &&
        !pdserve_qlinear_v(x, d->v, d->qt, bias, y, M, N, K, num_threads))
        return;
    pdserve_qlinear(x, d->w, d->qt, d->scale, bias, y, M, N, K, 0, num_threads);
}
