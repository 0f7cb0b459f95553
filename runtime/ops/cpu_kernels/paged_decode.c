/* Decode attention over a paged KV cache for the CPU runtime: fp32 or bfloat16 in, fp32 math and
 * output.
 *
 * One query row per request attends to the request's first kv_lens[b] cached tokens, read in
 * place through its block table (no gather into a dense copy):
 *
 *     token t of request b:  block = table[b, t / block_size], row = t % block_size
 *     key of kv head h:      k + block * k_sblk + row * k_srow + h * k_shead   (D floats)
 *
 * Query head n reads kv head n / G (G = N / KVN, groups contiguous), as the fused-attention
 * operator does. A request is one work item, walked block by block and kv head by kv head:
 * every cached key and value is read from memory once per call, and the G query heads of a
 * group reuse it from L1. Scores are scaled, softmaxed in fp32 and applied to the values; a
 * request with no keys gets zeros. Requests are split over threads by their key counts. When the
 * whole batch starts with the same blocks (a prefix-cache hit every request shares), those are
 * walked once per kv head for all requests instead (run_shared), with the same sums. Absorbed MLA adds
 * a rope part to every score (q_rope . k_rope, from its own paged cache) and passes its latent
 * cache as both keys and values.
 *
 * Returns 0, or 1 + the request index whose block table names a block outside the cache.
 */
#include <math.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

/* AVX2 + FMA (what -march=native gives on current x86) takes the blocked score and value loops
 * below; every other target, or -DKVSKILL_PORTABLE, the plain C loops that compute the same
 * sums (the scores in another order of addition, within fp32 rounding). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVSKILL_PORTABLE)
#include <immintrin.h>
#define KVSKILL_AVX2 1
#endif

typedef struct {
    /* q, k and v are all fp32, or all bfloat16 (bf16 = 1); strides count elements */
    const void *q;
    int64_t q_sb, q_sn;
    const void *k;
    int64_t k_sblk, k_srow, k_shead;
    const void *v;
    int64_t v_sblk, v_srow, v_shead;
    const int32_t *table;
    int64_t table_sb, table_width, num_blocks;
    int64_t block_size;
    const int64_t *kv_lens;
    int64_t batch, heads, kv_heads, dim, dim_v;
    float scale;
    float *out; /* [batch, heads, dim_v], contiguous, fp32 whatever the inputs */
    int64_t bf16;
    /* MLA's rope part (dim_rope > 0): score = scale * (q . k + q_rope . k_rope); the rope keys
     * live in their own paged cache under the same block table and block size */
    const void *qr;
    int64_t qr_sb, qr_sn;
    const void *kr;
    int64_t kr_sblk, kr_srow, kr_shead;
    int64_t dim_rope;
} decode_args;

/* Per-thread buffers: scores of one request, its scaled queries (and rope queries), its
 * outputs, one query row widened to fp32, and one kv head's rows of one block (keys, values or
 * rope keys) widened to fp32 for bfloat16 inputs. */
typedef struct {
    float *scores, *qs, *qrs, *acc, *row, *block_rows;
} scratch;

typedef struct {
    const decode_args *a;
    int64_t first, last; /* work items [first, last) */
    int64_t bad_request; /* -1, or the request with an out-of-range block */
} decode_job;

/* Softmax of s[0..n) in place (n >= 1), partial maxima and sums kept lane-wise. */
static void softmax(float *restrict s, int64_t n) {
    float lane[8];
    for (int j = 0; j < 8; j++) lane[j] = s[0];
    int64_t t = 0;
    for (; t + 8 <= n; t += 8)
        for (int j = 0; j < 8; j++) lane[j] = s[t + j] > lane[j] ? s[t + j] : lane[j];
    float top = lane[0];
    for (int j = 1; j < 8; j++) top = lane[j] > top ? lane[j] : top;
    for (; t < n; t++) top = s[t] > top ? s[t] : top;
    if (top == -INFINITY) {
        /* every score -inf (infinite inputs): zeros, as PyTorch's SDPA gives, not NaN */
        memset(s, 0, sizeof(float) * n);
        return;
    }
    for (t = 0; t < n; t++) s[t] = exp_nonpositive(s[t] - top);
    for (int j = 0; j < 8; j++) lane[j] = 0.0f;
    for (t = 0; t + 8 <= n; t += 8)
        for (int j = 0; j < 8; j++) lane[j] += s[t + j];
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += lane[j];
    for (; t < n; t++) sum += s[t];
    float inv = 1.0f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

static int64_t block_of(const decode_args *a, int64_t b, int64_t t) {
    if (t / a->block_size >= a->table_width) return -1;
    int64_t id = a->table[b * a->table_sb + t / a->block_size];
    return (id < 0 || id >= a->num_blocks) ? -1 : id;
}

/* Ask for the next block while this one is computed: blocks are scattered over the pool, so
 * the hardware prefetcher cannot guess where the next one starts. Into L2, not L1: a block
 * can be as large as L1 and would evict the one being read. */
static inline void prefetch_block(const char *block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(block + i, 0, 2);
}

/* Bytes from a block's first element to the end of its last row of its last head. */
static inline int64_t block_extent(int64_t rows, int64_t row_stride, int64_t heads,
                                   int64_t head_stride, int64_t dim, int64_t elem) {
    return ((rows - 1) * row_stride + (heads - 1) * head_stride + dim) * elem;
}

/* n values at element offset `at` of `base` as fp32: in place for fp32 inputs; bfloat16 ones
 * are widened into `buf` (exactly: a bfloat16 is the top half of the fp32 with its value). */
static inline const float *as_f32(const decode_args *a, const void *base, int64_t at, int64_t n,
                                  float *restrict buf) {
    if (!a->bf16) return (const float *)base + at;
    const uint16_t *src = (const uint16_t *)base + at;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(buf + i, &bits, sizeof bits);
    }
    return buf;
}

/* Rows [0, rows) of one kv head in one block as fp32, row r at result + r * (*stride): in
 * place for fp32 inputs, widened into `buf` (stride n) for bfloat16 ones. `at` is the element
 * offset of row 0, `row_stride` the cache's row stride. */
static inline const float *block_rows_f32(const decode_args *a, const void *base, int64_t at,
                                          int64_t row_stride, int64_t rows, int64_t n,
                                          float *restrict buf, int64_t *stride) {
    if (!a->bf16) {
        *stride = row_stride;
        return (const float *)base + at;
    }
    for (int64_t r = 0; r < rows; r++) as_f32(a, base, at + r * row_stride, n, buf + r * n);
    *stride = n;
    return buf;
}

#ifdef KVSKILL_AVX2
/* Keeps a loaded vector in a register: without it the compiler folds the load into each of
 * the four multiply-adds that use it, and the loop then waits on loads, not on arithmetic
 * (20 loads for 16 multiply-adds instead of 8). Changes no value. */
#define HOLD(x) __asm__("" : "+v"(x))

/* The eight sums of eight registers' lanes, register j's in lane j. Each is
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of its lanes l: after two hadds, lane j of
 * the low half holds the low-half sum of register j (j < 4) and the high half the high-half
 * sums; swapping halves across the two quads lines the registers up 0..7. */
static inline __m256 lane_sums_8(__m256 p0, __m256 p1, __m256 p2, __m256 p3, __m256 p4,
                                 __m256 p5, __m256 p6, __m256 p7) {
    __m256 q0123 = _mm256_hadd_ps(_mm256_hadd_ps(p0, p1), _mm256_hadd_ps(p2, p3));
    __m256 q4567 = _mm256_hadd_ps(_mm256_hadd_ps(p4, p5), _mm256_hadd_ps(p6, p7));
    __m256 low = _mm256_permute2f128_ps(q0123, q4567, 0x20);
    __m256 high = _mm256_permute2f128_ps(q0123, q4567, 0x31);
    return _mm256_add_ps(low, high);
}

/* out[j] = x . rows[j * stride] for eight rows, n a multiple of 8: eight independent chains of
 * multiply-adds, then one transposing reduction (hadd tree) instead of eight horizontal sums. */
static inline void dot_8_rows(const float *x, const float *rows, int64_t stride, int64_t n,
                              float *out) {
    __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, p4 = p0, p5 = p0, p6 = p0,
           p7 = p0;
    for (int64_t i = 0; i < n; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        p0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows + i), p0);
        p1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows + stride + i), p1);
        p2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows + 2 * stride + i), p2);
        p3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows + 3 * stride + i), p3);
        p4 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows + 4 * stride + i), p4);
        p5 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows + 5 * stride + i), p5);
        p6 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows + 6 * stride + i), p6);
        p7 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows + 7 * stride + i), p7);
    }
    _mm256_storeu_ps(out, lane_sums_8(p0, p1, p2, p3, p4, p5, p6, p7));
}

/* Query rows q[0..4) against key rows k, k + stride, ..., k + 3 * stride (n a multiple of 8):
 * sixteen chains of multiply-adds, each key slice loaded once for four queries and each query
 * slice once for four keys. out[j][0..4) gets q[j]'s four dot products. Every one is summed as
 * dot_8_rows sums it (lane-wise in the same order, then the same reduction tree), so a score
 * does not depend on which of the two computed it. */
static inline void dot_4_by_4(const float *const *q, const float *k, int64_t stride, int64_t n,
                              float *const *out) {
    __m256 p[4][4];
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < 4; r++) p[j][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + stride + i);
        __m256 k2 = _mm256_loadu_ps(k + 2 * stride + i), k3 = _mm256_loadu_ps(k + 3 * stride + i);
        HOLD(k0);
        HOLD(k1);
        HOLD(k2);
        HOLD(k3);
        for (int j = 0; j < 4; j++) {
            __m256 x = _mm256_loadu_ps(q[j] + i);
            HOLD(x);
            p[j][0] = _mm256_fmadd_ps(x, k0, p[j][0]);
            p[j][1] = _mm256_fmadd_ps(x, k1, p[j][1]);
            p[j][2] = _mm256_fmadd_ps(x, k2, p[j][2]);
            p[j][3] = _mm256_fmadd_ps(x, k3, p[j][3]);
        }
    }
    float sums[16];
    _mm256_storeu_ps(sums, lane_sums_8(p[0][0], p[0][1], p[0][2], p[0][3], p[1][0], p[1][1],
                                       p[1][2], p[1][3]));
    _mm256_storeu_ps(sums + 8, lane_sums_8(p[2][0], p[2][1], p[2][2], p[2][3], p[3][0], p[3][1],
                                           p[3][2], p[3][3]));
    for (int j = 0; j < 4; j++) memcpy(out[j], sums + 4 * j, sizeof(float) * 4);
}

/* acc[0..n) += sum over r of p[r] * rows[r * stride], n a multiple of 32: the 32 sums of a
 * slice stay in registers over all rows (one load and store per slice, not per row). */
static inline void weighted_rows_32(float *acc, const float *p, const float *rows,
                                    int64_t stride, int64_t count, int64_t n) {
    for (int64_t c = 0; c < n; c += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);
        __m256 a2 = _mm256_loadu_ps(acc + c + 16), a3 = _mm256_loadu_ps(acc + c + 24);
        for (int64_t r = 0; r < count; r++) {
            const float *row = rows + r * stride + c;
            __m256 w = _mm256_set1_ps(p[r]);
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), a3);
        }
        _mm256_storeu_ps(acc + c, a0);
        _mm256_storeu_ps(acc + c + 8, a1);
        _mm256_storeu_ps(acc + c + 16, a2);
        _mm256_storeu_ps(acc + c + 24, a3);
    }
}

/* weighted_rows_32 for m (at most four) output rows at once: acc[j] += sum over r of p[j][r] *
 * rows[r * stride]. A value slice is loaded once for all m outputs; every output element still
 * takes its rows in order, one multiply-add each, so the sums are weighted_rows_32's. Always
 * inlined, so that each constant m gets its own fully unrolled loop in registers. */
static inline __attribute__((always_inline)) void weighted_rows_by_32(
    int m, float *const *acc, const float *const *p, const float *rows, int64_t stride,
    int64_t count, int64_t n) {
    for (int64_t c = 0; c < n; c += 32) {
        __m256 s[4][4];
        for (int j = 0; j < m; j++)
            for (int e = 0; e < 4; e++) s[j][e] = _mm256_loadu_ps(acc[j] + c + 8 * e);
        for (int64_t r = 0; r < count; r++) {
            const float *row = rows + r * stride + c;
            __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
            __m256 v2 = _mm256_loadu_ps(row + 16), v3 = _mm256_loadu_ps(row + 24);
            HOLD(v0);
            HOLD(v1);
            HOLD(v2);
            HOLD(v3);
            for (int j = 0; j < m; j++) {
                __m256 w = _mm256_set1_ps(p[j][r]);
                s[j][0] = _mm256_fmadd_ps(w, v0, s[j][0]);
                s[j][1] = _mm256_fmadd_ps(w, v1, s[j][1]);
                s[j][2] = _mm256_fmadd_ps(w, v2, s[j][2]);
                s[j][3] = _mm256_fmadd_ps(w, v3, s[j][3]);
            }
        }
        for (int j = 0; j < m; j++)
            for (int e = 0; e < 4; e++) _mm256_storeu_ps(acc[j] + c + 8 * e, s[j][e]);
    }
}

/* Two query rows against eight key rows (n a multiple of 8): each key slice loaded once for
 * both. out[j][0..8) gets q[j]'s dot products, each summed as dot_8_rows sums it. (A GQA group
 * of two query heads reads its kv head's rows this way on the per-request path.) */
static inline void dot_2_by_8(const float *const *q, const float *k, int64_t stride, int64_t n,
                              float *const *out) {
    __m256 p[2][8];
    for (int j = 0; j < 2; j++)
        for (int r = 0; r < 8; r++) p[j][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m256 x0 = _mm256_loadu_ps(q[0] + i), x1 = _mm256_loadu_ps(q[1] + i);
        HOLD(x0);
        HOLD(x1);
        for (int r = 0; r < 8; r++) {
            __m256 kr = _mm256_loadu_ps(k + r * stride + i);
            HOLD(kr);
            p[0][r] = _mm256_fmadd_ps(x0, kr, p[0][r]);
            p[1][r] = _mm256_fmadd_ps(x1, kr, p[1][r]);
        }
    }
    for (int j = 0; j < 2; j++)
        _mm256_storeu_ps(out[j], lane_sums_8(p[j][0], p[j][1], p[j][2], p[j][3], p[j][4], p[j][5],
                                             p[j][6], p[j][7]));
}

#endif

/* scores[r] (+)= x . rows[r * stride] for r < count; `add` keeps what scores holds (the rope
 * part of MLA is added to the latent part). */
static void score_rows(const float *x, const float *rows, int64_t stride, int64_t count,
                       int64_t n, int add, float *restrict scores) {
    int64_t r = 0;
#ifdef KVSKILL_AVX2
    if (n % 8 == 0) {
        float eight[8];
        for (; r + 8 <= count; r += 8) {
            dot_8_rows(x, rows + r * stride, stride, n, eight);
            for (int j = 0; j < 8; j++) scores[r + j] = add ? scores[r + j] + eight[j] : eight[j];
        }
    }
#endif
    for (; r < count; r++) {
        float s = dot(x, rows + r * stride, n);
        scores[r] = add ? scores[r] + s : s;
    }
}

/* acc[0..n) += sum over r < count of p[r] * rows[r * stride], rows taken in order. */
static void accumulate_rows(float *restrict acc, const float *p, const float *rows,
                            int64_t stride, int64_t count, int64_t n) {
#ifdef KVSKILL_AVX2
    if (n % 32 == 0) {
        weighted_rows_32(acc, p, rows, stride, count, n);
        return;
    }
#endif
    for (int64_t r = 0; r < count; r++) {
        const float *restrict row = rows + r * stride;
        for (int64_t i = 0; i < n; i++) acc[i] += p[r] * row[i];
    }
}

/* score_rows for `count` query rows q[j] against the same key rows, scores into out[j]: four
 * queries at a time (dot_4_by_4), then two (dot_2_by_8), share each key load where the key
 * rows come in full groups of eight; the scores are score_rows's, bit for bit. Key rows are
 * the outer loop, so a few key rows serve every query row from L1 while they are there: the
 * caller keeps `count` small enough (QUERY_GROUP) for the query rows to stay in L1 too. */
static void score_rows_many(const float *const *q, float *const *out, int64_t count,
                            const float *rows, int64_t stride, int64_t rows_count, int64_t n) {
    int64_t j = 0;
#ifdef KVSKILL_AVX2
    if (n % 8 == 0) {
        int64_t grouped = rows_count / 8 * 8, quads = count / 4 * 4;
        for (int64_t r = 0; r < grouped && quads; r += 4)
            for (int64_t e = 0; e < quads; e += 4) {
                float *at[4] = {out[e] + r, out[e + 1] + r, out[e + 2] + r, out[e + 3] + r};
                dot_4_by_4(q + e, rows + r * stride, stride, n, at);
            }
        j = quads;
        if (j + 2 <= count) {
            for (int64_t r = 0; r < grouped; r += 8) {
                float *at[2] = {out[j] + r, out[j + 1] + r};
                dot_2_by_8(q + j, rows + r * stride, stride, n, at);
            }
            j += 2;
        }
        for (int64_t e = 0; e < j && grouped < rows_count; e++)
            score_rows(q[e], rows + grouped * stride, stride, rows_count - grouped, n, 0,
                       out[e] + grouped);
    }
#endif
    for (; j < count; j++) score_rows(q[j], rows, stride, rows_count, n, 0, out[j]);
}

/* accumulate_rows for `count` output rows acc[j] with weights p[j] over the same value rows,
 * four (then two) at a time where the vector loop applies; the sums are accumulate_rows's,
 * bit for bit. */
static void accumulate_rows_many(float *const *acc, const float *const *p, int64_t count,
                                 const float *rows, int64_t stride, int64_t rows_count,
                                 int64_t n) {
    int64_t j = 0;
#ifdef KVSKILL_AVX2
    if (n % 32 == 0) {
        for (; j + 4 <= count; j += 4)
            weighted_rows_by_32(4, acc + j, p + j, rows, stride, rows_count, n);
        for (; j + 2 <= count; j += 2)
            weighted_rows_by_32(2, acc + j, p + j, rows, stride, rows_count, n);
    }
#endif
    for (; j < count; j++) accumulate_rows(acc[j], p[j], rows, stride, rows_count, n);
}

/* Request b's queries, scaled, as fp32 rows: qs[n * d] (and the rope parts in w->qrs). */
static void scale_queries(const decode_args *a, int64_t b, float *restrict qs, const scratch *w) {
    int64_t d = a->dim, dr = a->dim_rope;
    for (int64_t n = 0; n < a->heads; n++) {
        const float *src = as_f32(a, a->q, b * a->q_sb + n * a->q_sn, d, w->row);
        for (int64_t i = 0; i < d; i++) qs[n * d + i] = src[i] * a->scale;
        if (dr) {
            src = as_f32(a, a->qr, b * a->qr_sb + n * a->qr_sn, dr, w->row);
            for (int64_t i = 0; i < dr; i++) w->qrs[n * dr + i] = src[i] * a->scale;
        }
    }
}

/* scores[n * len + t] = scale * q_n . k_t for request b's tokens t >= from (a block
 * boundary); query head n reads kv head n / g_count. Returns 0, or -1 on a bad block. */
static int score_blocks(const decode_args *a, int64_t b, const float *qs, float *scores,
                        int64_t from, const scratch *w) {
    int64_t kv_heads = a->kv_heads, g_count = a->heads / kv_heads;
    int64_t len = a->kv_lens[b], d = a->dim, bs = a->block_size;
    int64_t elem = a->bf16 ? 2 : 4, dr = a->dim_rope, stride;
    for (int64_t t0 = from; t0 < len; t0 += bs) {
        int64_t id = block_of(a, b, t0);
        if (id < 0) return -1;
        int64_t rows = len - t0 < bs ? len - t0 : bs, next = block_of(a, b, t0 + bs);
        if (t0 + bs < len && next >= 0)
            prefetch_block((const char *)a->k + next * a->k_sblk * elem,
                           block_extent(bs, a->k_srow, kv_heads, a->k_shead, d, elem));
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *keys = block_rows_f32(a, a->k, id * a->k_sblk + h * a->k_shead,
                                               a->k_srow, rows, d, w->block_rows, &stride);
            for (int64_t n = h * g_count; n < (h + 1) * g_count; n += 4) {
                int64_t m = (h + 1) * g_count - n < 4 ? (h + 1) * g_count - n : 4;
                const float *q_rows[4];
                float *score_out[4];
                for (int64_t e = 0; e < m; e++) {
                    q_rows[e] = qs + (n + e) * d;
                    score_out[e] = scores + (n + e) * len + t0;
                }
                score_rows_many(q_rows, score_out, m, keys, stride, rows, d);
            }
            if (!dr) continue;
            keys = block_rows_f32(a, a->kr, id * a->kr_sblk + h * a->kr_shead, a->kr_srow, rows,
                                  dr, w->block_rows, &stride);
            for (int64_t n = h * g_count; n < (h + 1) * g_count; n++)
                score_rows(w->qrs + n * dr, keys, stride, rows, dr, 1, scores + n * len + t0);
        }
    }
    return 0;
}

/* acc[n * dv] += sum over request b's tokens t >= from of p_n[t] * v_t, blocks in order. */
static void value_blocks(const decode_args *a, int64_t b, const float *scores, float *acc,
                         int64_t from, const scratch *w) {
    int64_t kv_heads = a->kv_heads, g_count = a->heads / kv_heads;
    int64_t len = a->kv_lens[b], dv = a->dim_v, bs = a->block_size;
    int64_t elem = a->bf16 ? 2 : 4, stride;
    for (int64_t t0 = from; t0 < len; t0 += bs) {
        int64_t id = block_of(a, b, t0);
        int64_t rows = len - t0 < bs ? len - t0 : bs, next = block_of(a, b, t0 + bs);
        if (t0 + bs < len && next >= 0)
            prefetch_block((const char *)a->v + next * a->v_sblk * elem,
                           block_extent(bs, a->v_srow, kv_heads, a->v_shead, dv, elem));
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *values = block_rows_f32(a, a->v, id * a->v_sblk + h * a->v_shead,
                                                 a->v_srow, rows, dv, w->block_rows, &stride);
            for (int64_t n = h * g_count; n < (h + 1) * g_count; n += 4) {
                int64_t m = (h + 1) * g_count - n < 4 ? (h + 1) * g_count - n : 4;
                const float *weights[4];
                float *acc_rows[4];
                for (int64_t e = 0; e < m; e++) {
                    weights[e] = scores + (n + e) * len + t0;
                    acc_rows[e] = acc + (n + e) * dv;
                }
                accumulate_rows_many(acc_rows, weights, m, values, stride, rows, dv);
            }
        }
    }
}

/* One request, all heads, block by block and kv head by kv head: each cached row is read once
 * for the scores and once for the values; the query heads of a group reuse it from L1. */
static void run_item(const decode_args *a, int64_t b, const scratch *w, int64_t *bad_request) {
    int64_t heads = a->heads, len = a->kv_lens[b], dv = a->dim_v;
    float *out = a->out + b * heads * dv, *scores = w->scores, *acc = w->acc;
    if (len <= 0) {
        memset(out, 0, sizeof(float) * heads * dv);
        return;
    }
    scale_queries(a, b, w->qs, w);
    if (score_blocks(a, b, w->qs, scores, 0, w) < 0) {
        *bad_request = b;
        memset(out, 0, sizeof(float) * heads * dv);
        return;
    }
    for (int64_t n = 0; n < heads; n++) softmax(scores + n * len, len);
    memset(acc, 0, sizeof(float) * heads * dv);
    value_blocks(a, b, scores, acc, 0, w);
    memcpy(out, acc, sizeof(float) * heads * dv);
}

/* Leading blocks every request holds in full under the same block id (a prefix-cache hit
 * shared by the whole batch), or 0. */
static int64_t shared_blocks(const decode_args *a) {
    if (a->batch < 2) return 0;
    int64_t shortest = a->kv_lens[0];
    for (int64_t b = 1; b < a->batch; b++)
        shortest = a->kv_lens[b] < shortest ? a->kv_lens[b] : shortest;
    int64_t count = 0, limit = shortest / a->block_size;
    limit = limit < a->table_width ? limit : a->table_width;
    for (; count < limit; count++) {
        int64_t id = a->table[count];
        if (id < 0 || id >= a->num_blocks) break;
        int64_t b = 1;
        while (b < a->batch && a->table[b * a->table_sb + count] == id) b++;
        if (b < a->batch) break;
    }
    return count;
}

static scratch alloc_scratch(const decode_args *a, int64_t longest) {
    int64_t widest = a->dim > a->dim_v ? a->dim : a->dim_v;
    int64_t rope = a->dim_rope > 0 ? a->dim_rope : 1;
    widest = widest > rope ? widest : rope;
    scratch w = {
        .scores = malloc(sizeof(float) * a->heads * longest),
        .qs = malloc(sizeof(float) * a->heads * a->dim),
        .qrs = malloc(sizeof(float) * a->heads * rope),
        .acc = malloc(sizeof(float) * a->heads * a->dim_v),
        .row = malloc(sizeof(float) * widest),
        /* only bfloat16 rows are widened into it */
        .block_rows = malloc(sizeof(float) * (a->bf16 ? a->block_size * widest : 1)),
    };
    return w;
}

static int scratch_ok(const scratch *w) {
    return w->scores && w->qs && w->qrs && w->acc && w->row && w->block_rows;
}

static void free_scratch(scratch *w) {
    free(w->scores);
    free(w->qs);
    free(w->qrs);
    free(w->acc);
    free(w->row);
    free(w->block_rows);
}

static inline int64_t thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static void *run_job(void *arg) {
    decode_job *job = (decode_job *)arg;
    const decode_args *a = job->a;
    int64_t longest = 1;
    for (int64_t it = job->first; it < job->last; it++)
        longest = a->kv_lens[it] > longest ? a->kv_lens[it] : longest;
    scratch w = alloc_scratch(a, longest);
    if (!scratch_ok(&w)) {
        job->bad_request = -2;
    } else {
        for (int64_t it = job->first; it < job->last && job->bad_request == -1; it++)
            run_item(a, it, &w, &job->bad_request);
    }
    free_scratch(&w);
    return NULL;
}

/* Row pointers of one shared-stage item: its query (or score) rows and the rows they write. */
typedef struct {
    const float **from;
    float **to;
} row_ptrs;

/* Query rows the shared stages take at a time: 16 rows of 128 floats (8 KiB) stay in L1
 * beside the key rows being read. */
#define QUERY_GROUP 16

/* Packed value rows stage 4 applies at a time to every output row: 64 rows of 128 floats
 * (32 KiB) are read from L1 by all the output rows before the next 64 are loaded. */
#define VALUE_ROWS 64

/* Shared blocks packed at a time for one kv head: about 512 rows (256 KiB at 128 floats a
 * row), read from L2 by every query row group. */
static inline int64_t pack_blocks(int64_t block_size) {
    return block_size >= 512 ? 1 : 512 / block_size;
}

/* Rows of kv head h in shared blocks [c0, c1), one block after another, into `tile` (rows of
 * n floats). In the cache's token-major layouts one head's rows of a block are a whole token
 * (all heads) apart, often 4 KiB: every row then falls in the same L1 set, and rows read again
 * and again (for every query row) keep evicting each other; packed, they are read in order.
 * Copying is exact, so results do not change. */
static void pack_shared(const decode_args *a, const float *cache, int64_t blk_stride,
                        int64_t row_stride, int64_t head_offset, int64_t c0, int64_t c1,
                        int64_t n, float *restrict tile) {
    int64_t bs = a->block_size;
    for (int64_t c = c0; c < c1; c++) {
        const float *src = cache + a->table[c] * blk_stride + head_offset;
        float *dst = tile + (c - c0) * bs * n;
        for (int64_t r = 0; r < bs; r++) memcpy(dst + r * n, src + r * row_stride, sizeof(float) * n);
    }
}

/* ptrs[j] = the score row of the j-th (request, query head) of kv head h over requests
 * [lo, hi), at token `at` of each request's row. */
static void point_at_scores(const decode_args *a, int64_t h, int64_t lo, int64_t hi,
                            const float *scores, int64_t longest, int64_t at, const float **ptrs) {
    int64_t heads = a->heads, g_count = heads / a->kv_heads, j = 0;
    for (int64_t b = lo; b < hi; b++)
        for (int64_t n = h * g_count; n < (h + 1) * g_count; n++)
            ptrs[j++] = scores + b * heads * longest + n * a->kv_lens[b] + at;
}

/* Stage 2 of run_shared for kv head h and requests [lo, lo + span): scores over the shared
 * blocks, packed a few hundred rows at a time and read by QUERY_GROUP query rows at a time. */
static void shared_scores(const decode_args *a, int64_t h, int64_t lo, int64_t span,
                          int64_t shared, const float *qs, float *scores, int64_t longest,
                          float *tile, row_ptrs rows) {
    int64_t heads = a->heads, d = a->dim, bs = a->block_size, g_count = heads / a->kv_heads;
    int64_t hi = lo + span < a->batch ? lo + span : a->batch, count = 0, step = pack_blocks(bs);
    for (int64_t b = lo; b < hi; b++)
        for (int64_t n = h * g_count; n < (h + 1) * g_count; n++)
            rows.from[count++] = qs + (b * heads + n) * d;
    for (int64_t c0 = 0; c0 < shared && count; c0 += step) {
        int64_t c1 = c0 + step < shared ? c0 + step : shared;
        pack_shared(a, (const float *)a->k, a->k_sblk, a->k_srow, h * a->k_shead, c0, c1, d, tile);
        /* score_rows_many takes key rows in groups of eight and the rest one by one, each
         * way in its own order of addition; the per-request path groups each block's rows, so
         * blocks not a multiple of eight rows are scored block by block here too. */
        int64_t packed = (c1 - c0) * bs, run = bs % 8 == 0 ? packed : bs;
        for (int64_t r0 = 0; r0 < packed; r0 += run) {
            /* (the rows are written here: `scores` is this stage's own, not const) */
            point_at_scores(a, h, lo, hi, scores, longest, c0 * bs + r0,
                            (const float **)rows.to);
            for (int64_t g = 0; g < count; g += QUERY_GROUP)
                score_rows_many(rows.from + g, rows.to + g,
                                count - g < QUERY_GROUP ? count - g : QUERY_GROUP,
                                tile + r0 * d, d, run, d);
        }
    }
}

/* Stage 4 of run_shared for kv head h and requests [lo, lo + span): the shared blocks'
 * values, weighted by the softmaxed scores, into the output rows, packed as in stage 2; each
 * output row takes the packed rows in order (four output rows at a time). */
static void shared_values(const decode_args *a, int64_t h, int64_t lo, int64_t span,
                          int64_t shared, const float *scores, int64_t longest, float *tile,
                          row_ptrs rows) {
    int64_t heads = a->heads, dv = a->dim_v, bs = a->block_size, g_count = heads / a->kv_heads;
    int64_t hi = lo + span < a->batch ? lo + span : a->batch, count = 0, step = pack_blocks(bs);
    for (int64_t b = lo; b < hi; b++)
        for (int64_t n = h * g_count; n < (h + 1) * g_count; n++)
            rows.to[count++] = a->out + (b * heads + n) * dv;
    for (int64_t c0 = 0; c0 < shared && count; c0 += step) {
        int64_t c1 = c0 + step < shared ? c0 + step : shared;
        pack_shared(a, (const float *)a->v, a->v_sblk, a->v_srow, h * a->v_shead, c0, c1, dv,
                    tile);
        int64_t packed = (c1 - c0) * bs;
        for (int64_t r0 = 0; r0 < packed; r0 += VALUE_ROWS) {
            point_at_scores(a, h, lo, hi, scores, longest, c0 * bs + r0, rows.from);
            accumulate_rows_many(rows.to, rows.from, count, tile + r0 * dv, dv,
                                 packed - r0 < VALUE_ROWS ? packed - r0 : VALUE_ROWS, dv);
        }
    }
}

/* Shared-prefix decode: the first `shared` blocks are the same blocks for every request, so
 * their rows are read once per kv head for all requests' queries (from L1) instead of once per
 * request. Stages, each split over threads without two threads writing one value:
 *   1. per request: scaled queries;
 *   2. per kv head (and request range): scores over the shared blocks;
 *   3. per request: scores over its own blocks, softmax;
 *   4. per kv head (and request range): the shared blocks' values into the output;
 *   5. per request: its own blocks' values.
 * Stages 2 and 4 take the query rows of a kv head four at a time, so each key or value slice
 * loaded serves four of them, and pack the shared rows of the head so that a few of them serve
 * every query row from L1 (a batch of 32 requests over a 1024-token shared prefix, 16 heads
 * over 8 kv heads of 128, medians of 200 interleaved calls: four rows at a time 4.8 -> 4.0 ms
 * a call at 2 threads; then with the packing and the query loads held, 3.39 -> 2.90 ms at 2
 * threads and 7.35 -> 5.95 ms at one).
 * Every (request, head) sees the same operations in the same order as on the per-request path,
 * so the results are identical to it, bit for bit. fp32 caches without a rope part only.
 * Returns as kvskill_paged_decode, or 2 when the buffers cannot be had (the caller then runs
 * the per-request path). */
static int64_t run_shared(const decode_args *a, int64_t shared, int64_t threads) {
    int64_t batch = a->batch, heads = a->heads, d = a->dim, dv = a->dim_v;
    int64_t kv_heads = a->kv_heads, bs = a->block_size;
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) longest = a->kv_lens[b] > longest ? a->kv_lens[b] : longest;
    /* 256 MiB of scores at most; beyond that the per-request path (one request's scores at a
     * time per thread) is the one that fits */
    if ((double)batch * heads * longest * sizeof(float) > 268435456.0) return 2;
    float *scores = malloc(sizeof(float) * batch * heads * longest);
    float *qs = malloc(sizeof(float) * batch * heads * d);
    char *failed = calloc(batch, 1); /* requests whose own blocks name a bad block */
    scratch ws[64];
    float *tiles[64];
    row_ptrs ptrs[64];
    int64_t ok = scores && qs && failed, most_rows = batch * (heads / kv_heads);
    for (int64_t j = 0; j < threads; j++) {
        ws[j] = alloc_scratch(a, 1);
        tiles[j] = malloc(sizeof(float) * pack_blocks(bs) * bs * (d > dv ? d : dv));
        ptrs[j].from = malloc(sizeof(float *) * most_rows);
        ptrs[j].to = malloc(sizeof(float *) * most_rows);
        ok = ok && scratch_ok(&ws[j]) && tiles[j] && ptrs[j].from && ptrs[j].to;
    }
    int64_t bad = -1;
    if (ok) {
        /* per-head stages: kv heads times request ranges, enough items for every thread */
        int64_t ranges = kv_heads >= threads ? 1 : threads;
        int64_t span = (batch + ranges - 1) / ranges, items = kv_heads * ranges;
        memset(a->out, 0, sizeof(float) * batch * heads * dv);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
        {
            const scratch *w = &ws[thread_index()];
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t b = 0; b < batch; b++) scale_queries(a, b, qs + b * heads * d, w);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t it = 0; it < items; it++)
                shared_scores(a, it / ranges, (it % ranges) * span, span, shared, qs, scores,
                              longest, tiles[thread_index()], ptrs[thread_index()]);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t b = 0; b < batch; b++) {
                int64_t len = a->kv_lens[b];
                float *sc = scores + b * heads * longest;
                if (score_blocks(a, b, qs + b * heads * d, sc, shared * bs, w) < 0) {
                    failed[b] = 1;
                    continue;
                }
                for (int64_t n = 0; n < heads; n++) softmax(sc + n * len, len);
            }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t it = 0; it < items; it++)
                shared_values(a, it / ranges, (it % ranges) * span, span, shared, scores,
                              longest, tiles[thread_index()], ptrs[thread_index()]);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t b = 0; b < batch; b++)
                if (!failed[b])
                    value_blocks(a, b, scores + b * heads * longest, a->out + b * heads * dv,
                                 shared * bs, w);
        }
        for (int64_t b = batch - 1; b >= 0; b--)
            if (failed[b]) bad = b;
    }
    free(scores);
    free(qs);
    free(failed);
    for (int64_t j = 0; j < threads; j++) {
        free_scratch(&ws[j]);
        free(tiles[j]);
        free(ptrs[j].from);
        free(ptrs[j].to);
    }
    if (!ok) return 2;
    return bad >= 0 ? 1 + bad : 0;
}

/* Returns 0 on success, 1 + request index for an out-of-range block, -1 out of memory. */
int64_t kvskill_paged_decode(const decode_args *a, int64_t threads) {
    int64_t items = a->batch, total = 0;
    for (int64_t b = 0; b < a->batch; b++) total += (a->kv_lens[b] > 0 ? a->kv_lens[b] : 0) + 1;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    int64_t shared = a->bf16 || a->dim_rope > 0 ? 0 : shared_blocks(a);
    if (shared >= 2) {
        int64_t code = run_shared(a, shared, threads);
        if (code != 2) return code;
    }
    if (threads > items) threads = items;
    decode_job jobs[64];
    pthread_t ids[64];
    /* Contiguous ranges of items with about equal key counts (+1 per item for its fixed cost). */
    int64_t item = 0, done = 0;
    for (int64_t j = 0; j < threads; j++) {
        int64_t goal = total * (j + 1) / threads;
        jobs[j].a = a;
        jobs[j].first = item;
        jobs[j].bad_request = -1;
        while (item < items && (j == threads - 1 || done < goal)) {
            int64_t len = a->kv_lens[item];
            done += (len > 0 ? len : 0) + 1;
            item++;
        }
        jobs[j].last = item;
    }
#ifdef _OPENMP
    /* Built with -fopenmp, this library needs libgomp.so.1, which the dynamic loader resolves
     * to the copy torch already loaded (Linux wheels of torch ship GNU OpenMP; with another
     * OpenMP runtime in torch this would be a second pool, as correct as pthreads): the jobs
     * run on torch's own OpenMP threads, which are
     * awake (spinning) after the step's matrix products. Threads of our own would compete
     * with them for the cores; measured in a decode step, that made two threads slower than
     * one. */
    (void)ids;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t j = 0; j < threads; j++) run_job(&jobs[j]);
#else
    int64_t started = 0;
    for (int64_t j = 1; j < threads; j++) {
        if (pthread_create(&ids[j], NULL, run_job, &jobs[j]) != 0) break;
        started = j;
    }
    /* Items of threads that could not start run here. */
    run_job(&jobs[0]);
    for (int64_t j = started + 1; j < threads; j++) run_job(&jobs[j]);
    for (int64_t j = 1; j <= started; j++) pthread_join(ids[j], NULL);
#endif
    for (int64_t j = 0; j < threads; j++) {
        if (jobs[j].bad_request == -2) return -1;
        if (jobs[j].bad_request >= 0) return 1 + jobs[j].bad_request;
    }
    return 0;
}
