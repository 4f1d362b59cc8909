/*
 * Decode attention on AVX-512: part of paged_attention.c, which includes this file inside its
 * AVX-512 section (it uses that file's Pool and row_index, exp512.h and ATTN_UNROLL); kept apart
 * only to keep each file readable. fp32 pools take it on any AVX-512 CPU, and bf16 pools under an
 * fp32 query (rows split into fp32 in registers: bf16_even / bf16_odd); bf16 pools under a bf16
 * query where ATTN_NATIVE (AVX512-BF16) holds; head_dim 64 or 128.
 */
#ifndef PDSERVE_DECODE_512_H
#define PDSERVE_DECODE_512_H

/*
 * Tokens go 16 at a time, each by its own row pointer (any block size; tiles may span blocks):
 *
 *   scores: q[h] . k[t] with k[t] straight from the pool: fp32 FMAs (bf16 rows split, the query
 *           split alike), or vdpbf16ps for a bf16 query; 16 tokens' accumulators reduced together by reduce16 into one register of
 *           16 scores;
 *   softmax: online, per query head, 16 lanes at a time (exp16 below);
 *   P @ V:  in fp32 (bf16: vdpbf16ps over token pairs): each V row multiplied into every query
 *           head's output, which stays in registers (group x head_dim / 16 of them, heads taken
 *           in chunks that fit).
 *
 * decode_parts.h walks a sequence's parts with these and prefetches the next span while one
 * runs. On a 2-vCPU Xeon without AVX512-BF16 (fp32 pools, batch 1, 576 tokens, 30 layers' pools)
 * a layer took 0.71-0.75x the time of paged_attention.c's portable path from memory, 0.58-0.62x
 * with the KV in cache (docs/benchmarks.md, "The same Xeon, eleventh session").
 */

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

/* The 16-lane tile operations decode_parts.h is written in (decode_256.h: the same on AVX2). */
typedef __m512 t16;
#define PV_HEADS(hd) (16 / ((hd) / 16)) /* query heads whose P @ V outputs fit in 16 registers */
static inline t16 t16_set1(float x) { return _mm512_set1_ps(x); }
static inline t16 t16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void t16_store(float *p, t16 v) { _mm512_storeu_ps(p, v); }
static inline t16 t16_add(t16 a, t16 b) { return _mm512_add_ps(a, b); }
static inline t16 t16_sub(t16 a, t16 b) { return _mm512_sub_ps(a, b); }
static inline t16 t16_mul(t16 a, t16 b) { return _mm512_mul_ps(a, b); }
static inline t16 t16_max(t16 a, t16 b) { return _mm512_max_ps(a, b); }
static inline t16 t16_fmadd(t16 a, t16 b, t16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline float t16_hmax(t16 v) { return _mm512_reduce_max_ps(v); }
static inline float t16_hsum(t16 v) { return _mm512_reduce_add_ps(v); }
static inline t16 t16_exp_nonpos(t16 x) { return exp16_nonpos(x); }
static inline float exp_nonpos(float x) { return _mm512_cvtss_f32(exp16_nonpos(_mm512_set1_ps(x))); }
/* v's first n lanes; -inf in the rest (a tile's tokens past the part's end) */
static inline t16 t16_first(t16 v, int n) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << n) - 1), v);
}
/* touch_rows' loads: 64 bytes at p or-ed into a sink the compiler must keep */
typedef __m512i sink64;
static inline sink64 sink64_zero(void) { return _mm512_setzero_si512(); }
static inline sink64 touch64(sink64 s, const char *p) { return _mm512_or_si512(s, _mm512_loadu_si512(p)); }
#define KEEP_SINK(s) __asm__ volatile("" : : "v"(s))

/* scores[t] = scale * q . k[t] for t < TOK (rows[t] valid for every t), one query head: bf16
 * rows and query. */
#if ATTN_NATIVE
static inline __attribute__((always_inline)) __m512 qk16_bf16(const uint16_t *q, const void *const rows[TOK],
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
#endif

/* bf16 pools under an fp32 query (wide): a register of 32 bf16 values split into fp32 without a
 * shuffle, the even dimensions by a shift (each dword's low half to the top), the odd ones by a
 * mask (each dword's high half stays). The query is split the same way once per part and the
 * outputs are accumulated in that order (decode_parts.h's split_dims / unsplit_dims): the
 * zero-extending widening it replaces ran on the shuffle port, which the FMAs share. */
#define SPLIT 32 /* dimensions per split: a register of bf16 values */
static inline __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 bf16_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The same for an fp32 query and fp32 rows: 16-lane FMAs over head_dim. */
static inline __attribute__((always_inline)) t16 qk16_f32(const float *q, const void *const rows[TOK],
                                                             int hd, float scale) {
    __m512 a[16], qv[8];
    ATTN_UNROLL for (int c = 0; c < 8; c++) qv[c] = c < hd / 16 ? _mm512_loadu_ps(q + 16 * c) : _mm512_setzero_ps();
    ATTN_UNROLL for (int i = 0; i < 16; i++) {
        const float *k = rows[4 * (i & 3) + (i >> 2)]; /* a[4r + c] holds token 4c + r */
        __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        ATTN_UNROLL for (int c = 1; c < 8; c++)
            if (c < hd / 16) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), s);
        a[i] = s;
    }
    return _mm512_mul_ps(reduce16_ps(a), _mm512_set1_ps(scale));
}

/* The same for an fp32 query split (qs: split_dims) and bf16 rows split in registers. */
static inline __attribute__((always_inline)) t16 qk16_split(const float *qs, const void *const rows[TOK],
                                                               int hd, float scale) {
    __m512 a[16], qe[4], qo[4];
    ATTN_UNROLL for (int c = 0; c < 4; c++) {
        qe[c] = c < hd / 32 ? _mm512_loadu_ps(qs + 32 * c) : _mm512_setzero_ps();
        qo[c] = c < hd / 32 ? _mm512_loadu_ps(qs + 32 * c + 16) : _mm512_setzero_ps();
    }
    ATTN_UNROLL for (int i = 0; i < 16; i++) {
        const uint16_t *k = rows[4 * (i & 3) + (i >> 2)]; /* a[4r + c] holds token 4c + r */
        __m512i x = _mm512_loadu_si512(k);
        __m512 s = _mm512_fmadd_ps(qo[0], bf16_odd(x), _mm512_mul_ps(qe[0], bf16_even(x)));
        ATTN_UNROLL for (int c = 1; c < 4; c++)
            if (c < hd / 32) {
                x = _mm512_loadu_si512(k + 32 * c);
                s = _mm512_fmadd_ps(qo[c], bf16_odd(x), _mm512_fmadd_ps(qe[c], bf16_even(x), s));
            }
        a[i] = s;
    }
    return _mm512_mul_ps(reduce16_ps(a), _mm512_set1_ps(scale));
}

#define SPAN 64 /* tokens per online-softmax step: 4 registers of scores per query head */

/* fn(probs, rows, n, nh, hd, out) with nh (<= 64 / hd * 4) and hd (64 or 128) as constants, so
 * that its loops unroll and its accumulators stay in registers. */
#define PV_CONST(fn, probs, rows, n, nh, hd, out)                                                  \
    do {                                                                                           \
        if ((hd) == 64) {                                                                          \
            if ((nh) == 4) fn(probs, rows, n, 4, 64, out);                                         \
            else if ((nh) == 3) fn(probs, rows, n, 3, 64, out);                                    \
            else if ((nh) == 2) fn(probs, rows, n, 2, 64, out);                                    \
            else fn(probs, rows, n, 1, 64, out);                                                   \
        } else {                                                                                   \
            if ((nh) == 2) fn(probs, rows, n, 2, 128, out);                                        \
            else fn(probs, rows, n, 1, 128, out);                                                  \
        }                                                                                          \
    } while (0)

/*
 * o[h] += sum_t p[h][t] * v[t] for query heads h < nh and tokens t < n, with vdpbf16ps over
 * token pairs: V rows t and t+1 interleaved (unpack lo/hi of 16-bit lanes) against the
 * probabilities (p_t, p_t+1) as a bf16 pair broadcast to every lane. The interleave leaves the
 * output dimensions permuted within each 32 (see unpermute); o stays in registers, nh * hd / 16
 * of them (nh chosen so they fit in 16).
 */
#if ATTN_NATIVE
static inline __attribute__((always_inline)) void pv_pairs(const uint32_t pairs[][SPAN / 2],
                                                           const void *const rows[SPAN],
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

static void pv_pairs_any(const uint32_t pairs[][SPAN / 2], const void *const rows[SPAN],
                         int n, int nh, int hd, float *out) {
    PV_CONST(pv_pairs, pairs, rows, n, nh, hd, out);
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
#endif

/* o[h] += sum_t p[h][t] * v[t] for query heads h < nh and tokens t < n, fp32 (split: bf16 rows
 * split by bf16_even / bf16_odd, o in split_dims' order): each V row loaded once into registers
 * and multiplied into every query head's output, which stays in registers (nh * hd / 16 of them,
 * nh chosen so they fit in 16). */
static inline __attribute__((always_inline)) void pv_f32(const float probs[][SPAN],
                                                         const void *const rows[SPAN], int n,
                                                         int nh, int hd, float *out, int split) {
    __m512 o[16], v[8];
    const int nv = hd / 16;
    ATTN_UNROLL for (int h = 0; h < 4; h++)
        ATTN_UNROLL for (int j = 0; j < 8; j++)
            if (h < nh && j < nv) o[h * nv + j] = _mm512_loadu_ps(out + h * hd + 16 * j);
    for (int t = 0; t < n; t++) {
        ATTN_UNROLL for (int j = 0; j < 8; j += 2)
            if (j < nv) {
                if (split) {
                    const __m512i x = _mm512_loadu_si512((const uint16_t *)rows[t] + 16 * j);
                    v[j] = bf16_even(x), v[j + 1] = bf16_odd(x);
                } else {
                    v[j] = _mm512_loadu_ps((const float *)rows[t] + 16 * j);
                    v[j + 1] = _mm512_loadu_ps((const float *)rows[t] + 16 * j + 16);
                }
            }
        ATTN_UNROLL for (int h = 0; h < 4; h++) {
            if (h >= nh) break;
            const __m512 pt = _mm512_set1_ps(probs[h][t]);
            ATTN_UNROLL for (int j = 0; j < 8; j++)
                if (j < nv) o[h * nv + j] = _mm512_fmadd_ps(pt, v[j], o[h * nv + j]);
        }
    }
    ATTN_UNROLL for (int h = 0; h < 4; h++)
        ATTN_UNROLL for (int j = 0; j < 8; j++)
            if (h < nh && j < nv) _mm512_storeu_ps(out + h * hd + 16 * j, o[h * nv + j]);
}

static inline __attribute__((always_inline)) void pv_f32_rows(const float probs[][SPAN],
                                                              const void *const rows[SPAN], int n,
                                                              int nh, int hd, float *out) {
    pv_f32(probs, rows, n, nh, hd, out, 0);
}

static inline __attribute__((always_inline)) void pv_split(const float probs[][SPAN],
                                                           const void *const rows[SPAN], int n,
                                                           int nh, int hd, float *out) {
    pv_f32(probs, rows, n, nh, hd, out, 1);
}

static void pv_f32_any(const float probs[][SPAN], const void *const rows[SPAN], int n, int nh,
                       int hd, float *out, int split) {
    if (split)
        PV_CONST(pv_split, probs, rows, n, nh, hd, out);
    else
        PV_CONST(pv_f32_rows, probs, rows, n, nh, hd, out);
}

#endif /* PDSERVE_DECODE_512_H */
