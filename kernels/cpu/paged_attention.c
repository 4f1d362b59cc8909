/*
 * Paged decode attention on CPU, reading K/V blocks in place from the paged pool.
 *
 * Pool layout (K and V alike): [num_blocks, block_size, num_kv_heads, head_dim], fp32 or bf16.
 * One task per (sequence, kv head) handles that kv head's `group` query heads together, so each
 * K/V row is read from memory once; tasks run in parallel with OpenMP. Softmax is online (running
 * max and sum per query head) in fp32, one tile of at most TILE tokens of a block at a time:
 *
 *     block b of the sequence:  rows t0 .. t0+n-1   (row stride num_kv_heads * head_dim)
 *     scores[h][t] = (q[h] * scale) . k[t]           h < group, t < n
 *     m' = max(m, max_t scores[h]); l = l * e^(m - m') + sum_t e^(scores[h][t] - m')
 *     acc[h] = acc[h] * e^(m - m') + sum_t e^(scores[h][t] - m') * v[t]
 *
 * bf16 rows are widened to fp32 (a 16-bit shift) into per-thread scratch once per tile; fp32
 * rows are read straight from the pool. The next block's rows are prefetched while this one runs.
 *
 * Built with GNU C vector extensions (gcc >= 9, clang): 8-lane fp32 vectors map to AVX/AVX2
 * registers (or two NEON registers), without -ffast-math, so exp keeps its accuracy. The score
 * and PV loops keep eight independent FMA chains in flight; one chain would wait on FMA latency.
 *
 * bf16 pools with head_dim 64 or 128 on CPUs with AVX512-BF16 take their own path (below,
 * decode_seq_bf16): one task per sequence, bf16 dot products (vdpbf16ps) for scores and P @ V.
 * On a 2-core Zen 4, 32 sequences x 600 tokens of the default model: 0.48 ms per layer with the
 * KV in cache, 0.76 / 0.93 ms from memory in contiguous / shuffled blocks, against 1.87 ms hot
 * for the widening path above (bench/kernels.py); since then the next span's prefetch was
 * spread over the span in use (prefetch_span), 0.76-0.83x of that time from memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 32 /* tokens per softmax tile; a multiple of 8 */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Unaligned, aliasing-safe vector access (memcpy here gets merged into byte-copy loops). */
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));

static inline v8f load8f(const float *p) { return *(const v8f_u *)p; }

static inline void store8f(float *p, v8f v) { *(v8f_u *)p = v; }

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float x) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* exp(x) for x <= 0 (Cephes expf: exp(x) = 2^n exp(r), |r| <= ln2/2, ~1 ulp); x < -87 -> 0. */
static inline v8f exp8_nonpos(v8f x) {
    const v8i keep = x > splat(-87.0f);
    x = (v8f)(((v8i)x & keep) | ((v8i)splat(-87.0f) & ~keep));
    v8f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    v8f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8f p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v8f y = p * r * r + r + 1.0f;
    v8i pow2n = (__builtin_convertvector(n, v8i) + 127) << 23;
    y = y * (v8f)pow2n;
    return (v8f)((v8i)y & keep);
}

/* Sum of each of 8 vectors: out[j] = sum of a[j]'s lanes (a transpose by shuffles, 21 ops). */
static inline v8f reduce8(const v8f *a) {
    v8f x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        y[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE(x[2 * i], x[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* scores[t] = q . k[t * stride] for t < n, 8 rows at a time (8 independent FMA chains); rows
 * past n repeat row n - 1 and their scores are set to -inf, up to the next multiple of 8. */
static inline void qk_tile(const float *restrict q, const float *restrict k, int64_t stride, int n,
                           int head_dim, float *restrict scores) {
    const int d8 = head_dim & ~7;
    for (int t0 = 0; t0 < n; t0 += 8) {
        const float *rows[8];
        for (int j = 0; j < 8; j++) rows[j] = k + (t0 + j < n ? t0 + j : n - 1) * stride;
        v8f a[8];
        for (int j = 0; j < 8; j++) a[j] = splat(0.0f);
        for (int d = 0; d < d8; d += 8) {
            const v8f qv = load8f(q + d);
            for (int j = 0; j < 8; j++) a[j] += qv * load8f(rows[j] + d);
        }
        v8f sum = reduce8(a);
        for (int d = d8; d < head_dim; d++)
            for (int j = 0; j < 8; j++) sum[j] += q[d] * rows[j][d];
        for (int j = n - t0; j < 8; j++) sum[j] = -INFINITY;
        store8f(scores + t0, sum);
    }
}

/* acc = acc * alpha + sum_t p[t] * v[t * stride] for t < n; 64 columns at a time so that eight
 * FMA chains run side by side. */
static inline void pv_tile(const float *restrict p, const float *restrict v, int64_t stride, int n,
                           int head_dim, float alpha, float *restrict acc) {
    int d = 0;
    for (; d + 64 <= head_dim; d += 64) {
        v8f a[8];
        for (int j = 0; j < 8; j++) a[j] = load8f(acc + d + 8 * j) * alpha;
        for (int t = 0; t < n; t++) {
            const v8f pt = splat(p[t]);
            const float *row = v + t * stride + d;
            for (int j = 0; j < 8; j++) a[j] += pt * load8f(row + 8 * j);
        }
        for (int j = 0; j < 8; j++) store8f(acc + d + 8 * j, a[j]);
    }
    for (; d + 8 <= head_dim; d += 8) {
        v8f a = load8f(acc + d) * alpha;
        for (int t = 0; t < n; t++) a += p[t] * load8f(v + t * stride + d);
        store8f(acc + d, a);
    }
    for (; d < head_dim; d++) {
        float a = acc[d] * alpha;
        for (int t = 0; t < n; t++) a += p[t] * v[t * stride + d];
        acc[d] = a;
    }
}

/* One tile of n rows of one kv head for its `group` query heads: online softmax update. */
static void attend_tile(const float *restrict qs, const float *k, const float *v, int64_t stride,
                        int n, int group, int head_dim, float *restrict scores, float *restrict m,
                        float *restrict l, float *restrict acc) {
    for (int h = 0; h < group; h++) {
        qk_tile(qs + (int64_t)h * head_dim, k, stride, n, head_dim, scores);
        float m_new = m[h];
        for (int t = 0; t < n; t++) m_new = scores[t] > m_new ? scores[t] : m_new;
        const float alpha = expf(m[h] - m_new); /* 0 on the first tile (m = -inf) */
        v8f sum = splat(0.0f);
        for (int t = 0; t < n; t += 8) {
            const v8f e = exp8_nonpos(load8f(scores + t) - m_new);
            store8f(scores + t, e);
            sum += e;
        }
        l[h] = l[h] * alpha + hsum8(sum);
        m[h] = m_new;
        pv_tile(scores, v, stride, n, head_dim, alpha, acc + (int64_t)h * head_dim);
    }
}

/* bf16 rows [n, head_dim] at stride -> contiguous fp32 (bf16 is the top half of an fp32). */
static void widen_rows(const uint16_t *src, int64_t stride, int n, int head_dim, float *dst) {
    const int d8 = head_dim & ~7;
    for (int t = 0; t < n; t++) {
        const uint16_t *row = src + t * stride;
        float *out = dst + (int64_t)t * head_dim;
        for (int d = 0; d < d8; d += 8) {
#if defined(__AVX2__) /* gcc splits __builtin_convertvector into 128-bit halves */
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + d)));
            _mm256_storeu_si256((__m256i *)(out + d), _mm256_slli_epi32(h, 16));
#else
            v8h h;
            memcpy(&h, row + d, sizeof h);
            const v8f f = (v8f)(__builtin_convertvector(h, v8u) << 16);
            memcpy(out + d, &f, sizeof f);
#endif
        }
        for (int d = d8; d < head_dim; d++) out[d] = bf16_to_f32(row[d]);
    }
}

/* Ask for one block's rows of one kv head ahead of use: they sit in a block of a shuffled pool
 * that the hardware prefetchers cannot guess. */
static inline void prefetch_rows(const char *k, const char *v, int64_t stride_bytes, int n,
                                 int row_bytes) {
    for (int t = 0; t < n; t++)
        for (int off = 0; off < row_bytes; off += 64) {
            __builtin_prefetch(k + t * stride_bytes + off);
            __builtin_prefetch(v + t * stride_bytes + off);
        }
}

typedef struct {
    const void *k_cache, *v_cache;
    int64_t num_blocks, max_blocks;
    int num_kv_heads, head_dim, block_size, group, bf16;
} Pool;

typedef struct { /* per-thread scratch */
    float *qs, *acc, *m, *l, *scores, *kbuf, *vbuf;
} Scratch;

/* Element offset of row `offset` of block `block`, kv head `kv_head`. */
static inline int64_t row_index(const Pool *p, int64_t block, int offset, int kv_head) {
    return ((block * p->block_size + offset) * p->num_kv_heads + kv_head) * p->head_dim;
}

/* One (sequence, kv head): q rows of its `group` query heads (stride q_head_stride elements)
 * -> out rows (contiguous). Returns 1 if the context length or a block id was out of range (the
 * output is then zeroed), else 0. */
static int decode_task(const Pool *p, const void *q, int64_t q_head_stride, const int32_t *blocks,
                       int32_t context_len, int kv_head, float scale, void *out, Scratch *w) {
    const int group = p->group, head_dim = p->head_dim, block_size = p->block_size;
    const int elem = p->bf16 ? 2 : 4;
    const int64_t stride = (int64_t)p->num_kv_heads * head_dim;
    for (int h = 0; h < group; h++) {
        for (int d = 0; d < head_dim; d++) {
            const int64_t i = h * q_head_stride + d;
            const float x = p->bf16 ? bf16_to_f32(((const uint16_t *)q)[i]) : ((const float *)q)[i];
            w->qs[h * head_dim + d] = x * scale;
            w->acc[h * head_dim + d] = 0.0f;
        }
        w->m[h] = -INFINITY;
        w->l[h] = 0.0f;
    }
    const int64_t used_blocks = ((int64_t)context_len + block_size - 1) / block_size;
    int bad = context_len < 0 || used_blocks > p->max_blocks;
    for (int64_t b = 0; !bad && b < used_blocks; b++) {
        const int64_t block = blocks[b];
        if (block < 0 || block >= p->num_blocks) {
            bad = 1;
            break;
        }
        const int64_t left = context_len - b * block_size;
        const int in_block = left < block_size ? (int)left : block_size;
        if (b + 1 < used_blocks && blocks[b + 1] >= 0 && blocks[b + 1] < p->num_blocks) {
            const int64_t next = row_index(p, blocks[b + 1], 0, kv_head) * elem;
            const int64_t next_left = left - block_size;
            prefetch_rows((const char *)p->k_cache + next, (const char *)p->v_cache + next,
                          stride * elem, next_left < block_size ? (int)next_left : block_size,
                          head_dim * elem);
        }
        for (int t0 = 0; t0 < in_block; t0 += TILE) {
            const int n = in_block - t0 < TILE ? in_block - t0 : TILE;
            const int64_t row = row_index(p, block, t0, kv_head);
            if (p->bf16) {
                widen_rows((const uint16_t *)p->k_cache + row, stride, n, head_dim, w->kbuf);
                widen_rows((const uint16_t *)p->v_cache + row, stride, n, head_dim, w->vbuf);
                attend_tile(w->qs, w->kbuf, w->vbuf, head_dim, n, group, head_dim, w->scores,
                            w->m, w->l, w->acc);
            } else {
                attend_tile(w->qs, (const float *)p->k_cache + row,
                            (const float *)p->v_cache + row, stride, n, group, head_dim,
                            w->scores, w->m, w->l, w->acc);
            }
        }
    }
    for (int h = 0; h < group; h++) {
        const float inv = (!bad && w->l[h] > 0.0f) ? 1.0f / w->l[h] : 0.0f;
        for (int d = 0; d < head_dim; d++) {
            const int64_t i = (int64_t)h * head_dim + d;
            const float x = w->acc[i] * inv;
            if (p->bf16)
                ((uint16_t *)out)[i] = f32_to_bf16(x);
            else
                ((float *)out)[i] = x;
        }
    }
    return bad;
}

#if defined(__AVX2__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
/*
 * bf16 pools on CPUs with AVX512-BF16 (head_dim 64 or 128). Tokens go 16 at a time, each by its
 * own row pointer (any block size; tiles may span blocks):
 *
 *   scores: vdpbf16ps of q[h] with k[t] straight from the pool (no widening), 16 tokens'
 *           accumulators reduced together by reduce16 into one register of 16 scores;
 *   softmax: online, per query head, 16 lanes at a time (exp16 below);
 *   P @ V:  in fp32: each V row widened once (a shift) and multiplied into every query head's
 *           output, which stays in registers (group x head_dim / 16 of them, heads taken in
 *           chunks that fit).
 *
 * The next tile's K and V rows are prefetched while one runs: blocks sit anywhere in the pool.
 */
#define ATTN_NATIVE 1
#include "exp512.h"
#define ATTN_UNROLL _Pragma("GCC unroll 16")

/* z[4 * c + r] = sum of every lane of a[4 * r + c], for c, r < 4 (as in linear.c). */
static inline __m512 reduce16_ps(const __m512 a[16]) {
    __m512 s[8], u[4], x[2];
    ATTN_UNROLL for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    ATTN_UNROLL for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    ATTN_UNROLL for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]),
                             _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[0]), _mm512_castps_pd(x[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[0]), _mm512_castps_pd(x[1]));
    return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

/* exp(x) for x <= 0, as exp8_nonpos, 16 lanes; x < -87 (and -inf) -> 0. */
static inline __m512 exp16_nonpos(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    return _mm512_maskz_mov_ps(keep, exp16_clamped(x, -87.0f, 0.0f));
}

#define TOK 16 /* tokens per tile: one register of scores */

/* scores[t] = scale * q . k[t] for t < TOK (rows[t] valid for every t), one query head. */
static inline __attribute__((always_inline)) __m512 qk16(const uint16_t *q, const uint16_t *const rows[TOK],
                                                         int hd, float scale) {
    __m512 a[16];
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q);
    const __m512bh q1 = hd > 32 ? (__m512bh)_mm512_loadu_si512(q + 32) : q0;
    const __m512bh q2 = hd > 64 ? (__m512bh)_mm512_loadu_si512(q + 64) : q0;
    const __m512bh q3 = hd > 96 ? (__m512bh)_mm512_loadu_si512(q + 96) : q0;
    ATTN_UNROLL for (int i = 0; i < 16; i++) {
        const uint16_t *k = rows[4 * (i & 3) + (i >> 2)]; /* a[4r + c] holds token 4c + r */
        __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(k));
        if (hd > 32) s = _mm512_dpbf16_ps(s, q1, (__m512bh)_mm512_loadu_si512(k + 32));
        if (hd > 64) s = _mm512_dpbf16_ps(s, q2, (__m512bh)_mm512_loadu_si512(k + 64));
        if (hd > 96) s = _mm512_dpbf16_ps(s, q3, (__m512bh)_mm512_loadu_si512(k + 96));
        a[i] = s;
    }
    return _mm512_mul_ps(reduce16_ps(a), _mm512_set1_ps(scale));
}

#define SPAN 64 /* tokens per online-softmax step: 4 registers of scores per query head */

/*
 * o[h] += sum_t p[h][t] * v[t] for query heads h < nh and tokens t < n, with vdpbf16ps over
 * token pairs: V rows t and t+1 interleaved (unpack lo/hi of 16-bit lanes) against the
 * probabilities (p_t, p_t+1) as a bf16 pair broadcast to every lane. The interleave leaves the
 * output dimensions permuted within each 32 (see unpermute); o stays in registers, nh * hd / 16
 * of them (nh chosen so they fit in 16).
 */
static inline __attribute__((always_inline)) void pv_pairs(const uint32_t pairs[][SPAN / 2],
                                                           const uint16_t *const rows[SPAN],
                                                           int n, int nh, int hd, float *out) {
    __m512 o[16];
    const int nv = hd / 16;
    ATTN_UNROLL for (int h = 0; h < 4; h++)
        ATTN_UNROLL for (int j = 0; j < 8; j++)
            if (h < nh && j < nv) o[h * nv + j] = _mm512_loadu_ps(out + h * hd + 16 * j);
    for (int t = 0; t < n; t += 2) {
        const uint16_t *r0 = rows[t], *r1 = rows[t + 1 < n ? t + 1 : t]; /* p_t+1 is 0 then */
        __m512bh v[8];
        ATTN_UNROLL for (int c = 0; c < 4; c++) {
            if (2 * c >= nv) break;
            const __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
            v[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
            v[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        ATTN_UNROLL for (int h = 0; h < 4; h++) {
            if (h >= nh) break;
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pairs[h][t / 2]);
            ATTN_UNROLL for (int j = 0; j < 8; j++)
                if (j < nv) o[h * nv + j] = _mm512_dpbf16_ps(o[h * nv + j], pp, v[j]);
        }
    }
    ATTN_UNROLL for (int h = 0; h < 4; h++)
        ATTN_UNROLL for (int j = 0; j < 8; j++)
            if (h < nh && j < nv) _mm512_storeu_ps(out + h * hd + 16 * j, o[h * nv + j]);
}

static void pv_pairs_any(const uint32_t pairs[][SPAN / 2], const uint16_t *const rows[SPAN],
                         int n, int nh, int hd, float *out) {
    if (hd == 64) {
        if (nh == 4) pv_pairs(pairs, rows, n, 4, 64, out);
        else if (nh == 3) pv_pairs(pairs, rows, n, 3, 64, out);
        else if (nh == 2) pv_pairs(pairs, rows, n, 2, 64, out);
        else pv_pairs(pairs, rows, n, 1, 64, out);
    } else {
        if (nh == 2) pv_pairs(pairs, rows, n, 2, 128, out);
        else pv_pairs(pairs, rows, n, 1, 128, out);
    }
}

/* pv_pairs' accumulators, registers 2c (unpack lo) and 2c+1 (hi), hold dimension
 * 32c + 8L + 4e + k in lane 4L + k (L: 128-bit lane, e: 0 lo / 1 hi): back to natural order. */
static inline void unpermute(const float *in, float *out, int hd) {
    __m512i idx[2];
    for (int half = 0; half < 2; half++) {
        int32_t ix[16];
        for (int i = 0; i < 16; i++) {
            const int d = 16 * half + i, L = d / 8, e = (d % 8) / 4, k = d % 4;
            ix[i] = 16 * e + 4 * L + k;
        }
        idx[half] = _mm512_loadu_si512(ix);
    }
    for (int c = 0; c < hd / 32; c++) {
        const __m512 lo = _mm512_loadu_ps(in + 32 * c), hi = _mm512_loadu_ps(in + 32 * c + 16);
        _mm512_storeu_ps(out + 32 * c, _mm512_permutex2var_ps(lo, idx[0], hi));
        _mm512_storeu_ps(out + 32 * c + 16, _mm512_permutex2var_ps(lo, idx[1], hi));
    }
}

/* Row offsets (kv head 0) of tokens t0 .. t0+count-1 of a sequence; past n: its last row again
 * (masked, or multiplied by a probability of 0). Returns 1 if a block id is out of range. Walks
 * the blocks (no division per token: those took a sixth of a hot span's time). */
static inline int span_rows(const Pool *p, const int32_t *blocks, int64_t t0, int n, int count,
                            int64_t *rows) {
    const int bs = p->block_size, row = p->num_kv_heads * p->head_dim;
    int64_t b = t0 / bs;
    int off = (int)(t0 % bs), t = 0;
    while (t < n) {
        const int64_t block = blocks[b];
        if (block < 0 || block >= p->num_blocks) return 1;
        const int64_t base = row_index(p, block, 0, 0);
        for (; off < bs && t < n; off++, t++) rows[t] = base + (int64_t)off * row;
        b++, off = 0;
    }
    for (; t < count; t++) rows[t] = rows[n - 1];
    return 0;
}

/* Read the first span's K and V rows (every kv head) front to back before using them: in address
 * order the hardware prefetchers stream them; read head by head (the compute order), the same
 * bytes came 1.5-2x slower (cold pools). Later spans were prefetched (prefetch_span). */
static inline void touch_rows(const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *rows, int n, int row) {
    __m512i sink = _mm512_setzero_si512();
    for (int t = 0; t < n; t++)
        for (int i = 0; i < row; i += 32) {
            sink = _mm512_or_si512(sink, _mm512_loadu_si512(k_cache + rows[t] + i));
            sink = _mm512_or_si512(sink, _mm512_loadu_si512(v_cache + rows[t] + i));
        }
    __asm__ volatile("" : : "v"(sink)); /* keep the loads */
}

/* Prefetch (into L2) the K and V rows of tokens t0 .. t1-1 (up to context_len), a run of one
 * block's consecutive rows at a time. decode_seq_bf16 asks for the next span in num_heads x 4
 * slices (36 for the default model), one per score tile of the span in use: the prefetches then never queue up behind each other (all
 * of a span at once, the old way, or into L1 measured slower), and with the rows already in L2
 * the span needs no touch_rows pass. 32 x 576 tokens, cold shuffled pools, 2-core Zen 4:
 * 0.755-0.82x the time of one prefetch per span plus touch_rows (the old and new kernel side by
 * side; `python -m bench.kernels --only attention` prints the "from memory" case). */
static inline void prefetch_span(const Pool *p, const int32_t *blocks, int64_t t0, int64_t t1,
                                 int64_t context_len) {
    const int bs = p->block_size, row_bytes = p->num_kv_heads * p->head_dim * 2;
    int64_t end = t1 < context_len ? t1 : context_len;
    if (end > p->max_blocks * bs) end = p->max_blocks * bs; /* a bad context_len: reported later */
    for (int64_t pos = t0; pos < end;) { /* a run of consecutive rows of one block at a time */
        const int64_t block = blocks[pos / bs];
        if (block < 0 || block >= p->num_blocks) return; /* reported when the span is read */
        const int off = (int)(pos % bs);
        const int64_t rows = bs - off < end - pos ? bs - off : end - pos;
        const int64_t r = row_index(p, block, off, 0);
        const char *k = (const char *)((const uint16_t *)p->k_cache + r);
        const char *v = (const char *)((const uint16_t *)p->v_cache + r);
        for (int64_t byte = 0; byte < rows * row_bytes; byte += 64) {
            _mm_prefetch(k + byte, _MM_HINT_T1);
            _mm_prefetch(v + byte, _MM_HINT_T1);
        }
        pos += rows;
    }
}

/*
 * One sequence, every kv head: a token's K (and V) rows of all kv heads are one contiguous run
 * of the pool, so the sequence's blocks are read front to back, once. (One task per kv head
 * read a third of each row and measured 1.4x slower on the default model's 3 kv heads.)
 * Spans of 64 tokens: scores of 16 tokens at a time (qk16), one softmax update per span and
 * query head, then P @ V over the span.
 */
static int decode_seq_bf16(const Pool *p, const uint16_t *q, int64_t q_head_stride,
                           const int32_t *blocks, int32_t context_len, float scale, uint16_t *out,
                           float *acc, int prefetched, const int32_t *next_blocks,
                           int32_t next_len) {
    const int group = p->group, hd = p->head_dim, num_kv_heads = p->num_kv_heads;
    const int num_heads = group * num_kv_heads, row = num_kv_heads * hd;
    const int chunk = 16 / (hd / 16); /* query heads whose outputs fit in 16 registers */
    const int64_t used_blocks = ((int64_t)context_len + p->block_size - 1) / p->block_size;
    const uint16_t *k_cache = p->k_cache, *v_cache = p->v_cache;
    int bad = context_len < 0 || used_blocks > p->max_blocks;
    float m[num_heads], l[num_heads];
    uint32_t pairs[num_heads][SPAN / 2]; /* a span's probabilities as bf16 pairs */
    for (int h = 0; h < num_heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)num_heads * hd);
    int64_t rows[SPAN];
    for (int64_t t0 = 0; !bad && t0 < context_len; t0 += SPAN) {
        const int n = context_len - t0 < SPAN ? (int)(context_len - t0) : SPAN;
        const int tiles = (n + TOK - 1) / TOK;
        if ((bad = span_rows(p, blocks, t0, n, tiles * TOK, rows))) break;
        if (t0 == 0 && !prefetched) touch_rows(k_cache, v_cache, rows, n, row);
        /* the next span goes into L2 in num_heads x SPAN/TOK parts, one per score tile below:
         * this sequence's, or after its last span the first of the thread's next sequence */
        const int last = t0 + SPAN >= context_len;
        const int32_t *pf_blocks = last ? next_blocks : blocks;
        const int64_t next = last ? 0 : t0 + SPAN, pf_len = last ? next_len : context_len;
        const int parts = num_heads * (SPAN / TOK);
        for (int g = 0; g < num_kv_heads; g++) {
            const uint16_t *krows[SPAN], *vrows[SPAN];
            for (int t = 0; t < tiles * TOK; t++) {
                krows[t] = k_cache + rows[t] + (int64_t)g * hd;
                vrows[t] = v_cache + rows[t] + (int64_t)g * hd;
            }
            for (int h = g * group; h < (g + 1) * group; h++) {
                __m512 s[SPAN / TOK];
                __m512 mx = _mm512_set1_ps(m[h]);
                for (int j = 0; j < tiles; j++) {
                    const int part = h * (SPAN / TOK) + j;
                    if (pf_blocks && next < pf_len)
                        prefetch_span(p, pf_blocks, next + (int64_t)part * SPAN / parts,
                                      next + (int64_t)(part + 1) * SPAN / parts, pf_len);
                    s[j] = qk16(q + h * q_head_stride, krows + j * TOK, hd, scale);
                    const int left = n - j * TOK;
                    if (left < TOK)
                        s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY),
                                                  (__mmask16)((1u << left) - 1), s[j]);
                    mx = _mm512_max_ps(mx, s[j]);
                }
                const float m_new = _mm512_reduce_max_ps(mx);
                const __m512 mv = _mm512_set1_ps(m_new);
                /* exp(m - m_new): 0 on the first span (m = -inf), 1 while the max holds */
                const float alpha = _mm512_cvtss_f32(exp16_nonpos(_mm512_sub_ps(_mm512_set1_ps(m[h]), mv)));
                __m512 sum = _mm512_setzero_ps();
                for (int j = 0; j < tiles; j++) {
                    const __m512 e = exp16_nonpos(_mm512_sub_ps(s[j], mv));
                    sum = _mm512_add_ps(sum, e);
                    _mm256_storeu_si256((__m256i *)(pairs[h] + 8 * j), (__m256i)_mm512_cvtneps_pbh(e));
                }
                if (tiles * TOK < SPAN) /* the pair of an odd n's last token: (p, 0) */
                    memset(pairs[h] + 8 * tiles, 0, sizeof(uint32_t) * (SPAN / 2 - 8 * tiles));
                l[h] = l[h] * alpha + _mm512_reduce_add_ps(sum);
                m[h] = m_new;
                if (alpha != 1.0f) {
                    const __m512 a = _mm512_set1_ps(alpha);
                    for (int d = 0; d < hd; d += 16)
                        _mm512_storeu_ps(acc + h * hd + d,
                                         _mm512_mul_ps(a, _mm512_loadu_ps(acc + h * hd + d)));
                }
            }
            for (int h0 = g * group; h0 < (g + 1) * group; h0 += chunk) {
                const int nh = (g + 1) * group - h0 < chunk ? (g + 1) * group - h0 : chunk;
                pv_pairs_any(pairs + h0, vrows, n, nh, hd, acc + (int64_t)h0 * hd);
            }
        }
    }
    for (int h = 0; h < num_heads; h++) {
        float o[hd];
        unpermute(acc + h * hd, o, hd);
        const __m512 inv = _mm512_set1_ps((!bad && l[h] > 0.0f) ? 1.0f / l[h] : 0.0f);
        for (int d = 0; d < hd; d += 16)
            _mm256_storeu_si256((__m256i *)(out + h * hd + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(o + d))));
    }
    return bad ? num_kv_heads : 0;
}
/*
 * Prefill (causal) attention for bf16 pools, head_dim 64 or 128, on AVX512-BF16.
 *
 * Phase 1, per (sequence, kv head): its keys and values, gathered from the paged pool into two
 * layouts that vdpbf16ps multiplies without any reduction across lanes:
 *
 *   kt[tile][p][16]   dword p (dims 2p, 2p+1) of each of a tile's 16 keys: scores of 16 keys
 *                     for one query = sum over p of (q's dword p broadcast) . kt[tile][p]
 *   vp[pair][d]       dims d of two consecutive values, interleaved: outputs 16 dims at a time
 *                     = sum over key pairs of (the pair's two probabilities broadcast) . vp
 *
 * (keys past the context are zero, their scores masked). Phase 2, per (sequence, kv head, block
 * of 16 queries): for each query head of the group, 4 queries at a time, spans of 64 keys up to
 * the diagonal: scores (16 accumulators: 4 queries x 4 key tiles), the causal mask, an online
 * softmax step, probabilities to bf16 pairs (as on GPUs), then P @ V into fp32 outputs.
 */
#define QB 16 /* queries per task */
#define QR 4  /* queries whose scores are computed together */

/* Gather keys 0 .. ctx-1 of kv head g into kt and values into vp (zero-padded to whole tiles). */
static int gather_kv_t(const Pool *p, const int32_t *blocks, int64_t ctx, int g, uint32_t *kt,
                       uint32_t *vp) {
    const int hd = p->head_dim, dw = hd / 2;
    const int64_t tiles = (ctx + TOK - 1) / TOK;
    memset(kt, 0, sizeof(uint32_t) * (size_t)(tiles * TOK * dw));
    memset(vp, 0, sizeof(uint32_t) * (size_t)(tiles * TOK * dw));
    for (int64_t t = 0; t < ctx; t++) {
        const int64_t block = blocks[t / p->block_size];
        if (block < 0 || block >= p->num_blocks) return 1;
        const int64_t row = row_index(p, block, (int)(t % p->block_size), g);
        const uint32_t *k = (const uint32_t *)((const uint16_t *)p->k_cache + row);
        const uint16_t *v = (const uint16_t *)p->v_cache + row;
        uint32_t *kd = kt + (t / TOK) * TOK * dw + t % TOK;
        for (int i = 0; i < dw; i++) kd[i * TOK] = k[i];
        uint16_t *vd = (uint16_t *)(vp + (t / 2) * hd) + (t & 1);
        for (int d = 0; d < hd; d++) vd[2 * d] = v[d];
    }
    return 0;
}

/* Queries r0 .. r0+nq-1 (nq <= QR) of query head h: rows of q at qrow[i] (bf16, head_dim),
 * absolute positions pos[i]; outputs (fp32, natural order) accumulated in o[i], then written. */
static inline __attribute__((always_inline)) void prefill_quad(
    const uint16_t *const qrow[QR], const int64_t pos[QR], int nq, const uint32_t *kt,
    const uint32_t *vp, int hd, float scale, uint16_t *const orow[QR]) {
    const int dw = hd / 2;
    float o[QR][hd];
    float m[QR], l[QR];
    uint32_t pairs[QR][SPAN / 2];
    for (int i = 0; i < QR; i++) {
        m[i] = -INFINITY, l[i] = 0.0f;
        memset(o[i], 0, sizeof o[i]);
    }
    const int64_t last = pos[nq - 1]; /* keys 0 .. last are visible to some query of the quad */
    for (int64_t k0 = 0; k0 <= last; k0 += SPAN) {
        const int tiles = (int)((last - k0) / TOK + 1 < SPAN / TOK ? (last - k0) / TOK + 1 : SPAN / TOK);
        __m512 s[QR][SPAN / TOK];
        ATTN_UNROLL for (int i = 0; i < QR; i++)
            ATTN_UNROLL for (int j = 0; j < SPAN / TOK; j++) s[i][j] = _mm512_setzero_ps();
        const uint32_t *kspan = kt + (k0 / TOK) * TOK * dw;
        for (int c = 0; c < dw; c++) {
            __m512bh qb[QR];
            ATTN_UNROLL for (int i = 0; i < QR; i++)
                qb[i] = (__m512bh)_mm512_set1_epi32(((const int32_t *)qrow[i < nq ? i : 0])[c]);
            ATTN_UNROLL for (int j = 0; j < SPAN / TOK; j++) {
                if (j >= tiles) break;
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(kspan + (j * dw + c) * TOK);
                ATTN_UNROLL for (int i = 0; i < QR; i++) s[i][j] = _mm512_dpbf16_ps(s[i][j], qb[i], kv);
            }
        }
        for (int i = 0; i < nq; i++) {
            __m512 mx = _mm512_set1_ps(m[i]);
            for (int j = 0; j < tiles; j++) {
                const int64_t key0 = k0 + j * TOK; /* keys key0 + lane; visible if <= pos[i] */
                const int64_t vis = pos[i] - key0 + 1;
                const __mmask16 mask = vis >= TOK ? (__mmask16)0xffff
                                       : vis <= 0 ? (__mmask16)0 : (__mmask16)((1u << vis) - 1);
                s[i][j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask,
                                             _mm512_mul_ps(s[i][j], _mm512_set1_ps(scale)));
                mx = _mm512_max_ps(mx, s[i][j]);
            }
            const float m_new = _mm512_reduce_max_ps(mx);
            const __m512 mv = _mm512_set1_ps(m_new);
            const float alpha = _mm512_cvtss_f32(exp16_nonpos(_mm512_sub_ps(_mm512_set1_ps(m[i]), mv)));
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < tiles; j++) {
                const __m512 e = exp16_nonpos(_mm512_sub_ps(s[i][j], mv));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(pairs[i] + 8 * j), (__m256i)_mm512_cvtneps_pbh(e));
            }
            l[i] = l[i] * alpha + _mm512_reduce_add_ps(sum);
            m[i] = m_new;
            if (alpha != 1.0f)
                for (int d = 0; d < hd; d += 16)
                    _mm512_storeu_ps(o[i] + d, _mm512_mul_ps(_mm512_set1_ps(alpha), _mm512_loadu_ps(o[i] + d)));
        }
        const int npairs = tiles * TOK / 2;
        for (int d0 = 0; d0 < hd; d0 += 64) { /* 4 queries x 4 registers of 16 dims */
            __m512 acc[QR][4];
            ATTN_UNROLL for (int i = 0; i < QR; i++)
                ATTN_UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm512_loadu_ps(o[i] + d0 + 16 * c);
            const uint32_t *vspan = vp + (k0 / 2) * hd + d0;
            for (int pr = 0; pr < npairs; pr++) {
                __m512bh v[4];
                ATTN_UNROLL for (int c = 0; c < 4; c++)
                    v[c] = (__m512bh)_mm512_loadu_si512(vspan + pr * hd + 16 * c);
                ATTN_UNROLL for (int i = 0; i < QR; i++) {
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pairs[i < nq ? i : 0][pr]);
                    ATTN_UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pp, v[c]);
                }
            }
            ATTN_UNROLL for (int i = 0; i < QR; i++)
                ATTN_UNROLL for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[i] + d0 + 16 * c, acc[i][c]);
        }
    }
    for (int i = 0; i < nq; i++) {
        const __m512 inv = _mm512_set1_ps(l[i] > 0.0f ? 1.0f / l[i] : 0.0f);
        for (int d = 0; d < hd; d += 16)
            _mm256_storeu_si256((__m256i *)(orow[i] + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(o[i] + d))));
    }
}

static void prefill_quad_any(const uint16_t *const qrow[QR], const int64_t pos[QR], int nq,
                             const uint32_t *kt, const uint32_t *vp, int hd, float scale,
                             uint16_t *const orow[QR]) {
    if (hd == 64)
        prefill_quad(qrow, pos, nq, kt, vp, 64, scale, orow);
    else
        prefill_quad(qrow, pos, nq, kt, vp, 128, scale, orow);
}

/*
 * q [num_tokens, num_heads, head_dim] (strides q_tok_stride, q_head_stride, 1), out contiguous
 * alike; sequence s owns tokens query_start[s] .. query_start[s+1]-1, the last of its
 * context_lens[s] positions (its earlier ones are a cached prefix). Returns the number of
 * sequences whose context or block ids were out of range (their outputs are zeroed), -1 if
 * scratch memory could not be had.
 */
int pdserve_prefill_attention_bf16(const uint16_t *q, const void *k_cache, const void *v_cache,
                                   const int32_t *block_tables, const int32_t *query_start,
                                   const int32_t *context_lens, uint16_t *out, int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t num_blocks, int64_t max_blocks,
                                   int64_t bt_stride, int64_t q_tok_stride, int64_t q_head_stride,
                                   float scale, int32_t num_threads) {
    const Pool pool = {k_cache, v_cache, num_blocks, max_blocks, (int)num_kv_heads,
                       (int)head_dim, (int)block_size, (int)(num_heads / num_kv_heads), 1};
    const int group = pool.group, hd = (int)head_dim;
    /* workspace: kt and vp of every (sequence, kv head); task list */
    int64_t words = 0, num_tasks = 0;
    int64_t *offset = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!offset) return -1;
    for (int64_t s = 0; s < num_seqs; s++) {
        offset[s] = words;
        const int64_t ctx = context_lens[s] > 0 ? context_lens[s] : 0;
        words += 2 * num_kv_heads * ((ctx + TOK - 1) / TOK) * TOK * (hd / 2);
        num_tasks += num_kv_heads * ((query_start[s + 1] - query_start[s] + QB - 1) / QB);
    }
    offset[num_seqs] = words;
    uint32_t *work = malloc(sizeof(uint32_t) * (size_t)(words + 1));
    int64_t *tasks = malloc(sizeof(int64_t) * 3 * (size_t)(num_tasks + 1));
    int *bad = calloc((size_t)num_seqs + 1, sizeof(int));
    if (!work || !tasks || !bad) {
        free(offset), free(work), free(tasks), free(bad);
        return -1;
    }
    int64_t t = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t nq = query_start[s + 1] - query_start[s];
        const int64_t ctx = context_lens[s];
        if (ctx < nq || ctx < 0 || (ctx + block_size - 1) / block_size > max_blocks) bad[s] = 1;
        for (int64_t b = 0; b < (nq + QB - 1) / QB; b++)
            for (int64_t g = 0; g < num_kv_heads; g++) {
                tasks[3 * t] = s, tasks[3 * t + 1] = b, tasks[3 * t + 2] = g;
                t++;
            }
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_seqs * num_kv_heads; i++) {
            const int64_t s = i / num_kv_heads;
            const int g = (int)(i % num_kv_heads);
            if (bad[s]) continue;
            const int64_t ctx = context_lens[s];
            const int64_t half = ((ctx + TOK - 1) / TOK) * TOK * (hd / 2);
            uint32_t *kt = work + offset[s] + 2 * g * half;
            if (gather_kv_t(&pool, block_tables + s * bt_stride, ctx, g, kt, kt + half))
                bad[s] = 1; /* benign race: only ever set to 1 */
        }
        /* implicit barrier: every sequence gathered (or marked bad) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = num_tasks - 1; i >= 0; i--) { /* the costliest (last) blocks first */
            const int64_t s = tasks[3 * i], b = tasks[3 * i + 1];
            const int g = (int)tasks[3 * i + 2];
            const int64_t q0 = query_start[s], nq_seq = query_start[s + 1] - q0;
            const int64_t prefix = context_lens[s] - nq_seq;
            const int64_t r0 = b * QB, r1 = r0 + QB < nq_seq ? r0 + QB : nq_seq;
            const int64_t ctx = context_lens[s] > 0 ? context_lens[s] : 0;
            const int64_t half = ((ctx + TOK - 1) / TOK) * TOK * (hd / 2);
            const uint32_t *kt = work + offset[s] + 2 * g * half, *vp = kt + half;
            for (int h = g * group; h < (g + 1) * group; h++) {
                for (int64_t r = r0; r < r1; r += QR) {
                    const int nq = r1 - r < QR ? (int)(r1 - r) : QR;
                    const uint16_t *qrow[QR];
                    uint16_t *orow[QR];
                    int64_t pos[QR];
                    for (int i = 0; i < QR; i++) {
                        const int64_t tok = q0 + r + (i < nq ? i : nq - 1);
                        qrow[i] = q + tok * q_tok_stride + h * q_head_stride;
                        orow[i] = out + (tok * num_heads + h) * hd;
                        pos[i] = prefix + r + (i < nq ? i : nq - 1);
                    }
                    if (bad[s]) {
                        for (int i = 0; i < nq; i++) memset(orow[i], 0, sizeof(uint16_t) * (size_t)hd);
                        continue;
                    }
                    prefill_quad_any(qrow, pos, nq, kt, vp, hd, scale, orow);
                }
            }
        }
    }
    int num_bad = 0;
    for (int64_t s = 0; s < num_seqs; s++) num_bad += bad[s];
    free(offset), free(work), free(tasks), free(bad);
    return num_bad;
}
#else
#define ATTN_NATIVE 0
#endif

/*
 * q [num_seqs, num_heads, head_dim] with strides (q_seq_stride, q_head_stride, 1); out contiguous
 * [num_seqs, num_heads, head_dim]; q, pools and out share one dtype (is_bf16). Block tables are
 * int32 with row stride bt_stride. Returns the number of (sequence, kv head) tasks whose block
 * table entry or context length was out of range (their output is zeroed), 0 when all is well.
 */
int pdserve_paged_decode_attention(
    const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
    const int32_t *context_lens, void *out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
    int64_t max_blocks, int64_t bt_stride, int64_t q_seq_stride, int64_t q_head_stride,
    float scale, int32_t is_bf16, int32_t num_threads) {
    const Pool pool = {k_cache,           v_cache,        num_blocks,
                       max_blocks,        (int)num_kv_heads, (int)head_dim,
                       (int)block_size,   (int)(num_heads / num_kv_heads), is_bf16 != 0};
    const int group = pool.group;
    const int64_t num_tasks = num_seqs * num_kv_heads;
    const int elem = is_bf16 ? 2 : 4;
    int64_t num_bad = 0;
#if ATTN_NATIVE
    const int native = is_bf16 && (head_dim == 64 || head_dim == 128);
#else
    const int native = 0;
#endif
#if ATTN_NATIVE
    if (native) {
        int64_t claimed = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : num_bad)
        {
            float acc[num_heads * head_dim]; /* per thread: every head's outputs in fp32 */
            /* sequences handed out one at a time, each thread claiming its next one as it starts
             * the current one: the current one's last span prefetches the next one's first */
            int64_t cur, nxt;
#pragma omp atomic capture
            cur = claimed++;
            for (int prefetched = 0; cur < num_seqs; cur = nxt, prefetched = 1) {
#pragma omp atomic capture
                nxt = claimed++;
                const int has_next = nxt < num_seqs;
                num_bad += decode_seq_bf16(&pool, (const uint16_t *)q + cur * q_seq_stride,
                                           q_head_stride, block_tables + cur * bt_stride,
                                           context_lens[cur], scale,
                                           (uint16_t *)out + cur * num_heads * head_dim, acc,
                                           prefetched, has_next ? block_tables + nxt * bt_stride : NULL,
                                           has_next ? context_lens[nxt] : 0);
            }
        }
        return (int)num_bad;
    }
#endif
#pragma omp parallel num_threads(num_threads) reduction(+ : num_bad)
    {
        float qs[group * head_dim], acc[group * head_dim], m[group], l[group], scores[TILE];
        float kbuf[is_bf16 ? TILE * head_dim : 1], vbuf[is_bf16 ? TILE * head_dim : 1];
        Scratch w = {qs, acc, m, l, scores, kbuf, vbuf};
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            const int64_t s = task / num_kv_heads;
            const int g = (int)(task % num_kv_heads);
            const char *q_task =
                (const char *)q + (s * q_seq_stride + (int64_t)g * group * q_head_stride) * elem;
            char *out_task = (char *)out + (s * num_heads + (int64_t)g * group) * head_dim * elem;
            num_bad += decode_task(&pool, q_task, q_head_stride, block_tables + s * bt_stride,
                                   context_lens[s], g, scale, out_task, &w);
        }
    }
    return (int)num_bad;
}

/* 1 if bf16 pools with head_dim 64 or 128 run on the AVX512-BF16 path. */
int pdserve_paged_attention_native(void) { return ATTN_NATIVE; }
