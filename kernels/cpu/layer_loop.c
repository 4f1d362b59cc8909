/*
 * A step's decoder layers in one C call: the same kernel entry points the module path calls from
 * Python (linear.c, fused.c, paged_attention.c), in the same order with the same arguments,
 * reached through function pointers that layer_loop.py takes from those libraries. One ctypes
 * call per step instead of nine per layer: between kernels the second OpenMP thread no longer
 * waits on Python. A step is any batch: its prefill tokens first (prefill attention), then its
 * decode tokens (decode attention), as in pdserve/model/attention.py.
 */
#include <stddef.h>
#include <stdint.h>

typedef void (*rms_norm_fn)(const void *x, void *residual, const void *weight, void *out, int64_t M,
                            int64_t N, float eps, int32_t dtype, int32_t num_threads);
typedef void (*linear_fn)(const void *x, const void *packed, const void *bias, void *y, int64_t M,
                          int64_t N, int64_t K, int32_t num_threads);
/* the same with the rows' kinds: rows 0 .. prompt_rows-1 prompt tokens, the rest generated ones */
typedef void (*linear_rows_fn)(const void *x, const void *packed, const void *bias, void *y,
                               int64_t M, int64_t N, int64_t K, int32_t num_threads,
                               int64_t prompt_rows);
typedef int (*rope_fn)(void *qkv, int64_t M, int64_t row_stride, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, const int64_t *positions,
                       const float *cos_table, const float *sin_table, int64_t max_positions,
                       void *k_cache, void *v_cache, const int64_t *slots, int64_t num_slots,
                       int32_t dtype, int32_t num_threads);
typedef int (*decode_attention_fn)(const void *q, const void *k_cache, const void *v_cache,
                                   const int32_t *block_tables, const int32_t *context_lens,
                                   void *out, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                   int64_t num_blocks, int64_t max_blocks, int64_t bt_stride,
                                   int64_t q_seq_stride, int64_t q_head_stride, float scale,
                                   int32_t is_bf16, int32_t num_threads);
typedef int (*prefill_attention_fn)(const void *q, const void *k_cache, const void *v_cache,
                                    const int32_t *block_tables, const int32_t *query_start,
                                    const int32_t *context_lens, void *out, int64_t num_seqs,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t block_size, int64_t num_blocks, int64_t max_blocks,
                                    int64_t bt_stride, int64_t q_tok_stride, int64_t q_head_stride,
                                    float scale, int32_t num_threads);
typedef void (*silu_mul_fn)(const void *gate_up, void *out, int64_t M, int64_t I, int32_t dtype,
                            int32_t num_threads);
typedef int (*after_layer_fn)(int64_t layer); /* nonzero: stop */

typedef struct { /* what one layer reads: fixed while the weights and pools are */
    const void *ln1, *ln2;                         /* norm weights */
    const void *qkv_w, *o_w, *gate_up_w, *down_w;  /* packed projections */
    const void *qkv_b, *o_b, *gate_up_b, *down_b;  /* biases or NULL */
    void *k_cache, *v_cache;
    float eps1, eps2;
} Layer;

typedef struct { /* the attention of one kind of token */
    int64_t tokens, seqs, bt_width, bt_stride; /* tokens: rows of the step it covers */
    const int32_t *block_tables, *query_start, *context_lens; /* query_start: prefill only */
} Part;

typedef struct { /* one step */
    rms_norm_fn rms_norm;
    linear_fn linear;
    rope_fn rope;
    decode_attention_fn decode_attention;
    prefill_attention_fn prefill_attention;
    silu_mul_fn silu_mul;
    after_layer_fn after_layer; /* or NULL */
    int64_t m, hidden, inter, heads, kv_heads, head_dim, width;
    int64_t block_size, num_blocks, max_positions;
    float scale;
    int32_t num_threads;
    Part prefill, decode; /* rows 0 .. prefill.tokens-1, then decode.tokens rows */
    const void *embeddings; /* [m, hidden]: layer 0's input, then the residual stream */
    void *normed, *qkv, *attn, *o, *gate_up, *act, *down; /* buffers */
    const int64_t *positions, *slots;
    const float *cos, *sin;
    int32_t is_bf16; /* activations and buffers: bf16 (1) or fp32 (0, decode steps only) */
    int32_t kv_code; /* the pools' code for rope and decode attention: as is_bf16, or 2 (fp32
                        activations over bf16 pools) */
    linear_rows_fn linear_rows; /* or NULL: linear for every row, whatever its kind */
} Step;

/* y = x @ w^T (+ b) for the step's m rows: its prefill rows are prompt tokens, its decode rows
 * generated ones, which linear_rows (a bf16 model's Q4_1 hybrids) multiplies differently. */
static void project(const Step *s, const void *x, const void *w, const void *b, void *y,
                    int64_t N, int64_t K) {
    if (s->linear_rows)
        s->linear_rows(x, w, b, y, s->m, N, K, s->num_threads, s->prefill.tokens);
    else
        s->linear(x, w, b, y, s->m, N, K, s->num_threads);
}

enum { FAILED_ROPE = 0, FAILED_DECODE = 1, FAILED_PREFILL = 2, STOPPED = 3 };

/*
 * Runs layers 0 .. num_layers-1; the residual stream is updated in s->embeddings and the last
 * layer's MLP output is left in s->down. Returns -1, or the index of the layer
 * whose RoPE/KV write, decode or prefill attention refused *count of its tokens/tasks/sequences
 * (*kind, *count < 0: no scratch memory), or after which after_layer asked to stop; nothing after
 * that ran.
 */
int64_t pdserve_layers(const Step *s, const Layer *layers, int64_t num_layers, int32_t *kind,
                       int64_t *count) {
    const int64_t m = s->m, H = s->hidden, I = s->inter, hd = s->head_dim, w = s->width;
    const int32_t t = s->num_threads, bf16 = s->is_bf16;
    const int64_t elem = bf16 ? 2 : 4;
    void *residual = (void *)s->embeddings;
    const Part *pf = &s->prefill, *dc = &s->decode;
    for (int64_t i = 0; i < num_layers; i++) {
        const Layer *L = &layers[i];
        if (i == 0)
            s->rms_norm(s->embeddings, NULL, L->ln1, s->normed, m, H, L->eps1, bf16, t);
        else
            s->rms_norm(s->down, residual, L->ln1, s->normed, m, H, L->eps1, bf16, t);
        project(s, s->normed, L->qkv_w, L->qkv_b, s->qkv, w, H);
        int bad = s->rope(s->qkv, m, w, s->heads, s->kv_heads, hd, s->positions, s->cos, s->sin,
                          s->max_positions, L->k_cache, L->v_cache, s->slots,
                          s->num_blocks * s->block_size, s->kv_code, t);
        if (bad) {
            *kind = FAILED_ROPE, *count = bad;
            return i;
        }
        if (pf->tokens) {
            bad = s->prefill_attention(s->qkv, L->k_cache, L->v_cache, pf->block_tables,
                                       pf->query_start, pf->context_lens, s->attn, pf->seqs,
                                       s->heads, s->kv_heads, hd, s->block_size, s->num_blocks,
                                       pf->bt_width, pf->bt_stride, w, hd, s->scale, t);
            if (bad) {
                *kind = FAILED_PREFILL, *count = bad;
                return i;
            }
        }
        if (dc->tokens) { /* the decode rows follow the prefill rows */
            const char *q = (const char *)s->qkv + pf->tokens * w * elem;
            char *out = (char *)s->attn + pf->tokens * s->heads * hd * elem;
            bad = s->decode_attention(q, L->k_cache, L->v_cache, dc->block_tables, dc->context_lens,
                                      out, dc->seqs, s->heads, s->kv_heads, hd, s->block_size,
                                      s->num_blocks, dc->bt_width, dc->bt_stride, w, hd, s->scale,
                                      s->kv_code, t);
            if (bad) {
                *kind = FAILED_DECODE, *count = bad;
                return i;
            }
        }
        project(s, s->attn, L->o_w, L->o_b, s->o, H, s->heads * hd);
        s->rms_norm(s->o, residual, L->ln2, s->normed, m, H, L->eps2, bf16, t);
        project(s, s->normed, L->gate_up_w, L->gate_up_b, s->gate_up, 2 * I, H);
        s->silu_mul(s->gate_up, s->act, m, I, bf16, t);
        project(s, s->act, L->down_w, L->down_b, s->down, H, I);
        if (s->after_layer && s->after_layer(i)) {
            *kind = STOPPED, *count = 0;
            return i;
        }
    }
    return -1;
}
