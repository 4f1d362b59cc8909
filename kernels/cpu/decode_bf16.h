/*
 * Decode attention on AVX512-BF16: part of paged_attention.c, which includes this file inside its
 * AVX512-BF16 section (it uses that file's Pool and row_index, exp512.h and ATTN_UNROLL); kept
 * apart only to keep each file readable.
 */
#ifndef PDSERVE_DECODE_BF16_H
#define PDSERVE_DECODE_BF16_H

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

/* Whether a sequence's context length or one of the block ids it uses is out of range. */
static int seq_bad(const Pool *p, const int32_t *blocks, int32_t context_len) {
    const int64_t used = ((int64_t)context_len + p->block_size - 1) / p->block_size;
    if (context_len < 0 || used > p->max_blocks) return 1;
    for (int64_t b = 0; b < used; b++)
        if (blocks[b] < 0 || blocks[b] >= p->num_blocks) return 1;
    return 0;
}

/*
 * Tokens [t_begin, t_end) of one sequence (t_begin a multiple of SPAN), every kv head: a token's
 * K (and V) rows of all kv heads are one contiguous run of the pool, so the part's blocks are read
 * front to back, once. (One task per kv head read a third of each row and measured 1.4x slower on
 * the default model's 3 kv heads.) Spans of 64 tokens: scores of 16 tokens at a time (qk16), one
 * softmax update per span and query head, then P @ V over the span. Leaves the part's softmax
 * state in part (PART_FLOATS of it): per query head its running max m, sum l and the output
 * accumulator (not yet divided by l, in pv_pairs' permuted order). The last span prefetches the
 * next piece of work: tokens next_t0.. of next_blocks (context next_len), if next_blocks.
 */
#define PART_FLOATS(num_heads, hd) ((num_heads) * ((hd) + 2))
static void decode_part_bf16(const Pool *p, const uint16_t *q, int64_t q_head_stride,
                             const int32_t *blocks, int64_t t_begin, int64_t t_end, float scale, float *part, int prefetched,
                             const int32_t *next_blocks, int64_t next_t0, int32_t next_len) {
    const int group = p->group, hd = p->head_dim, num_kv_heads = p->num_kv_heads;
    const int num_heads = group * num_kv_heads, row = num_kv_heads * hd;
    const int chunk = 16 / (hd / 16); /* query heads whose outputs fit in 16 registers */
    const uint16_t *k_cache = p->k_cache, *v_cache = p->v_cache;
    float *m = part, *l = part + num_heads, *acc = part + 2 * num_heads;
    uint32_t pairs[num_heads][SPAN / 2]; /* a span's probabilities as bf16 pairs */
    for (int h = 0; h < num_heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)num_heads * hd);
    int64_t rows[SPAN];
    for (int64_t t0 = t_begin; t0 < t_end; t0 += SPAN) {
        const int n = t_end - t0 < SPAN ? (int)(t_end - t0) : SPAN;
        const int tiles = (n + TOK - 1) / TOK;
        span_rows(p, blocks, t0, n, tiles * TOK, rows); /* ids checked by the caller */
        if (t0 == t_begin && !prefetched) touch_rows(k_cache, v_cache, rows, n, row);
        /* the next span goes into L2 in num_heads x SPAN/TOK parts, one per score tile below:
         * this part's, or after its last span the next piece of work's first */
        const int last = t0 + SPAN >= t_end;
        const int32_t *pf_blocks = last ? next_blocks : blocks;
        const int64_t next = last ? next_t0 : t0 + SPAN, pf_len = last ? next_len : t_end;
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
                    const int pt = h * (SPAN / TOK) + j;
                    if (pf_blocks && next < pf_len)
                        prefetch_span(p, pf_blocks, next + (int64_t)pt * SPAN / parts,
                                      next + (int64_t)(pt + 1) * SPAN / parts, pf_len);
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
}

/* A sequence's output from its nparts parts (decode_part_bf16, in token order): every part's
 * state scaled by exp(its max - the overall max) and summed in order, then divided by the sum.
 * One part is taken as it is, so a context of at most PART_TOKENS tokens gets exactly the single-pass
 * result; the split never depends on the batch or the thread count, so neither do the outputs.
 * bad (or no part): zeros. */
static void merge_parts_bf16(const float *parts, int64_t nparts, int num_heads, int hd, int bad,
                             uint16_t *out) {
    const int64_t stride = PART_FLOATS(num_heads, hd);
    for (int h = 0; h < num_heads; h++) {
        float sum[hd], o[hd], l = 0.0f;
        const float *one = parts + 2 * num_heads + (int64_t)h * hd;
        if (nparts < 1) {
            memset(sum, 0, sizeof sum);
        } else if (nparts == 1) {
            l = parts[num_heads + h];
            memcpy(sum, one, sizeof(float) * (size_t)hd);
        } else {
            float mx = -INFINITY;
            for (int64_t c = 0; c < nparts; c++)
                mx = parts[c * stride + h] > mx ? parts[c * stride + h] : mx;
            memset(sum, 0, sizeof sum);
            for (int64_t c = 0; c < nparts; c++) {
                const float *pc = parts + c * stride;
                const __m512 w = exp16_nonpos(_mm512_set1_ps(pc[h] - mx));
                l += _mm512_cvtss_f32(w) * pc[num_heads + h];
                for (int d = 0; d < hd; d += 16)
                    _mm512_storeu_ps(sum + d, _mm512_fmadd_ps(w, _mm512_loadu_ps(one + c * stride + d),
                                                              _mm512_loadu_ps(sum + d)));
            }
        }
        unpermute(sum, o, hd);
        const __m512 inv = _mm512_set1_ps((!bad && nparts > 0 && l > 0.0f) ? 1.0f / l : 0.0f);
        for (int d = 0; d < hd; d += 16)
            _mm256_storeu_si256((__m256i *)(out + h * hd + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(o + d))));
    }
}

#endif /* PDSERVE_DECODE_BF16_H */
