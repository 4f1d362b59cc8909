/*
 * Decode attention's tiles on AVX2 + FMA (no AVX-512): what decode_512.h gives decode_parts.h, for
 * an fp32 query over fp32 or bf16 pools (bf16 rows split into fp32 in registers) with head_dim 64 or
 * 128, so that AVX2 machines walk a context as AVX-512 ones do
 * (parts of 128 tokens, every kv head, the next span prefetched over the tiles of this one). Part
 * of paged_attention.c, which includes it in its AVX2 section (it uses that file's v8f, reduce8,
 * exp8_nonpos and ATTN_UNROLL).
 *
 *   a tile of 16 scores: two 8-lane registers; q . k[t] by 8 rows at a time (eight FMA chains),
 *           reduced by reduce8;
 *   P @ V:  up to 3 query heads at once over 32 output dimensions at a time (12 accumulators in
 *           registers), each V row's slice loaded once for all of them.
 */
#ifndef PDSERVE_DECODE_256_H
#define PDSERVE_DECODE_256_H

#define TOK 16 /* tokens per tile */
#define SPAN 64 /* tokens per online-softmax step */

typedef struct {
    __m256 lo, hi; /* tokens 0-7, 8-15 */
} t16;
#define PV_HEADS(hd) 3 /* query heads per P @ V pass (decode_parts.h) */
static inline t16 t16_set1(float x) {
    const __m256 v = _mm256_set1_ps(x);
    return (t16){v, v};
}
static inline t16 t16_load(const float *p) { return (t16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void t16_store(float *p, t16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline t16 t16_add(t16 a, t16 b) { return (t16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline t16 t16_sub(t16 a, t16 b) { return (t16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline t16 t16_mul(t16 a, t16 b) { return (t16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline t16 t16_max(t16 a, t16 b) { return (t16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline t16 t16_fmadd(t16 a, t16 b, t16 c) {
    return (t16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline float t16_hmax(t16 v) {
    const __m256 m = _mm256_max_ps(v.lo, v.hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
static inline float t16_hsum(t16 v) { return hsum8((v8f)_mm256_add_ps(v.lo, v.hi)); }
static inline t16 t16_exp_nonpos(t16 x) {
    return (t16){(__m256)exp8_nonpos((v8f)x.lo), (__m256)exp8_nonpos((v8f)x.hi)};
}
static inline float exp_nonpos(float x) { return exp8_nonpos(splat8(x))[0]; }
static inline t16 t16_first(t16 v, int n) { /* lanes n..15: -inf */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane));
    return (t16){_mm256_blendv_ps(ninf, v.lo, lo), _mm256_blendv_ps(ninf, v.hi, hi)};
}
typedef __m256i sink64;
static inline sink64 sink64_zero(void) { return _mm256_setzero_si256(); }
static inline sink64 touch64(sink64 s, const char *p) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_or_si256(s, _mm256_or_si256(a, _mm256_loadu_si256((const __m256i *)(p + 32))));
}
#define KEEP_SINK(s) __asm__ volatile("" : : "x"(s))

/* bf16 pools under an fp32 query: 16 bf16 values split into fp32 without a shuffle, the even
 * dimensions by a shift, the odd ones by a mask (decode_512.h's bf16_even / bf16_odd); the query
 * and the outputs go in that order (decode_parts.h's split_dims). */
#define SPLIT 16 /* dimensions per split: a register of bf16 values */
static inline v8f bf16_even(__m256i x) { return (v8f)_mm256_slli_epi32(x, 16); }
static inline v8f bf16_odd(__m256i x) {
    return (v8f)_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u));
}
static inline __m256i load16h(const void *r, int i) {
    return _mm256_loadu_si256((const __m256i *)((const uint16_t *)r + i));
}

/* scores[t] = scale * q . k[t] for t < TOK (rows[t] valid for every t), one fp32 query head; rows
 * fp32, or bf16 (split: q in split_dims' order). */
static inline __attribute__((always_inline)) t16 qk16_any(const float *q, const void *const rows[TOK],
                                                          int hd, float scale, int split) {
    v8f half[2];
    ATTN_UNROLL for (int i = 0; i < 2; i++) {
        v8f a[8];
        ATTN_UNROLL for (int j = 0; j < 8; j++) a[j] = splat8(0.0f);
        ATTN_UNROLL for (int d = 0; d < 128; d += 16) {
            if (d >= hd) break;
            const v8f q0 = load8f(q + d), q1 = load8f(q + d + 8);
            ATTN_UNROLL for (int j = 0; j < 8; j++) {
                const void *r = rows[8 * i + j];
                if (split) {
                    const __m256i x = load16h(r, d);
                    a[j] += q0 * bf16_even(x);
                    a[j] += q1 * bf16_odd(x);
                } else { /* as the 8 dimensions at a time it replaced: the same sums */
                    a[j] += q0 * load8f((const float *)r + d);
                    a[j] += q1 * load8f((const float *)r + d + 8);
                }
            }
        }
        half[i] = reduce8(a) * scale;
    }
    return (t16){(__m256)half[0], (__m256)half[1]};
}

static inline __attribute__((always_inline)) t16 qk16_f32(const float *q, const void *const rows[TOK],
                                                          int hd, float scale) {
    return qk16_any(q, rows, hd, scale, 0);
}

static inline __attribute__((always_inline)) t16 qk16_split(const float *qs, const void *const rows[TOK],
                                                            int hd, float scale) {
    return qk16_any(qs, rows, hd, scale, 1);
}

/* o[h] += sum_t p[h][t] * v[t] for query heads h < nh (<= 3) and tokens t < n, fp32 (split: bf16
 * rows split, o in split_dims' order): 32 output dimensions at a time, each V row's 32 loaded
 * once and multiplied into every head's. */
static inline __attribute__((always_inline)) void pv_f32(const float probs[][SPAN],
                                                         const void *const rows[SPAN], int n,
                                                         int nh, int hd, float *out, int split) {
    for (int d0 = 0; d0 < hd; d0 += 32) {
        __m256 o[3][4];
        ATTN_UNROLL for (int h = 0; h < 3; h++)
            ATTN_UNROLL for (int j = 0; j < 4; j++)
                if (h < nh) o[h][j] = _mm256_loadu_ps(out + h * hd + d0 + 8 * j);
        for (int t = 0; t < n; t++) {
            __m256 v[4];
            ATTN_UNROLL for (int j = 0; j < 4; j += 2) {
                if (split) {
                    const __m256i x = load16h(rows[t], d0 + 8 * j);
                    v[j] = (__m256)bf16_even(x), v[j + 1] = (__m256)bf16_odd(x);
                } else {
                    v[j] = _mm256_loadu_ps((const float *)rows[t] + d0 + 8 * j);
                    v[j + 1] = _mm256_loadu_ps((const float *)rows[t] + d0 + 8 * j + 8);
                }
            }
            ATTN_UNROLL for (int h = 0; h < 3; h++) {
                if (h >= nh) break;
                const __m256 pt = _mm256_set1_ps(probs[h][t]);
                ATTN_UNROLL for (int j = 0; j < 4; j++) o[h][j] = _mm256_fmadd_ps(pt, v[j], o[h][j]);
            }
        }
        ATTN_UNROLL for (int h = 0; h < 3; h++)
            ATTN_UNROLL for (int j = 0; j < 4; j++)
                if (h < nh) _mm256_storeu_ps(out + h * hd + d0 + 8 * j, o[h][j]);
    }
}

/* pv_f32 with nh, hd and split as constants, so that its loops unroll. */
#define PV_256(nh, hd)                                                                             \
    do {                                                                                           \
        if (split) pv_f32(probs, rows, n, nh, hd, out, 1);                                         \
        else pv_f32(probs, rows, n, nh, hd, out, 0);                                               \
    } while (0)

static void pv_f32_any(const float probs[][SPAN], const void *const rows[SPAN], int n, int nh,
                       int hd, float *out, int split) {
    if (hd == 64) {
        if (nh == 3) PV_256(3, 64);
        else if (nh == 2) PV_256(2, 64);
        else PV_256(1, 64);
    } else {
        if (nh == 3) PV_256(3, 128);
        else if (nh == 2) PV_256(2, 128);
        else PV_256(1, 128);
    }
}
#undef PV_256

#endif /* PDSERVE_DECODE_256_H */
