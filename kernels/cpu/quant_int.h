/*
 * quant.c's integer path: Q4_1 (AVX-512 VNNI or AVX2) and Q8_0 (AVX-512 VNNI) weights times fp32
 * x in integer arithmetic (few rows of x, decode). Included by quant.c after its vector macros;
 * not a header of its own to use elsewhere.
 *
 * Why: with one row of x the float path (quant_direct.h) is bound by its instructions, not by
 * memory: per 32 weights a widening, two table lookups, a shift and three FMAs on the two
 * 512-bit ports, ~6-7 cycles a block from cache on an Intel Xeon (family 6 model 207) against
 * the ~2.5 that memory allows. Here every product of a 4-bit quant with x is an integer one:
 * vpdpbusd multiplies 64 unsigned bytes (the quants) with 64 signed bytes and adds them by 4
 * into 16 int32 lanes, one instruction for what costs the float path ~16. AVX2 (and AVX-512
 * without VNNI) does the same in two: vpmaddubsw (32 products, added by 2 into int16, which
 * cannot saturate: 2 * 15 * 128 < 2^15) and one vpaddw per 32; the int16 sums of a block's 8
 * quads of k (< 2^15 again) are widened once per block by vpmaddwd.
 *
 * x is not rounded to 8 bits for it: each block of 32 values of a row of x is written exactly
 * as an integer X = x / s (s a power of two chosen so that |X| < 2^22: 22 bits and a sign below
 * the block's largest value, where fp32 holds 24) in three signed bytes, X = 65536 a + 256 b + c
 * (a, b, c in [-128, 127]); the sums of q a, q b, q c over a block are exact in int32 and so is
 * their combination S = 65536 A + 256 B + C (|S| < 32 * 15 * 2^22 < 2^31). A block contributes
 * d * s * S + m * (sum of x), the form quant_direct.h uses; what differs from the float path is
 * where the rounding happens (S is exact, then converted once), and the representation of each x
 * value to within 2^-22 of its block's largest, below fp32's rounding of the block's sum. Q8_0:
 * see qv_group.
 *
 * Layout (pdserve_qv_pack; N % 16 == 0): groups of 16 output rows g, then blocks of 32 k, 320
 * bytes each:
 *
 *   [0, 32)    d of rows 16 g .. 16 g + 15 (fp16)
 *   [32, 64)   m of the same (fp16)
 *   [64, 320)  4 runs of 64 bytes; run c, dword r (row 16 g + r), byte j: low nibble the quant
 *              at k = 8 c + j, high nibble the one at k = 8 c + 4 + j
 *
 * so a 64-byte run and 0x0f (or shifted right by 4, then and 0x0f) is, in each int32 lane, one
 * row's four quants of four consecutive k: vpdpbusd's unsigned operand, with x's four bytes at
 * those k broadcast as the signed one. The rows of a group are the 16 lanes of the result, so
 * no horizontal sum is needed. The same bytes per weight as GGUF's Q4_1 (20 per 32).
 */
#if QISA == 512 && defined(__AVX512VNNI__)
#define QV 512
#elif QISA
#define QV 256
#else
#define QV 0
#endif
#define QVG 16          /* output rows per group */
#define QVGB 320        /* bytes per group and block of 32 k: Q4_1 */
#define QVGB8 544       /* Q8_0 (AVX-512 VNNI only) */
#define QV_MR 4         /* rows of x per pass over the weights */
/* Most rows of x the integer path takes. AVX-512 VNNI: all (one thread, forty Q4_1 weights of
 * 1536 x 576 and 576 x 1536 on a Zen 4, per row against quant.c's float paths: 9-64 rows
 * 0.58-0.78x, 128-512 rows 0.74-0.79x of what torch's GEMM on the dequantized weight takes; Q8_0
 * alike). AVX2: 8 (from 6 rows the float path's tiles take as long, from 9 less). */
#if QV == 512
#define QV_MAX_ROWS INT64_MAX
#else
#define QV_MAX_ROWS 8
#endif
#define QV_AHEAD 8      /* blocks prefetched ahead (AVX2: into L1) */
#define QV_CHUNK 128    /* rows of x at a time (per row as fast at 64-512 rows, VNNI, a Zen 4) */
/* AVX-512: further ahead and into L2. On the Xeon without AVX512-BF16 (family 6 model 207), the
 * 120 projections of the default model (66 MB, Q4_1, M=1, from memory) took 0.93-0.95x the time
 * of 8 ahead into L1, the Q8_0 lm_head 0.93x (12-32 ahead alike; M=4 unchanged); the AVX2 build
 * on the same machine was unchanged at 2 threads and 1.06x slower at 1, so it keeps its own. */
#define QV_AHEAD_512 16

/* The integer path's vector width in bits (512: AVX-512 VNNI, 256: AVX2), 0 in a build without. */
int pdserve_qv_available(void) { return QV; }

/* The most rows of x it takes (QV_MAX_ROWS), 0 in a build without it. */
int64_t pdserve_qv_max_rows(void) { return QV ? QV_MAX_ROWS : 0; }

/* Bytes of the layout above for an [N, K] weight of format qt; -1 where it cannot hold one (Q4_1
 * in every build with the path, Q8_0 with AVX-512 VNNI only). */
int64_t pdserve_qv_bytes(int64_t N, int64_t K, int32_t qt) {
    const int64_t gb = qt == Q4_1 && QV ? QVGB : qt == Q8_0 && QV == 512 ? QVGB8 : 0;
    return !gb || N <= 0 || N % QVG || K <= 0 || K % QK ? -1 : N / QVG * (K / QK) * gb;
}

/* GGUF blocks [N, K / 32] of format qt (Q4_1: 20 bytes, d, m, 16 bytes, value j low nibble, j +
 * 16 high; Q8_0: 34 bytes, d, 32 int8) into the layout above (Q8_0: d of the 16 rows, then 8
 * runs of 64 bytes, run c dword r byte j the int8 at k = 4 c + j). Returns -2 if N, K or the
 * format does not fit it. */
int pdserve_qv_pack(const uint8_t *blocks, int64_t N, int64_t K, int32_t qt, uint8_t *out,
                    int32_t num_threads) {
    if (pdserve_qv_bytes(N, K, qt) < 0) return -2;
    const int64_t kb = K / QK, bb = qt == Q8_0 ? 34 : 20, gb = qt == Q8_0 ? QVGB8 : QVGB;
    if ((double)N * K < MIN_PARALLEL || num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *src = blocks + (n * kb + b) * bb;
            uint8_t *dst = out + ((n / QVG) * kb + b) * gb;
            const int r = (int)(n % QVG);
            memcpy(dst + 2 * r, src, 2);
            if (qt == Q8_0) {
                for (int c = 0; c < 8; c++) memcpy(dst + 32 + 64 * c + 4 * r, src + 2 + 4 * c, 4);
                continue;
            }
            uint8_t q[QK];
            for (int j = 0; j < 16; j++) {
                q[j] = src[4 + j] & 15;
                q[j + 16] = src[4 + j] >> 4;
            }
            memcpy(dst + 32 + 2 * r, src + 2, 2);
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 4; j++)
                    dst[64 + 64 * c + 4 * r + j] =
                        (uint8_t)(q[8 * c + j] | (q[8 * c + 4 + j] << 4));
        }
    return 0;
}

#if QV
/* One block of 32 values of a row of x as three signed bytes each (l[0] the high ones; l[i][q]
 * holds k = 4 q .. 4 q + 3), its power-of-two scale s and its fp32 sum; for Q8_0's weights, read
 * as unsigned q + 128, the scales of the limbs and what the 128 adds (AVX-512 VNNI). */
typedef struct {
    int32_t l[3][8];
    float s, sum;
    float s2, s1, corr; /* Q8_0: 65536 s, 256 s, 128 s * (sum of X) */
    int32_t pad[3];
} XQ;

/* x's 32 values of a block (at v) as int32 X[32] = x / s rounded, s = 2^(e - 148) for the block's
 * largest |x| below 2^(e - 126) (|X| < 2^22); o->s and o->sum set. Returns 0 where the block's
 * values are all below ~2^-105 or not all finite (o->l zeroed, o->s 0 or NaN). */
ALWAYS int block_scale(float mx, float sum, XQ *o, float *inv) {
    uint32_t bits;
    memcpy(&bits, &mx, 4);
    const int e = (int)(bits >> 23);
    o->sum = sum;
    if (e < 22 || e == 255 || !(sum - sum == 0.0f)) {
        memset(o->l, 0, sizeof o->l);
        o->s = e < 22 ? 0.0f : sum - sum; /* an inf or NaN in x: the outputs NaN */
        o->s2 = o->s1 = o->corr = o->s;
        return 0;
    }
    const uint32_t sb = (uint32_t)(e - 21) << 23, ib = (uint32_t)(275 - e) << 23;
    memcpy(&o->s, &sb, 4);
    memcpy(inv, &ib, 4);
    return 1;
}

#if QV == 512
/* The XQ of each block of x's row (K values). */
static void qv_prepare(const float *x, int64_t K, XQ *out) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < K / QK; b++, x += QK) {
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        XQ *o = out + b;
        float inv;
        if (!block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, sign),
                                                             _mm512_and_ps(x1, sign))),
                         _mm512_reduce_add_ps(_mm512_add_ps(x0, x1)), o, &inv))
            continue;
        int64_t sx = 0;
        for (int h = 0; h < 2; h++) {
            const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(h ? x1 : x0, _mm512_set1_ps(inv)));
            sx += _mm512_reduce_add_epi32(X);
            const __m512i c = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
            const __m512i t = _mm512_srai_epi32(_mm512_sub_epi32(X, c), 8);
            const __m512i bb = _mm512_srai_epi32(_mm512_slli_epi32(t, 24), 24);
            const __m512i a = _mm512_srai_epi32(_mm512_sub_epi32(t, bb), 8);
            _mm_storeu_si128((__m128i *)o->l[0] + h, _mm512_cvtepi32_epi8(a));
            _mm_storeu_si128((__m128i *)o->l[1] + h, _mm512_cvtepi32_epi8(bb));
            _mm_storeu_si128((__m128i *)o->l[2] + h, _mm512_cvtepi32_epi8(c));
        }
        o->s2 = o->s * 65536.0f, o->s1 = o->s * 256.0f;
        o->corr = (float)(128.0 * (double)o->s * (double)sx);
    }
}
#elif QV == 256
/* The low byte of each of v's 8 int32 lanes, in order, into 8 bytes at p. */
ALWAYS void store_low_bytes(void *p, __m256i v) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, pick),
                                                  _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64((__m128i *)p, _mm256_castsi256_si128(b));
}

static void qv_prepare(const float *x, int64_t K, XQ *out) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < K / QK; b++, x += QK) {
        __m256 v[4], mx, sum;
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i);
        mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], sign), _mm256_and_ps(v[1], sign)),
                           _mm256_max_ps(_mm256_and_ps(v[2], sign), _mm256_and_ps(v[3], sign)));
        sum = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
        float m8[8], s8[8], mxs = 0.0f, sums = 0.0f;
        _mm256_storeu_ps(m8, mx);
        _mm256_storeu_ps(s8, sum);
        for (int i = 0; i < 8; i++) {
            mxs = m8[i] > mxs || m8[i] != m8[i] ? m8[i] : mxs;
            sums += s8[i];
        }
        XQ *o = out + b;
        float inv;
        if (!block_scale(mxs, sums, o, &inv)) continue;
        for (int i = 0; i < 4; i++) {
            const __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            const __m256i c = _mm256_srai_epi32(_mm256_slli_epi32(X, 24), 24);
            const __m256i t = _mm256_srai_epi32(_mm256_sub_epi32(X, c), 8);
            const __m256i bb = _mm256_srai_epi32(_mm256_slli_epi32(t, 24), 24);
            const __m256i a = _mm256_srai_epi32(_mm256_sub_epi32(t, bb), 8);
            store_low_bytes((int8_t *)o->l[0] + 8 * i, a);
            store_low_bytes((int8_t *)o->l[1] + 8 * i, bb);
            store_low_bytes((int8_t *)o->l[2] + 8 * i, c);
        }
    }
}
#endif

#if QV == 512
/* out[l] = the int32 sums over a block of the unsigned bytes u[q] times x's limb l at quad q, in
 * each of 16 lanes (two chains of four per limb, added). */
ALWAYS void limb_sums(const __m512i u[8], const XQ *x, __m512i out[3]) {
    __m512i s[3][2];
    for (int l = 0; l < 3; l++) s[l][0] = s[l][1] = _mm512_setzero_si512();
    for (int q = 0; q < 8; q++)
        for (int l = 0; l < 3; l++)
            s[l][q & 1] = _mm512_dpbusd_epi32(s[l][q & 1], u[q], _mm512_set1_epi32(x->l[l][q]));
    for (int l = 0; l < 3; l++) out[l] = _mm512_add_epi32(s[l][0], s[l][1]);
}
#endif

/* out[16 c + r] = x row c . dequant(row 16 g + r) for c < mr, r < 16: the group's kb blocks
 * of format qt from p, x's XQ rows kb apart. A Q4_1 block adds d * s * S + m * (sum of x) to
 * each row's sum. Q8_0 (AVX-512 VNNI only): the int8 quants read as unsigned q + 128 (one xor),
 * each limb's sums over a block (|A| < 32 * 255 * 128, exact in int32 and in fp32) combined in
 * fp32 and what the 128 added taken off: d * (s * (65536 A + 256 B + C) - 128 s * sum of X). */
ALWAYS void qv_group(int qt, const uint8_t *p, int64_t kb, const XQ *xq, int mr, float *out) {
#if QV == 512
    const int q8 = qt == Q8_0;
    const int64_t gb = q8 ? QVGB8 : QVGB;
    const __m512i lo = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[QV_MR];
    for (int c = 0; c < mr; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++, p += gb) {
        for (int i = 0; i < gb; i += 64)
            _mm_prefetch((const char *)p + QV_AHEAD_512 * gb + i, _MM_HINT_T1);
        __m512i u[8];
        for (int c = 0; c < 4; c++) {
            if (q8) {
                for (int h = 0; h < 2; h++)
                    u[2 * c + h] =
                        _mm512_xor_si512(_mm512_loadu_si512(p + 32 + 128 * c + 64 * h), flip);
                continue;
            }
            const __m512i v = _mm512_loadu_si512(p + 64 + 64 * c);
            u[2 * c] = _mm512_and_si512(v, lo);
            u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 m = q8 ? _mm512_setzero_ps() /* Q8_0 has no m */
                            : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        for (int c = 0; c < mr; c++) {
            const XQ *x = xq + c * kb + b;
            __m512i s[3];
            limb_sums(u, x, s);
            if (q8) {
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s[2]), _mm512_set1_ps(x->s));
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1]), _mm512_set1_ps(x->s1), t);
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_set1_ps(x->s2), t);
                acc[c] = _mm512_fmadd_ps(_mm512_sub_ps(t, _mm512_set1_ps(x->corr)), d, acc[c]);
                continue;
            }
            __m512i t = _mm512_add_epi32(_mm512_slli_epi32(s[0], 8), s[1]);
            t = _mm512_add_epi32(_mm512_slli_epi32(t, 8), s[2]);
            const __m512 ds = _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(x->s));
            acc[c] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->sum), _mm512_fmadd_ps(ds, d, acc[c]));
        }
    }
    for (int c = 0; c < mr; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
#else /* QV == 256 (Q4_1 only): the group's rows 0-7 and 8-15 as two halves of each run */
    (void)qt;
    const __m256i lo = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[QV_MR][2];
    for (int c = 0; c < mr; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++, p += QVGB) {
        for (int i = 0; i < QVGB; i += 64)
            _mm_prefetch((const char *)p + QV_AHEAD * QVGB + i, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i u[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 + 64 * c + 32 * h));
                u[2 * c] = _mm256_and_si256(v, lo);
                u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * h)));
            for (int c = 0; c < mr; c++) {
                const XQ *x = xq + c * kb + b;
                __m256i s[3];
                for (int l = 0; l < 3; l++) {
                    s[l] = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(x->l[l][0]));
                    for (int q = 1; q < 8; q++)
                        s[l] = _mm256_add_epi16(
                            s[l], _mm256_maddubs_epi16(u[q], _mm256_set1_epi32(x->l[l][q])));
                    s[l] = _mm256_madd_epi16(s[l], ones);
                }
                __m256i t = _mm256_add_epi32(_mm256_slli_epi32(s[0], 8), s[1]);
                t = _mm256_add_epi32(_mm256_slli_epi32(t, 8), s[2]);
                const __m256 ds = _mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(x->s));
                acc[c][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->sum),
                                            _mm256_fmadd_ps(ds, d, acc[c][h]));
            }
        }
    }
    for (int c = 0; c < mr; c++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + 16 * c + 8 * h, acc[c][h]);
#endif
}

#endif

#if QV
/* qv_group for mr rows of x, each (qt, mr) its own compiled loop. */
ALWAYS void qv_pass(int qt, const uint8_t *p, int64_t kb, const XQ *xc, int mr, float *out) {
    switch (mr) {
    case 4: qv_group(qt, p, kb, xc, 4, out); break;
    case 3: qv_group(qt, p, kb, xc, 3, out); break;
    case 2: qv_group(qt, p, kb, xc, 2, out); break;
    default: qv_group(qt, p, kb, xc, 1, out); break;
    }
}
#endif

#if QV
/* qv_linear for M <= QV_CHUNK rows of x (y's rows from x's first), xq their scratch. */
static void qv_rows(const float *x, const uint8_t *v, int32_t qt, const float *bias, float *yf,
                    uint16_t *yb, int64_t M, int64_t N, int64_t K, int32_t num_threads, XQ *xq) {
    const int64_t kb = K / QK, groups = N / QVG, gb = qt == Q8_0 ? QVGB8 : QVGB;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M >= 16)
    for (int64_t c = 0; c < M; c++) qv_prepare(x + c * K, K, xq + c * kb);
    /* guided: each thread's first chunk is a long run of groups (one stream for the prefetches;
     * dynamic chunks of 4 groups measured 1.14x slower), and the last, small ones go to whichever
     * thread is free, so a thread the OS took off its core for a while (a 2-vCPU box serving:
     * the gateway and the event loop run there too) is not waited for. Offline 0.95-1.0x static;
     * served W-c1, alternating, no difference beyond the noise. */
#pragma omp parallel for num_threads(num_threads) schedule(guided)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = v + g * kb * gb;
        for (int64_t c0 = 0; c0 < M; c0 += QV_MR) {
            float out[QV_MR * QVG];
            const int mr = M - c0 < QV_MR ? (int)(M - c0) : QV_MR;
            const XQ *xc = xq + c0 * kb;
            if (QV == 512 && qt == Q8_0)
                qv_pass(Q8_0, p, kb, xc, mr, out);
            else
                qv_pass(Q4_1, p, kb, xc, mr, out);
            for (int c = 0; c < mr; c++)
                for (int r = 0; r < QVG; r++) {
                    const int64_t i = (c0 + c) * N + g * QVG + r;
                    const float o = out[c * QVG + r] + (bias ? bias[g * QVG + r] : 0.0f);
                    if (yf)
                        yf[i] = o;
                    else
                        yb[i] = f32_to_bf16(o);
                }
        }
    }
}
#endif

/*
 * y[M, N] = x[M, K] @ dequant(w)^T (+ bias), fp32 x and bias, for a weight of format qt in the
 * layout above (v) and M <= QV_MAX_ROWS; y fp32 (yf) or rounded to bf16 (yb, when yf is NULL).
 * Returns 0; -1 if scratch memory could not be had; -2 where this build has no integer path for
 * qt or the shapes do not fit it.
 */
static int qv_linear(const float *x, const uint8_t *v, int32_t qt, const float *bias, float *yf,
                     uint16_t *yb, int64_t M, int64_t N, int64_t K, int32_t num_threads) {
#if QV
    if (pdserve_qv_bytes(N, K, qt) < 0 || M > QV_MAX_ROWS) return -2;
    if (M <= 0) return 0;
    const int64_t kb = K / QK;
    /* a prompt's rows QV_CHUNK at a time: x as XQ takes 128 bytes a block (4x fp32's) */
    XQ *xq = aligned_alloc(64, (size_t)((M < QV_CHUNK ? M : QV_CHUNK) * kb) * sizeof(XQ));
    if (!xq) return -1;
    if ((double)M * N * K < MIN_PARALLEL || num_threads < 1) num_threads = 1;
    for (int64_t m0 = 0; m0 < M; m0 += QV_CHUNK)
        qv_rows(x + m0 * K, v, qt, bias, yf ? yf + m0 * N : NULL, yb ? yb + m0 * N : NULL,
                M - m0 < QV_CHUNK ? M - m0 : QV_CHUNK, N, K, num_threads, xq);
    free(xq);
    return 0;
#else
    (void)x, (void)v, (void)qt, (void)bias, (void)yf, (void)yb, (void)M, (void)N, (void)K;
    (void)num_threads;
    return -2;
#endif
}

int pdserve_qlinear_v(const float *x, const uint8_t *v, int32_t qt, const float *bias, float *y,
                      int64_t M, int64_t N, int64_t K, int32_t num_threads) {
    return qv_linear(x, v, qt, bias, y, NULL, M, N, K, num_threads);
}
