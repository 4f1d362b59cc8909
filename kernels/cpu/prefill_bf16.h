/*
 * Prefill attention on AVX512-BF16: part of paged_attention.c, which includes this file inside its
 * AVX512-BF16 section after decode_512.h (it uses paged_attention.c's Pool and row_index,
 * decode_512.h's TOK, exp512.h's exp2_16, and ATTN_UNROLL); kept apart only to keep each file
 * readable.
 */
#ifndef PDSERVE_PREFILL_BF16_H
#define PDSERVE_PREFILL_BF16_H

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
 * of 16 queries): for each query head of the group, 4 queries at a time (prefill_quad), the
 * keys up to the diagonal in chunks of up to 512: scores, softmax, probabilities to bf16 pairs
 * (as on GPUs), then P @ V into fp32 outputs.
 *
 * On the 2-core Zen 4, 512 tokens x 9 heads (3 KV heads) per layer: 0.98 ms against 1.25 ms
 * with online-softmax steps every 64 keys (each with two reductions across lanes, a rescale of
 * the outputs and a full-precision exp), side by side; the score and P @ V loops now run
 * without spills, ~70 % of the time.
 */
#define QR PW_QR /* queries whose scores are computed together (prefill_walk.h's quads) */

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

/* Lanes of the 16 keys key0 .. key0+15 that a query at position pos sees (key <= pos). */
static inline __mmask16 visible(int64_t pos, int64_t key0) {
    const int64_t vis = pos - key0 + 1;
    return vis >= TOK ? (__mmask16)0xffff : vis <= 0 ? (__mmask16)0 : (__mmask16)((1u << vis) - 1);
}

#define CHUNK 512 /* keys per softmax pass: a quad's raw scores (4 x 8 KB) stay in L1 */

/*
 * Queries r0 .. r0+nq-1 (nq <= QR) of query head h: rows of q at qrow[i] (bf16, head_dim),
 * absolute positions pos[i]; outputs (fp32, natural order) accumulated in o[i], then written.
 * The keys a quad sees go in chunks of up to CHUNK (one, up to 512 positions): all of a chunk's
 * scores first (16 accumulators: 4 queries x 4 key tiles, kept raw in L1, with a running
 * per-lane maximum of the visible ones), then one maximum per query and chunk, the
 * probabilities exp2(scale log2(e) (s - max)) as bf16 pairs (a running sum per lane), then
 * P @ V into fp32 outputs; an online-softmax rescale only between chunks. A query's arithmetic
 * does not depend on the other queries of its quad (keys it does not see add exact zeros).
 */
static inline __attribute__((always_inline)) void prefill_quad(
    const uint16_t *const qrow[QR], const int64_t pos[QR], int nq, const uint32_t *kt,
    const uint32_t *vp, int hd, float scale, uint16_t *const orow[QR]) {
    const int dw = hd / 2;
    const float c2 = scale * 1.44269504088896341f; /* scores to base-2 exponents */
    float o[QR][hd];
    float m[QR];
    __m512 lsum[QR];
    float sc[QR][CHUNK] __attribute__((aligned(64)));
    uint32_t pairs[QR][CHUNK / 2] __attribute__((aligned(64)));
    for (int i = 0; i < QR; i++) {
        m[i] = -INFINITY, lsum[i] = _mm512_setzero_ps();
        memset(o[i], 0, sizeof o[i]);
    }
    const int32_t *qd[QR]; /* q's dwords (pairs of dims); rows past nq repeat the first */
    for (int i = 0; i < QR; i++) qd[i] = (const int32_t *)qrow[i < nq ? i : 0];
    const int64_t last = pos[nq - 1]; /* keys 0 .. last are visible to some query of the quad */
    for (int64_t k0 = 0; k0 <= last; k0 += CHUNK) {
        const int tiles = (int)((last - k0) / TOK + 1 < CHUNK / TOK ? (last - k0) / TOK + 1 : CHUNK / TOK);
        for (int j0 = 0; j0 < tiles; j0 += 4) { /* raw scores of 4 tiles at a time */
            __m512 s[QR][4];
            ATTN_UNROLL for (int i = 0; i < QR; i++)
                ATTN_UNROLL for (int j = 0; j < 4; j++) s[i][j] = _mm512_setzero_ps();
            const uint32_t *kspan = kt + (k0 / TOK + j0) * TOK * dw;
            const int nt = tiles - j0 < 4 ? tiles - j0 : 4;
            if (nt == 4) {
                for (int c = 0; c < dw; c++) {
                    ATTN_UNROLL for (int j = 0; j < 4; j++) {
                        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kspan + (j * dw + c) * TOK);
                        ATTN_UNROLL for (int i = 0; i < QR; i++)
                            s[i][j] = _mm512_dpbf16_ps(s[i][j], (__m512bh)_mm512_set1_epi32(qd[i][c]), kv);
                    }
                }
            } else {
                for (int c = 0; c < dw; c++) {
                    ATTN_UNROLL for (int j = 0; j < 3; j++) {
                        if (j >= nt) break;
                        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kspan + (j * dw + c) * TOK);
                        ATTN_UNROLL for (int i = 0; i < QR; i++)
                            s[i][j] = _mm512_dpbf16_ps(s[i][j], (__m512bh)_mm512_set1_epi32(qd[i][c]), kv);
                    }
                }
            }
            ATTN_UNROLL for (int i = 0; i < QR; i++)
                ATTN_UNROLL for (int j = 0; j < 4; j++) {
                    if (j >= nt) break;
                    _mm512_store_ps(sc[i] + (j0 + j) * TOK, s[i][j]);
                }
        }
        for (int i = 0; i < nq; i++) {
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < tiles; j++) {
                const int64_t key0 = k0 + j * TOK;
                mx = key0 + TOK - 1 <= pos[i] ? _mm512_max_ps(mx, _mm512_load_ps(sc[i] + j * TOK))
                   : _mm512_mask_max_ps(mx, visible(pos[i], key0), mx, _mm512_load_ps(sc[i] + j * TOK));
            }
            const float m_new = fmaxf(m[i], _mm512_reduce_max_ps(mx)); /* finite: key 0 is seen */
            const __m512 mc = _mm512_set1_ps(m_new * c2), c2v = _mm512_set1_ps(c2);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < tiles; j++) {
                const int64_t key0 = k0 + j * TOK;
                __m512 e = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(sc[i] + j * TOK), c2v, mc));
                if (key0 + TOK - 1 > pos[i]) e = _mm512_maskz_mov_ps(visible(pos[i], key0), e);
                sum = _mm512_add_ps(sum, e);
                _mm256_store_si256((__m256i *)(pairs[i] + 8 * j), (__m256i)_mm512_cvtneps_pbh(e));
            }
            if (k0 > 0 && m_new != m[i]) { /* rescale what earlier chunks summed */
                const __m512 alpha = exp2_16(_mm512_set1_ps((m[i] - m_new) * c2));
                lsum[i] = _mm512_mul_ps(lsum[i], alpha);
                for (int d = 0; d < hd; d += 16)
                    _mm512_storeu_ps(o[i] + d, _mm512_mul_ps(alpha, _mm512_loadu_ps(o[i] + d)));
            }
            lsum[i] = _mm512_add_ps(lsum[i], sum);
            m[i] = m_new;
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
        const float l = _mm512_reduce_add_ps(lsum[i]);
        const __m512 inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
        for (int d = 0; d < hd; d += 16)
            _mm256_storeu_si256((__m256i *)(orow[i] + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(o[i] + d))));
    }
}

static void prefill_quad_any(const void *const qrow[QR], const int64_t pos[QR], int nq,
                             const uint32_t *kt, const uint32_t *vp, int hd, float scale,
                             void *const orow[QR]) {
    const uint16_t *q[QR];
    uint16_t *o[QR];
    for (int i = 0; i < QR; i++) q[i] = qrow[i], o[i] = orow[i];
    if (hd == 64)
        prefill_quad(q, pos, nq, kt, vp, 64, scale, o);
    else
        prefill_quad(q, pos, nq, kt, vp, 128, scale, o);
}

/* 4-byte words of one kv head's keys of ctx tokens (kt; vp takes as many). */
static int64_t prefill_words(int64_t ctx, int hd) { return ((ctx + TOK - 1) / TOK) * TOK * (hd / 2); }

/*
 * q [num_tokens, num_heads, head_dim] bf16 (strides q_tok_stride, q_head_stride, 1), out
 * contiguous alike: prefill_walk.h's walk (and its returns) with this file's gather and quads.
 */
int pdserve_prefill_attention_bf16(const uint16_t *q, const void *k_cache, const void *v_cache,
                                   const int32_t *block_tables, const int32_t *query_start,
                                   const int32_t *context_lens, uint16_t *out, int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t num_blocks, int64_t max_blocks,
                                   int64_t bt_stride, int64_t q_tok_stride, int64_t q_head_stride,
                                   float scale, int32_t num_threads) {
    const Pool pool = {k_cache, v_cache, num_blocks, max_blocks, (int)num_kv_heads,
                       (int)head_dim, (int)block_size, (int)(num_heads / num_kv_heads), 1, 1};
    const PrefillKind kind = {prefill_words, gather_kv_t, prefill_quad_any, 2};
    return prefill_walk(&kind, &pool, q, block_tables, query_start, context_lens, out, num_seqs,
                        num_heads, bt_stride, q_tok_stride, q_head_stride, num_threads, scale);
}

#endif /* PDSERVE_PREFILL_BF16_H */
