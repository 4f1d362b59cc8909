/*
 * Decode attention on AVX-512 and AVX2, the part that walks a sequence: its context in parts, the
 * parts' spans and prefetches, their merge and the threads' work. Included by paged_attention.c
 * after the tiles of its instruction set (decode_512.h, or decode_256.h for fp32 pools on AVX2:
 * t16 scores, qk16, P @ V), in the same section; written in those headers' t16 operations.
 */
#ifndef PDSERVE_DECODE_PARTS_H
#define PDSERVE_DECODE_PARTS_H

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
 * bytes came 1.5-2x slower (cold pools). Later spans were prefetched (prefetch_span). rows are
 * element offsets; a row is row_bytes long. */
static inline void touch_rows(const Pool *p, const int64_t *rows, int n, int row_bytes) {
    const int elem = p->bf16 ? 2 : 4;
    sink64 sink = sink64_zero();
    for (int t = 0; t < n; t++) {
        const char *k = (const char *)p->k_cache + rows[t] * elem;
        const char *v = (const char *)p->v_cache + rows[t] * elem;
        for (int i = 0; i < row_bytes; i += 64) sink = touch64(touch64(sink, k + i), v + i);
    }
    KEEP_SINK(sink); /* keep the loads */
}

/* Prefetch (into L2) the K and V rows of tokens t0 .. t1-1 (up to context_len), a run of one
 * block's consecutive rows at a time. decode_part asks for the next span in num_heads x 4
 * slices (36 for the default model), one per score tile of the span in use: the prefetches then
 * never queue up behind each other (all of a span at once, the old way, or into L1 measured
 * slower), and with the rows already in L2 the span needs no touch_rows pass. 32 x 576 tokens,
 * bf16, cold shuffled pools, 2-core Zen 4: 0.755-0.82x the time of one prefetch per span plus
 * touch_rows (the old and new kernel side by side; `python -m bench.kernels --only attention`
 * prints the "from memory" case). */
static inline void prefetch_span(const Pool *p, const int32_t *blocks, int64_t t0, int64_t t1,
                                 int64_t context_len) {
    const int bs = p->block_size, elem = p->bf16 ? 2 : 4;
    const int row_bytes = p->num_kv_heads * p->head_dim * elem;
    int64_t end = t1 < context_len ? t1 : context_len;
    if (end > p->max_blocks * bs) end = p->max_blocks * bs; /* a bad context_len: reported later */
    for (int64_t pos = t0; pos < end;) { /* a run of consecutive rows of one block at a time */
        const int64_t block = blocks[pos / bs];
        if (block < 0 || block >= p->num_blocks) return; /* reported when the span is read */
        const int off = (int)(pos % bs);
        const int64_t rows = bs - off < end - pos ? bs - off : end - pos;
        const int64_t r = row_index(p, block, off, 0) * elem;
        const char *k = (const char *)p->k_cache + r, *v = (const char *)p->v_cache + r;
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

/* bf16 pools under an fp32 query: each SPLIT dimensions of a query head as its even dimensions,
 * then its odd ones, the order bf16_even / bf16_odd leave a row's values in (the outputs are
 * accumulated in it too, and put back by unsplit_dims at the merge). */
static inline void split_dims(const float *in, float *out, int hd) {
    for (int c = 0; c < hd; c += SPLIT)
        for (int i = 0; i < SPLIT / 2; i++) {
            out[c + i] = in[c + 2 * i];
            out[c + SPLIT / 2 + i] = in[c + 2 * i + 1];
        }
}

static inline void unsplit_dims(const float *in, float *out, int hd) {
    for (int c = 0; c < hd; c += SPLIT)
        for (int i = 0; i < SPLIT / 2; i++) {
            out[c + 2 * i] = in[c + i];
            out[c + 2 * i + 1] = in[c + SPLIT / 2 + i];
        }
}

/*
 * Tokens [t_begin, t_end) of one sequence (t_begin a multiple of SPAN), every kv head: a token's
 * K (and V) rows of all kv heads are one contiguous run of the pool, so the part's blocks are read
 * front to back, once. (One task per kv head read a third of each row and measured 1.4x slower on
 * the default model's 3 kv heads.) Spans of 64 tokens: scores of 16 tokens at a time (qk16), one
 * softmax update per span and query head, then P @ V over the span. Leaves the part's softmax
 * state in part (PART_FLOATS of it): per query head its running max m, sum l and the output
 * accumulator (not yet divided by l; bf16 query: in pv_pairs' permuted order; fp32 query over
 * bf16 pools: in split_dims' order). q: bf16 (then so are the pools: bf16 dot products) or fp32
 * (pools fp32, or bf16 split into fp32 in registers).
 * The last span prefetches the next piece of work: tokens next_t0.. of next_blocks (context
 * next_len), if next_blocks.
 */
#define PART_FLOATS(num_heads, hd) ((num_heads) * ((hd) + 2))
static inline __attribute__((always_inline)) void decode_part_hd(
    const Pool *p, const void *q, int64_t q_head_stride, const int32_t *blocks, int64_t t_begin,
    int64_t t_end, float scale, float *part, int prefetched, const int32_t *next_blocks,
    int64_t next_t0, int32_t next_len, const int hd) {
    const int group = p->group, num_kv_heads = p->num_kv_heads;
    const int num_heads = group * num_kv_heads, row = num_kv_heads * hd, elem = p->bf16 ? 2 : 4;
    const int q_elem = p->q_bf16 ? 2 : 4, wide = p->bf16 && !p->q_bf16; /* wide: rows split */
    const int chunk = PV_HEADS(hd); /* query heads whose outputs stay in registers */
    const char *k_cache = p->k_cache, *v_cache = p->v_cache;
    float *m = part, *l = part + num_heads, *acc = part + 2 * num_heads;
    float probs[p->q_bf16 ? 1 : num_heads][SPAN];         /* a span's probabilities (fp32) */
    uint32_t pairs[p->q_bf16 ? num_heads : 1][SPAN / 2]; /* (bf16 query): as bf16 pairs */
    float qs[wide ? num_heads * hd : 1]; /* wide: the query heads in split_dims' order */
    for (int h = 0; wide && h < num_heads; h++)
        split_dims((const float *)q + h * q_head_stride, qs + h * hd, hd);
    for (int h = 0; h < num_heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)num_heads * hd);
    int64_t rows[SPAN];
    for (int64_t t0 = t_begin; t0 < t_end; t0 += SPAN) {
        const int n = t_end - t0 < SPAN ? (int)(t_end - t0) : SPAN;
        const int tiles = (n + TOK - 1) / TOK;
        span_rows(p, blocks, t0, n, tiles * TOK, rows); /* ids checked by the caller */
        if (t0 == t_begin && !prefetched) touch_rows(p, rows, n, row * elem);
        /* the next span goes into L2 in num_heads x SPAN/TOK parts, one per score tile below:
         * this part's, or after its last span the next piece of work's first */
        const int last = t0 + SPAN >= t_end;
        const int32_t *pf_blocks = last ? next_blocks : blocks;
        const int64_t next = last ? next_t0 : t0 + SPAN, pf_len = last ? next_len : t_end;
        const int parts = num_heads * (SPAN / TOK);
        for (int g = 0; g < num_kv_heads; g++) {
            const void *krows[SPAN], *vrows[SPAN];
            for (int t = 0; t < tiles * TOK; t++) {
                krows[t] = k_cache + (rows[t] + (int64_t)g * hd) * elem;
                vrows[t] = v_cache + (rows[t] + (int64_t)g * hd) * elem;
            }
            for (int h = g * group; h < (g + 1) * group; h++) {
                const char *qh = (const char *)q + h * q_head_stride * q_elem;
                t16 s[SPAN / TOK];
                t16 mx = t16_set1(m[h]);
                for (int j = 0; j < tiles; j++) {
                    const int pt = h * (SPAN / TOK) + j;
                    if (pf_blocks && next < pf_len)
                        prefetch_span(p, pf_blocks, next + (int64_t)pt * SPAN / parts,
                                      next + (int64_t)(pt + 1) * SPAN / parts, pf_len);
#if ATTN_NATIVE
                    if (p->q_bf16)
                        s[j] = qk16_bf16((const uint16_t *)qh, krows + j * TOK, hd, scale);
                    else
#endif
                    if (wide)
                        s[j] = qk16_split(qs + h * hd, krows + j * TOK, hd, scale);
                    else
                        s[j] = qk16_f32((const float *)qh, krows + j * TOK, hd, scale);
                    const int left = n - j * TOK;
                    if (left < TOK) s[j] = t16_first(s[j], left);
                    mx = t16_max(mx, s[j]);
                }
                const float m_new = t16_hmax(mx);
                const t16 mv = t16_set1(m_new);
                /* exp(m - m_new): 0 on the first span (m = -inf), 1 while the max holds */
                const float alpha = exp_nonpos(m[h] - m_new);
                t16 sum = t16_set1(0.0f);
                for (int j = 0; j < tiles; j++) {
                    const t16 e = t16_exp_nonpos(t16_sub(s[j], mv));
                    sum = t16_add(sum, e);
#if ATTN_NATIVE
                    if (p->q_bf16)
                        _mm256_storeu_si256((__m256i *)(pairs[h] + 8 * j), (__m256i)_mm512_cvtneps_pbh(e));
                    else
#endif
                        t16_store(probs[h] + TOK * j, e);
                }
                if (p->q_bf16 && tiles * TOK < SPAN) /* the pair of an odd n's last token: (p, 0) */
                    memset(pairs[h] + 8 * tiles, 0, sizeof(uint32_t) * (SPAN / 2 - 8 * tiles));
                l[h] = l[h] * alpha + t16_hsum(sum);
                m[h] = m_new;
                if (alpha != 1.0f) {
                    const t16 a = t16_set1(alpha);
                    for (int d = 0; d < hd; d += 16)
                        t16_store(acc + h * hd + d, t16_mul(a, t16_load(acc + h * hd + d)));
                }
            }
            for (int h0 = g * group; h0 < (g + 1) * group; h0 += chunk) {
                const int nh = (g + 1) * group - h0 < chunk ? (g + 1) * group - h0 : chunk;
#if ATTN_NATIVE
                if (p->q_bf16)
                    pv_pairs_any(pairs + h0, vrows, n, nh, hd, acc + (int64_t)h0 * hd);
                else
#endif
                    pv_f32_any(probs + h0, vrows, n, nh, hd, acc + (int64_t)h0 * hd, wide);
            }
        }
    }
}

/* decode_part_hd with head_dim (64 or 128) a constant: the loops over it unroll. */
static void decode_part(const Pool *p, const void *q, int64_t q_head_stride, const int32_t *blocks,
                        int64_t t_begin, int64_t t_end, float scale, float *part, int prefetched,
                        const int32_t *next_blocks, int64_t next_t0, int32_t next_len) {
    if (p->head_dim == 64)
        decode_part_hd(p, q, q_head_stride, blocks, t_begin, t_end, scale, part, prefetched,
                       next_blocks, next_t0, next_len, 64);
    else
        decode_part_hd(p, q, q_head_stride, blocks, t_begin, t_end, scale, part, prefetched,
                       next_blocks, next_t0, next_len, 128);
}

/* A sequence's output from its nparts parts (decode_part, in token order): every part's state
 * scaled by exp(its max - the overall max) and summed in order, then divided by the sum. One
 * part is taken as it is, so a context of at most PART_TOKENS tokens gets exactly the
 * single-pass result; the split never depends on the batch or the thread count, so neither do
 * the outputs. bad (or no part): zeros. out: the query's dtype. */
static void merge_parts(const Pool *p, const float *parts, int64_t nparts, int bad, void *out) {
    const int num_heads = p->group * p->num_kv_heads, hd = p->head_dim;
    const int64_t stride = PART_FLOATS(num_heads, hd);
    for (int h = 0; h < num_heads; h++) {
        float sum[hd], l = 0.0f;
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
                const float w = exp_nonpos(pc[h] - mx);
                const t16 wv = t16_set1(w);
                l += w * pc[num_heads + h];
                for (int d = 0; d < hd; d += 16)
                    t16_store(sum + d, t16_fmadd(wv, t16_load(one + c * stride + d), t16_load(sum + d)));
            }
        }
        const float inv = (!bad && nparts > 0 && l > 0.0f) ? 1.0f / l : 0.0f;
#if ATTN_NATIVE
        if (p->q_bf16) {
            float o[hd];
            unpermute(sum, o, hd);
            for (int d = 0; d < hd; d += 16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + h * hd + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_set1_ps(inv), _mm512_loadu_ps(o + d))));
            continue;
        }
#endif
        float unsplit[p->bf16 ? hd : 1]; /* fp32 query, bf16 pools: summed in split_dims' order */
        const float *res = sum;
        if (p->bf16) unsplit_dims(sum, unsplit, hd), res = unsplit;
        for (int d = 0; d < hd; d += 16)
            t16_store((float *)out + h * hd + d, t16_mul(t16_set1(inv), t16_load(res + d)));
    }
}

#ifdef _OPENMP
#include <omp.h>
#define TEAM_SIZE() omp_get_num_threads()
#else
#define TEAM_SIZE() 1
#endif

#define PART_TOKENS 128 /* tokens per part of a sequence (a multiple of SPAN) */

/* A thread's buffer of parts, kept for its next call (OpenMP's threads live on); NULL if out of
 * memory. */
static float *thread_parts(int64_t floats) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (floats > cap) {
        float *grown = realloc(buf, (size_t)floats * sizeof *grown);
        if (!grown) return NULL;
        buf = grown, cap = floats;
    }
    return buf;
}

static int64_t num_parts(int32_t context_len) { return ((int64_t)context_len + PART_TOKENS - 1) / PART_TOKENS; }
/* One past the last token of part c of a context of len tokens. */
static int64_t part_end(int64_t c, int32_t len) { return (c + 1) * PART_TOKENS < len ? (c + 1) * PART_TOKENS : len; }

/*
 * Each sequence's context in parts of PART_TOKENS tokens, merged in order (merge_parts), whoever
 * computes them. With at least 2 sequences per thread a thread takes a whole sequence at a time
 * (claiming the next as it starts one, whose first span its last span prefetches); with fewer
 * (batch 1 on 2 threads) the parts themselves are the tasks, so that every thread works, dealt
 * round robin so that a thread knows its next part and prefetches it the same way (fp32, batch 1,
 * 576-1,024 tokens, the Xeon without AVX512-BF16: 0.93-0.98x the time of taking them as they
 * came, `schedule(dynamic)`, whose first spans were read cold). q and
 * out: the query's dtype. Returns the (sequence, kv head) tasks refused, or -1 without scratch
 * memory.
 */
static int decode_by_parts(const Pool *p, const void *q, const int32_t *block_tables,
                      const int32_t *context_lens, void *out, int64_t num_seqs, int64_t bt_stride,
                      int64_t q_seq_stride, int64_t q_head_stride, float scale,
                      int32_t num_threads) {
    const int num_heads = p->group * p->num_kv_heads, hd = p->head_dim, elem = p->q_bf16 ? 2 : 4;
    const int64_t pf = PART_FLOATS(num_heads, hd), seq_out = (int64_t)num_heads * hd * elem;
    const int64_t q_seq = q_seq_stride * elem;
    const char *qb = q;
    char *ob = out;
    int64_t num_bad = 0;
    int oom = 0;
    if (num_seqs >= 2 * (int64_t)num_threads) {
        int64_t claimed = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : num_bad)
        {
            int64_t cur, nxt;
#pragma omp atomic capture
            cur = claimed++;
            for (int prefetched = 0; cur < num_seqs; cur = nxt, prefetched = 1) {
#pragma omp atomic capture
                nxt = claimed++;
                const int has_next = nxt < num_seqs;
                const int32_t *blocks = block_tables + cur * bt_stride, len = context_lens[cur];
                int bad = seq_bad(p, blocks, len);
                const int64_t n = bad ? 0 : num_parts(len);
                float *parts = thread_parts(n * pf);
                if (!parts && n) {
#pragma omp atomic write
                    oom = 1;
                    bad = 1;
                }
                for (int64_t c = 0; !bad && c < n; c++) {
                    const int64_t t1 = part_end(c, len);
                    const int more = c + 1 < n;
                    decode_part(p, qb + cur * q_seq, q_head_stride, blocks, c * PART_TOKENS, t1,
                                scale, parts + c * pf, c > 0 || prefetched,
                                more ? blocks : has_next ? block_tables + nxt * bt_stride : NULL,
                                more ? t1 : 0, more ? len : has_next ? context_lens[nxt] : 0);
                }
                merge_parts(p, parts, bad ? 0 : n, bad, ob + cur * seq_out);
                num_bad += bad ? p->num_kv_heads : 0;
            }
        }
        return oom ? -1 : (int)num_bad;
    }
    int64_t first[num_seqs + 1]; /* a sequence's first part; few sequences here */
    char bad[num_seqs > 0 ? num_seqs : 1];
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        bad[s] = (char)seq_bad(p, block_tables + s * bt_stride, context_lens[s]);
        first[s + 1] = first[s] + (bad[s] ? 0 : num_parts(context_lens[s]));
    }
    const int64_t total = first[num_seqs];
    float *parts = thread_parts(total * pf);
    if (!parts && total) return -1;
#pragma omp parallel num_threads(num_threads) reduction(+ : num_bad)
    {
        const int64_t team = TEAM_SIZE();
#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < total; task++) {
            int64_t s = 0;
            while (first[s + 1] <= task) s++;
            const int64_t c = task - first[s];
            const int32_t len = context_lens[s];
            const int64_t t1 = part_end(c, len);
            /* static, 1: this thread's next part is task + team; its first span is prefetched
             * while this part's last one runs, as a thread's next sequence is above */
            const int64_t next = task + team;
            int64_t s2 = s;
            while (next < total && first[s2 + 1] <= next) s2++;
            const int has_next = next < total;
            decode_part(p, qb + s * q_seq, q_head_stride, block_tables + s * bt_stride,
                        c * PART_TOKENS, t1, scale, parts + task * pf, task >= team,
                        has_next ? block_tables + s2 * bt_stride : NULL,
                        has_next ? (next - first[s2]) * PART_TOKENS : 0,
                        has_next ? context_lens[s2] : 0);
        }
#pragma omp for schedule(static)
        for (int64_t s = 0; s < num_seqs; s++) {
            merge_parts(p, parts + first[s] * pf, first[s + 1] - first[s], bad[s], ob + s * seq_out);
            num_bad += bad[s] ? p->num_kv_heads : 0;
        }
    }
    return (int)num_bad;
}

#endif /* PDSERVE_DECODE_PARTS_H */
