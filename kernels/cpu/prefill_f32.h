/*
 * Prefill attention for fp32 queries: part of paged_attention.c, which includes this file after
 * its portable helpers (Pool, row_index, the v8f loads and stores, bf16_to_f32, hsum8 and
 * exp8_nonpos); kept apart only to keep each file readable. Every build has it: 8-lane GNU C
 * vectors are AVX2 registers (half an AVX-512 one, two SSE ones in a build without AVX).
 */
#ifndef PDSERVE_PREFILL_F32_H
#define PDSERVE_PREFILL_F32_H

/*
 * Prefill (causal) attention, fp32 queries and outputs over fp32 or bf16 pools (an fp32 model's
 * KV cache; bf16 widened exactly), head_dim a multiple of 16 up to 256.
 *
 * Phase 1, per (sequence, kv head): its keys gathered from the paged pool into tiles of 8 keys,
 * dims outer (kt[tile][d][8]: the scores of 8 keys for one query = sum over d of q[d] broadcast
 * times one vector, no reduction across lanes), its values into contiguous rows (vr[t][d]); keys
 * and values past the context are zero. Phase 2, per (sequence, block of 16 queries, kv head):
 * for each query head of the group, 4 queries at a time (pf_quad), the keys up to the diagonal
 * in chunks of up to 512: the raw scores of 4 queries x 3 tiles at a time (12 accumulators, as
 * many FMA chains), one maximum per query and chunk, the probabilities exp(scale (s - max)) in
 * place of the scores, then P @ V 16 dims at a time (8 accumulators), rescaling what earlier
 * chunks summed only between chunks (online softmax). A query's arithmetic does not depend on
 * the other queries of its quad or task: keys it does not see add exact zeros.
 *
 * Why: torch's SDPA (its CPU flash attention, fp32) ran 512 tokens x 9 heads (3 KV heads) of the
 * default model at ~62 GFLOP/s on the 2-core Zen 4 with AVX2 code, 4.9 ms a layer, 19 % of a
 * 512-token prefill whose projections run at 145-205 (docs/benchmarks.md).
 */
#define PF_TOK 8     /* keys per tile: one vector of scores */
#define PF_QR PW_QR  /* queries whose scores are computed together (prefill_walk.h's quads) */
#define PF_NT 3      /* key tiles per pass of the score loop */
#define PF_CHUNK 512 /* keys per softmax pass: a quad's scores (4 x 2 KB) stay in L1 */

/* Keys 0 .. ctx-1 of kv head g into kt (tiles of PF_TOK keys, dims outer) and values into vr
 * (rows), zero up to a whole tile. Returns 1 if a block id is out of range. */
static int pf_gather(const Pool *p, const int32_t *blocks, int64_t ctx, int g, uint32_t *kt_words,
                     uint32_t *vr_words) {
    float *kt = (float *)kt_words, *vr = (float *)vr_words;
    const int hd = p->head_dim;
    const int64_t padded = (ctx + PF_TOK - 1) / PF_TOK * PF_TOK;
    for (int64_t t = 0; t < padded; t++) {
        float *kd = kt + (t / PF_TOK) * PF_TOK * hd + t % PF_TOK, *vd = vr + t * hd;
        if (t >= ctx) {
            for (int d = 0; d < hd; d++) kd[d * PF_TOK] = 0.0f;
            memset(vd, 0, sizeof(float) * (size_t)hd);
            continue;
        }
        const int64_t block = blocks[t / p->block_size];
        if (block < 0 || block >= p->num_blocks) return 1;
        const int64_t row = row_index(p, block, (int)(t % p->block_size), g);
        if (p->bf16) {
            const uint16_t *k = (const uint16_t *)p->k_cache + row;
            for (int d = 0; d < hd; d++) kd[d * PF_TOK] = bf16_to_f32(k[d]);
            widen_rows((const uint16_t *)p->v_cache + row, 0, 1, hd, vd);
        } else {
            const float *k = (const float *)p->k_cache + row;
            for (int d = 0; d < hd; d++) kd[d * PF_TOK] = k[d];
            memcpy(vd, (const float *)p->v_cache + row, sizeof(float) * (size_t)hd);
        }
    }
    return 0;
}

/* Lanes of the keys key0 .. key0+7 that a query at position pos sees (key <= pos): all ones. */
static inline v8i pf_visible(int64_t pos, int64_t key0) {
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const int64_t vis = pos - key0; /* lanes 0 .. vis are seen */
    return lane <= (v8i){0, 0, 0, 0, 0, 0, 0, 0} + (int32_t)(vis < 8 ? vis : 8);
}

/* v, held in a register: gcc otherwise folds the load into each FMA that uses it, and the
 * loops wait on the load ports (4 loads where 1 does). */
static inline v8f pf_reg(v8f v) {
#if defined(__AVX__)
    __asm__("" : "+x"(v));
#endif
    return v;
}

static inline float hmax8(v8f v) {
    float m = v[0];
    for (int j = 1; j < 8; j++) m = v[j] > m ? v[j] : m;
    return m;
}

/*
 * Queries r .. r+nq-1 (nq <= PF_QR) of one query head: rows of q at qrow[i], absolute positions
 * pos[i] (ascending); outputs (fp32) written to orow[i]. kt and vr: the kv head's gathered keys
 * and values.
 */
static inline __attribute__((always_inline)) void pf_quad(const float *const qrow[PF_QR],
                                                          const int64_t pos[PF_QR], int nq,
                                                          const float *kt, const float *vr,
                                                          int hd, float scale,
                                                          float *const orow[PF_QR]) {
    float o[PF_QR][hd];
    float m[PF_QR], l[PF_QR];
    float sc[PF_QR][PF_CHUNK] __attribute__((aligned(32)));
    const float *qd[PF_QR]; /* rows past nq repeat the first: computed, never used */
    for (int i = 0; i < PF_QR; i++) {
        m[i] = -INFINITY, l[i] = 0.0f;
        memset(o[i], 0, sizeof o[i]);
        qd[i] = qrow[i < nq ? i : 0];
    }
    const int64_t last = pos[nq - 1]; /* keys 0 .. last are seen by some query of the quad */
    for (int64_t k0 = 0; k0 <= last; k0 += PF_CHUNK) {
        const int64_t left = (last - k0) / PF_TOK + 1;
        const int tiles = left < PF_CHUNK / PF_TOK ? (int)left : PF_CHUNK / PF_TOK;
        for (int j0 = 0; j0 < tiles; j0 += PF_NT) { /* raw scores, PF_NT tiles at a time */
            const int nt = tiles - j0 < PF_NT ? tiles - j0 : PF_NT;
            const float *kspan = kt + (k0 / PF_TOK + j0) * PF_TOK * hd;
            v8f s[PF_QR][PF_NT];
            ATTN_UNROLL for (int i = 0; i < PF_QR; i++)
                ATTN_UNROLL for (int j = 0; j < PF_NT; j++) s[i][j] = splat8(0.0f);
            if (nt == PF_NT) {
                for (int d = 0; d < hd; d++) {
                    v8f kv[PF_NT];
                    ATTN_UNROLL for (int j = 0; j < PF_NT; j++)
                        kv[j] = pf_reg(load8f(kspan + (j * hd + d) * PF_TOK));
                    ATTN_UNROLL for (int i = 0; i < PF_QR; i++) {
                        const v8f b = splat8(qd[i][d]);
                        ATTN_UNROLL for (int j = 0; j < PF_NT; j++) s[i][j] += b * kv[j];
                    }
                }
            } else {
                for (int d = 0; d < hd; d++) {
                    ATTN_UNROLL for (int j = 0; j < PF_NT - 1; j++) {
                        if (j >= nt) break;
                        const v8f kv = pf_reg(load8f(kspan + (j * hd + d) * PF_TOK));
                        ATTN_UNROLL for (int i = 0; i < PF_QR; i++) s[i][j] += qd[i][d] * kv;
                    }
                }
            }
            ATTN_UNROLL for (int i = 0; i < PF_QR; i++)
                ATTN_UNROLL for (int j = 0; j < PF_NT; j++) {
                    if (j >= nt) break;
                    store8f(sc[i] + (j0 + j) * PF_TOK, s[i][j]);
                }
        }
        for (int i = 0; i < nq; i++) { /* softmax over what query i sees of the chunk */
            v8f mx = splat8(-INFINITY);
            for (int j = 0; j < tiles; j++) {
                const int64_t key0 = k0 + j * PF_TOK;
                v8f x = load8f(sc[i] + j * PF_TOK);
                if (key0 + PF_TOK - 1 > pos[i]) x = select8(pf_visible(pos[i], key0), x, splat8(-INFINITY));
                mx = select8(x > mx, x, mx);
            }
            const float m_new = fmaxf(m[i], hmax8(mx)); /* finite: key 0 is seen */
            v8f sum = splat8(0.0f);
            for (int j = 0; j < tiles; j++) {
                const int64_t key0 = k0 + j * PF_TOK;
                v8f e = exp8_nonpos((load8f(sc[i] + j * PF_TOK) - m_new) * scale);
                if (key0 + PF_TOK - 1 > pos[i]) e = select8(pf_visible(pos[i], key0), e, splat8(0.0f));
                store8f(sc[i] + j * PF_TOK, e);
                sum += e;
            }
            if (k0 > 0 && m_new != m[i]) { /* rescale what earlier chunks summed */
                const float alpha = exp8_nonpos(splat8((m[i] - m_new) * scale))[0];
                l[i] *= alpha;
                for (int d = 0; d < hd; d += 8) store8f(o[i] + d, load8f(o[i] + d) * alpha);
            }
            l[i] += hsum8(sum);
            m[i] = m_new;
        }
        const int nk = tiles * PF_TOK;
        for (int d0 = 0; d0 < hd; d0 += 16) { /* P @ V: 4 queries x 16 dims */
            v8f acc[PF_QR][2];
            ATTN_UNROLL for (int i = 0; i < PF_QR; i++) {
                acc[i][0] = load8f(o[i] + d0);
                acc[i][1] = load8f(o[i] + d0 + 8);
            }
            const float *vs = vr + k0 * hd + d0;
            for (int t = 0; t < nk; t++) {
                const v8f v0 = pf_reg(load8f(vs + (int64_t)t * hd));
                const v8f v1 = pf_reg(load8f(vs + (int64_t)t * hd + 8));
                ATTN_UNROLL for (int i = 0; i < PF_QR; i++) {
                    const float p = sc[i < nq ? i : 0][t];
                    acc[i][0] += p * v0;
                    acc[i][1] += p * v1;
                }
            }
            ATTN_UNROLL for (int i = 0; i < PF_QR; i++) {
                store8f(o[i] + d0, acc[i][0]);
                store8f(o[i] + d0 + 8, acc[i][1]);
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        for (int d = 0; d < hd; d += 8) store8f(orow[i] + d, load8f(o[i] + d) * inv);
    }
}

static void pf_quad_any(const void *const qrow[PF_QR], const int64_t pos[PF_QR], int nq,
                        const uint32_t *kt, const uint32_t *vr, int hd, float scale,
                        void *const orow[PF_QR]) {
    const float *q[PF_QR], *k = (const float *)kt, *v = (const float *)vr;
    float *o[PF_QR];
    for (int i = 0; i < PF_QR; i++) q[i] = qrow[i], o[i] = orow[i];
    if (hd == 64)
        pf_quad(q, pos, nq, k, v, 64, scale, o);
    else if (hd == 128)
        pf_quad(q, pos, nq, k, v, 128, scale, o);
    else
        pf_quad(q, pos, nq, k, v, hd, scale, o);
}

/* 4-byte words (floats) of one kv head's keys of ctx tokens (kt; vr takes as many). */
static int64_t pf_words(int64_t ctx, int hd) { return (ctx + PF_TOK - 1) / PF_TOK * PF_TOK * hd; }

/*
 * q [num_tokens, num_heads, head_dim] fp32 (strides q_tok_stride, q_head_stride, 1), out
 * contiguous alike; pools fp32 (kv_bf16 0) or bf16 (1): prefill_walk.h's walk (and its returns)
 * with this file's gather and quads; -2 for a head_dim it does not take.
 */
int pdserve_prefill_attention_f32(const float *q, const void *k_cache, const void *v_cache,
                                  const int32_t *block_tables, const int32_t *query_start,
                                  const int32_t *context_lens, float *out, int64_t num_seqs,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, int64_t num_blocks, int64_t max_blocks,
                                  int64_t bt_stride, int64_t q_tok_stride, int64_t q_head_stride,
                                  float scale, int32_t kv_bf16, int32_t num_threads) {
    if (head_dim % 16 || head_dim > 256 || head_dim <= 0) return -2;
    const Pool pool = {k_cache,          v_cache,         num_blocks, max_blocks,
                       (int)num_kv_heads, (int)head_dim, (int)block_size,
                       (int)(num_heads / num_kv_heads), kv_bf16 != 0, 0};
    const PrefillKind kind = {pf_words, pf_gather, pf_quad_any, 4};
    return prefill_walk(&kind, &pool, q, block_tables, query_start, context_lens, out, num_seqs,
                        num_heads, bt_stride, q_tok_stride, q_head_stride, num_threads, scale);
}

#endif /* PDSERVE_PREFILL_F32_H */
