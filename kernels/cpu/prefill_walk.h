/*
 * The walk both prefill attention kernels share (prefill_bf16.h on AVX512-BF16, prefill_f32.h in
 * every build): part of paged_attention.c, included after its Pool and row_index.
 *
 * Phase 1, per (sequence, kv head), in parallel: the kernel's gather copies the sequence's keys
 * and values from the paged pool into layouts of its own in one workspace (kind->words of 4
 * bytes for the keys of ctx tokens, as many for the values). Phase 2, per (sequence, block of
 * PW_QB queries, kv head), the costliest (last) blocks first: for each query head of the kv
 * head's group, the kernel's quad takes PW_QR queries at a time against the keys up to the
 * causal diagonal. A sequence whose context or block ids are out of range gets zeroed outputs
 * and is counted.
 */
#ifndef PDSERVE_PREFILL_WALK_H
#define PDSERVE_PREFILL_WALK_H

#define PW_QB 16 /* queries per task */
#define PW_QR 4  /* queries a quad takes */

typedef struct {
    int64_t (*words)(int64_t ctx, int head_dim); /* 4-byte words of one kv head's keys */
    /* keys 0 .. ctx-1 of kv head g into kt, values into vr; 1 if a block id is out of range */
    int (*gather)(const Pool *p, const int32_t *blocks, int64_t ctx, int g, uint32_t *kt,
                  uint32_t *vr);
    /* queries at qrow[i], positions pos[i] (ascending), i < nq <= PW_QR: outputs to orow[i] */
    void (*quad)(const void *const qrow[PW_QR], const int64_t pos[PW_QR], int nq,
                 const uint32_t *kt, const uint32_t *vr, int hd, float scale,
                 void *const orow[PW_QR]);
    int elem; /* bytes of an element of q and out */
} PrefillKind;

/*
 * q [num_tokens, num_heads, head_dim] (strides q_tok_stride, q_head_stride, 1), out contiguous
 * alike; sequence s owns tokens query_start[s] .. query_start[s+1]-1, the last of its
 * context_lens[s] positions (its earlier ones are a cached prefix). Returns the number of
 * sequences whose context or block ids were out of range (their outputs are zeroed), -1 if
 * scratch memory could not be had.
 */
static int prefill_walk(const PrefillKind *kind, const Pool *pool, const void *q,
                        const int32_t *block_tables, const int32_t *query_start,
                        const int32_t *context_lens, void *out, int64_t num_seqs,
                        int64_t num_heads, int64_t bt_stride, int64_t q_tok_stride,
                        int64_t q_head_stride, int32_t num_threads, float scale) {
    const int64_t num_kv_heads = pool->num_kv_heads, block_size = pool->block_size;
    const int group = pool->group, hd = pool->head_dim, elem = kind->elem;
    int64_t words = 0, num_tasks = 0;
    int64_t *offset = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1)); /* kv head s's words */
    if (!offset) return -1;
    for (int64_t s = 0; s < num_seqs; s++) {
        offset[s] = words;
        words += 2 * num_kv_heads * kind->words(context_lens[s] > 0 ? context_lens[s] : 0, hd);
        num_tasks += num_kv_heads * ((query_start[s + 1] - query_start[s] + PW_QB - 1) / PW_QB);
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
        const int64_t nq = query_start[s + 1] - query_start[s], ctx = context_lens[s];
        if (ctx < nq || ctx < 0 || (ctx + block_size - 1) / block_size > pool->max_blocks)
            bad[s] = 1;
        for (int64_t b = 0; b < (nq + PW_QB - 1) / PW_QB; b++)
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
            const int64_t half = (offset[s + 1] - offset[s]) / (2 * num_kv_heads);
            uint32_t *kt = work + offset[s] + 2 * g * half;
            if (kind->gather(pool, block_tables + s * bt_stride, context_lens[s], g, kt, kt + half))
                bad[s] = 1; /* benign race: only ever set to 1 */
        }
        /* implicit barrier: every sequence gathered (or marked bad) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = num_tasks - 1; i >= 0; i--) { /* the costliest (last) blocks first */
            const int64_t s = tasks[3 * i], b = tasks[3 * i + 1];
            const int g = (int)tasks[3 * i + 2];
            const int64_t q0 = query_start[s], nq_seq = query_start[s + 1] - q0;
            const int64_t prefix = context_lens[s] - nq_seq;
            const int64_t r0 = b * PW_QB, r1 = r0 + PW_QB < nq_seq ? r0 + PW_QB : nq_seq;
            const int64_t half = (offset[s + 1] - offset[s]) / (2 * num_kv_heads);
            const uint32_t *kt = work + offset[s] + 2 * g * half;
            for (int h = g * group; h < (g + 1) * group; h++) {
                for (int64_t r = r0; r < r1; r += PW_QR) {
                    const int nq = r1 - r < PW_QR ? (int)(r1 - r) : PW_QR;
                    const void *qrow[PW_QR];
                    void *orow[PW_QR];
                    int64_t pos[PW_QR];
                    for (int j = 0; j < PW_QR; j++) {
                        const int64_t tok = q0 + r + (j < nq ? j : nq - 1);
                        qrow[j] = (const char *)q + (tok * q_tok_stride + h * q_head_stride) * elem;
                        orow[j] = (char *)out + (tok * num_heads + h) * hd * elem;
                        pos[j] = prefix + r + (j < nq ? j : nq - 1);
                    }
                    if (bad[s]) {
                        for (int j = 0; j < nq; j++) memset(orow[j], 0, (size_t)(hd * elem));
                        continue;
                    }
                    kind->quad(qrow, pos, nq, kt, kt + half, hd, scale, orow);
                }
            }
        }
    }
    int num_bad = 0;
    for (int64_t s = 0; s < num_seqs; s++) num_bad += bad[s];
    free(offset), free(work), free(tasks), free(bad);
    return num_bad;
}

#endif /* PDSERVE_PREFILL_WALK_H */
