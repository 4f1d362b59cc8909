/*
 * Paged decode attention on CPU, reading K/V blocks in place from the paged pool.
 *
 * Pool layout (K and V alike): [num_blocks, block_size, num_kv_heads, head_dim], fp32 or bf16.
 * The portable path splits each sequence's context into spans of SPAN_TOKENS, one task per
 * span over every kv head (a block's rows of all kv heads lie together, so a task reads them in
 * order); each kv head's `group` query heads go together, so each K/V row is read from memory
 * once. Tasks run in parallel with OpenMP, then each (sequence, kv head) merges its spans' running
 * maxima, sums and accumulators. One sequence thus keeps every thread busy (batch 1 used one
 * thread per kv head: 3 tasks for 2 threads), and a sequence's result does not depend on its
 * batch or the thread count. Softmax is online (running
 * max and sum per query head) in fp32, one tile of at most TILE tokens of a block at a time:
 *
 *     block b of the sequence:  rows t0 .. t0+n-1   (row stride num_kv_heads * head_dim)
 *     scores[h][t] = (q[h] * scale) . k[t]           h < group, t < n
 *     m' = max(m, max_t scores[h]); l = l * e^(m - m') + sum_t e^(scores[h][t] - m')
 *     acc[h] = acc[h] * e^(m - m') + sum_t e^(scores[h][t] - m') * v[t]
 *
 * bf16 rows are widened to fp32 (a 16-bit shift) into per-thread scratch once per tile; fp32
 * rows are read straight from the pool. The next block is prefetched while this one runs, a kv
 * head's share of it before each kv head's tiles.
 *
 * Built with GNU C vector extensions (gcc >= 9, clang): 8-lane fp32 vectors map to AVX/AVX2
 * registers (or two NEON registers), without -ffast-math, so exp keeps its accuracy. The score
 * and PV loops keep eight independent FMA chains in flight; one chain would wait on FMA latency.
 *
 * On AVX-512 CPUs, decode attention over pools with head_dim 64 or 128 takes decode_parts.h on
 * decode_512.h's tiles (included below: a sequence's context in parts read front to back, every kv
 * head at once, 16-lane scores and P @ V; bf16 pools there only with AVX512-BF16, as vdpbf16ps dot
 * products), fp32 pools on AVX2 the same walk on decode_256.h's tiles, and bf16 prefill attention
 * on AVX512-BF16 takes prefill_bf16.h; this path is for the rest.
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
#define KV_BF16 2 /* is_bf16's code for an fp32 query over bf16 pools */

#include "vec8.h" /* v8f, v8i, v8f_u, splat8, select8, widen_bf16_8, exp8_reduced */

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

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

/* exp(x) for x <= 0 (Cephes expf, vec8.h); x < -87 -> 0. */
static inline v8f exp8_nonpos(v8f x) {
    const v8i keep = x > splat8(-87.0f);
    v8f n;
    v8f y = exp8_reduced(select8(keep, x, splat8(-87.0f)), &n);
    y = y * (v8f)((__builtin_convertvector(n, v8i) + 127) << 23);
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
        for (int j = 0; j < 8; j++) a[j] = splat8(0.0f);
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
            const v8f pt = splat8(p[t]);
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
        v8f top = load8f(scores); /* rows past n are -inf */
        for (int t = 8; t < n; t += 8) {
            const v8f x = load8f(scores + t);
            top = (v8f)(((v8i)x & (x > top)) | ((v8i)top & ~(x > top)));
        }
        float m_new = m[h];
        for (int j = 0; j < 8; j++) m_new = top[j] > m_new ? top[j] : m_new;
        const float alpha = exp8_nonpos(splat8(m[h] - m_new))[0]; /* 0 on the first tile */
        v8f sum = splat8(0.0f);
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
        for (int d = 0; d < d8; d += 8) store8f(out + d, widen_bf16_8(row + d));
        for (int d = d8; d < head_dim; d++) out[d] = bf16_to_f32(row[d]);
    }
}

typedef struct {
    const void *k_cache, *v_cache;
    int64_t num_blocks, max_blocks;
    int num_kv_heads, head_dim, block_size, group;
    int bf16, q_bf16; /* pools bf16; query and output bf16 (then the pools are too) */
} Pool;

typedef struct { /* per-thread scratch */
    float *qs, *scores, *kbuf, *vbuf;
} Scratch;

/* Element offset of row `offset` of block `block`, kv head `kv_head`. */
static inline int64_t row_index(const Pool *p, int64_t block, int offset, int kv_head) {
    return ((block * p->block_size + offset) * p->num_kv_heads + kv_head) * p->head_dim;
}

/* Blocks of context each task of the portable path takes (a fixed number of tokens, so a
 * sequence's result does not depend on the batch it runs in or the thread count). */
#define SPAN_TOKENS 256

/* One task: blocks [b0, b1) of one sequence, every kv head, so the task reads its K/V rows in
 * the order they lie (a block's rows of all kv heads are contiguous). q: the sequence's query
 * heads at stride q_head_stride elements. Writes each kv head's part (part_size floats apart):
 * the running max m and sum l, and the unnormalised acc of each of its query heads
 * (merge_spans combines a sequence's spans). Returns 1 if a block id was out of range. */
static int decode_task(const Pool *p, const void *q, int64_t q_head_stride, const int32_t *blocks,
                       int32_t context_len, float scale, int64_t b0, int64_t b1,
                       float *restrict parts, int64_t part_size, Scratch *w) {
    const int group = p->group, head_dim = p->head_dim, block_size = p->block_size;
    const int kv = p->num_kv_heads, heads = kv * group, elem = p->bf16 ? 2 : 4;
    const int64_t stride = (int64_t)kv * head_dim;
    const int64_t block_bytes = block_size * stride * elem, slice = (block_bytes / kv + 63) & ~63;
    for (int h = 0; h < heads; h++) {
        float *part = parts + (h / group) * part_size;
        const int hg = h % group;
        for (int d = 0; d < head_dim; d++) {
            const int64_t i = h * q_head_stride + d;
            const float x = p->q_bf16 ? bf16_to_f32(((const uint16_t *)q)[i]) : ((const float *)q)[i];
            w->qs[h * head_dim + d] = x * scale;
            part[2 * group + hg * head_dim + d] = 0.0f;
        }
        part[hg] = -INFINITY;
        part[group + hg] = 0.0f;
    }
    for (int64_t b = b0; b < b1; b++) {
        const int64_t block = blocks[b];
        if (block < 0 || block >= p->num_blocks) return 1;
        const int64_t left = context_len - b * block_size;
        const int in_block = left < block_size ? (int)left : block_size;
        const int64_t next = b + 1 < b1 ? blocks[b + 1] : -1;
        for (int g = 0; g < kv; g++) {
            /* a kv head's share of the next block (blocks lie shuffled in the pool) */
            if (next >= 0 && next < p->num_blocks)
                for (int64_t off = g * slice; off < (g + 1) * slice && off < block_bytes; off += 64) {
                    __builtin_prefetch((const char *)p->k_cache + next * block_bytes + off);
                    __builtin_prefetch((const char *)p->v_cache + next * block_bytes + off);
                }
            float *part = parts + g * part_size;
            float *m = part, *l = part + group, *acc = part + 2 * group;
            const float *qs = w->qs + (int64_t)g * group * head_dim;
            for (int t0 = 0; t0 < in_block; t0 += TILE) {
                const int n = in_block - t0 < TILE ? in_block - t0 : TILE;
                const int64_t row = row_index(p, block, t0, g);
                if (p->bf16) {
                    widen_rows((const uint16_t *)p->k_cache + row, stride, n, head_dim, w->kbuf);
                    widen_rows((const uint16_t *)p->v_cache + row, stride, n, head_dim, w->vbuf);
                    attend_tile(qs, w->kbuf, w->vbuf, head_dim, n, group, head_dim, w->scores, m,
                                l, acc);
                } else {
                    attend_tile(qs, (const float *)p->k_cache + row,
                                (const float *)p->v_cache + row, stride, n, group, head_dim,
                                w->scores, m, l, acc);
                }
            }
        }
    }
    return 0;
}

/* One (sequence, kv head) whose spans' parts lie at part, part + part_size, ...: out rows
 * (contiguous) = the softmax-weighted sum over all its spans, zeroed if `bad`. */
static void merge_spans(const Pool *p, const float *part, int64_t part_size, int64_t spans,
                        int bad, void *out) {
    const int group = p->group, head_dim = p->head_dim;
    for (int h = 0; h < group; h++) {
        float top = -INFINITY, l = 0.0f;
        for (int64_t c = 0; c < spans; c++) top = fmaxf(top, part[c * part_size + h]);
        float acc[head_dim];
        for (int d = 0; d < head_dim; d++) acc[d] = 0.0f;
        for (int64_t c = 0; c < spans; c++) {
            const float *pc = part + c * part_size;
            const float f = spans == 1 ? 1.0f : exp8_nonpos(splat8(pc[h] - top))[0];
            l += pc[group + h] * f;
            for (int d = 0; d < head_dim; d++) acc[d] += pc[2 * group + h * head_dim + d] * f;
        }
        const float inv = (!bad && l > 0.0f) ? 1.0f / l : 0.0f;
        for (int d = 0; d < head_dim; d++) {
            const float x = acc[d] * inv;
            if (p->q_bf16)
                ((uint16_t *)out)[h * head_dim + d] = f32_to_bf16(x);
            else
                ((float *)out)[h * head_dim + d] = x;
        }
    }
}

#include "prefill_walk.h" /* the walk of both prefill attention kernels */
#define ATTN_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX2__) && defined(__AVX512F__)
#define ATTN_512 1 /* decode attention for fp32 pools (and bf16 ones with ATTN_NATIVE) */
#if defined(PDSERVE_EMULATE_AVX512BF16) && !defined(__AVX512BF16__) /* tests only */
#include "bf16_emulated.h"
#define ATTN_BF16 1
#elif defined(__AVX512BF16__)
#define ATTN_BF16 1
#else
#define ATTN_BF16 0
#endif
#if ATTN_BF16 && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define ATTN_NATIVE 1
#else
#define ATTN_NATIVE 0
#endif
#include "exp512.h"
#include "decode_512.h"   /* decode attention's tiles: scores, softmax, P @ V */
#include "decode_parts.h" /* and its walk: parts of a sequence, every kv head, the threads */
#if ATTN_NATIVE
#include "prefill_bf16.h" /* prefill attention */
#endif
#define ATTN_PARTS 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ATTN_512 0
#define ATTN_NATIVE 0
#include "decode_256.h"   /* fp32 pools: the same walk on 8-lane registers */
#include "decode_parts.h"
#define ATTN_PARTS 1
#else
#define ATTN_512 0
#define ATTN_NATIVE 0
#define ATTN_PARTS 0
#endif
#include "prefill_f32.h" /* fp32 prefill attention, every build */

/*
 * q [num_seqs, num_heads, head_dim] with strides (q_seq_stride, q_head_stride, 1); out contiguous
 * [num_seqs, num_heads, head_dim]. is_bf16: 0 q, pools and out fp32; 1 all bf16; 2 (KV_BF16) q
 * and out fp32 over bf16 pools (an fp32 model's bf16 KV cache: rows widened). Block tables are
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
                       (int)block_size,   (int)(num_heads / num_kv_heads), is_bf16 != 0,
                       is_bf16 == 1};
    const int group = pool.group;
    const int elem = pool.q_bf16 ? 2 : 4; /* q and out */
    int64_t num_bad = 0;
#if ATTN_PARTS
    if ((pool.q_bf16 ? ATTN_NATIVE : 1) && (head_dim == 64 || head_dim == 128))
        return decode_by_parts(&pool, q, block_tables, context_lens, out, num_seqs, bt_stride,
                               q_seq_stride, q_head_stride, scale, num_threads);
#endif
    /* Portable path: a task per SPAN_TOKENS of a sequence (every kv head), so that even one
     * sequence keeps every thread busy; then each (sequence, kv head) merges its spans. */
    const int64_t span_blocks = (SPAN_TOKENS + block_size - 1) / block_size;
    int64_t *first = malloc((size_t)(num_seqs + 1) * sizeof *first); /* first span of a seq */
    if (!first) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t used = ((int64_t)context_lens[s] + block_size - 1) / block_size;
        const int64_t spans = context_lens[s] > 0 && used <= max_blocks
                                  ? (used + span_blocks - 1) / span_blocks : 1;
        first[s + 1] = first[s] + spans;
    }
    const int64_t num_spans = first[num_seqs], part_size = group * (head_dim + 2);
    int64_t *seq_of = malloc((size_t)num_spans * sizeof *seq_of);
    float *parts = malloc((size_t)(num_spans * num_kv_heads * part_size) * sizeof *parts);
    char *bad = malloc((size_t)num_spans); /* every span writes its flag */
    if (!seq_of || !parts || !bad) {
        free(first), free(seq_of), free(parts), free(bad);
        return -1;
    }
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t c = first[s]; c < first[s + 1]; c++) seq_of[c] = s;
#pragma omp parallel num_threads(num_threads) reduction(+ : num_bad)
    {
        float qs[num_heads * head_dim], scores[TILE];
        float kbuf[is_bf16 ? TILE * head_dim : 1], vbuf[is_bf16 ? TILE * head_dim : 1];
        Scratch w = {qs, scores, kbuf, vbuf};
#pragma omp for schedule(dynamic, 1)
        for (int64_t span = 0; span < num_spans; span++) {
            const int64_t s = seq_of[span];
            const int32_t len = context_lens[s];
            const int64_t used = ((int64_t)len + block_size - 1) / block_size;
            const int64_t b0 = (span - first[s]) * span_blocks;
            const int64_t b1 = b0 + span_blocks < used ? b0 + span_blocks : used;
            float *part = parts + span * num_kv_heads * part_size;
            if (len < 0 || used > max_blocks) {
                bad[span] = 1;
                for (int64_t i = 0; i < num_kv_heads * part_size; i++) part[i] = 0.0f;
                continue;
            }
            bad[span] = (char)decode_task(&pool, (const char *)q + s * q_seq_stride * elem,
                                          q_head_stride, block_tables + s * bt_stride, len, scale,
                                          b0, b1, part, part_size, &w);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
            const int64_t s = task / num_kv_heads, g = task % num_kv_heads;
            const int64_t spans = first[s + 1] - first[s];
            int any = 0;
            for (int64_t c = first[s]; c < first[s + 1]; c++) any |= bad[c];
            num_bad += any;
            char *out_task = (char *)out + (s * num_heads + g * group) * head_dim * elem;
            merge_spans(&pool, parts + (first[s] * num_kv_heads + g) * part_size,
                        num_kv_heads * part_size, spans, any, out_task);
        }
    }
    free(first), free(seq_of), free(parts), free(bad);
    return (int)num_bad;
}

/* 1 if bf16 pools with head_dim 64 or 128 run on the AVX512-BF16 path. */
int pdserve_paged_attention_native(void) { return ATTN_NATIVE; }

/* 1 if fp32 pools with head_dim 64 or 128 run on the AVX-512 path (decode_512.h). */
int pdserve_paged_attention_f32_512(void) { return ATTN_512; }

/* 1 if fp32 pools with head_dim 64 or 128 run in parts (decode_parts.h: AVX-512 or AVX2). */
int pdserve_paged_attention_f32_parts(void) { return ATTN_PARTS; }
