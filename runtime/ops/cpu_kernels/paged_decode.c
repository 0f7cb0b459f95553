/* Decode attention over a paged KV cache, fp32, for the CPU runtime.
 *
 * One query row per request attends to the request's first kv_lens[b] cached tokens, read in
 * place through its block table (no gather into a dense copy):
 *
 *     token t of request b:  block = table[b, t / block_size], row = t % block_size
 *     key of kv head h:      k + block * k_sblk + row * k_srow + h * k_shead   (D floats)
 *
 * Query head n reads kv head n / G (G = N / KVN, groups contiguous), as the fused-attention
 * operator does. The G query heads of one kv head are one work item, so every cached key and
 * value row is read once per step. Scores are scaled, softmaxed in fp32 and applied to the
 * values; a request with no keys gets zeros. Work items are split over threads by their key
 * count.
 *
 * Returns 0, or 1 + the request index whose block table names a block outside the cache.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;
    int64_t q_sb, q_sn;
    const float *k;
    int64_t k_sblk, k_srow, k_shead;
    const float *v;
    int64_t v_sblk, v_srow, v_shead;
    const int32_t *table;
    int64_t table_sb, table_width, num_blocks;
    int64_t block_size;
    const int64_t *kv_lens;
    int64_t batch, heads, kv_heads, dim, dim_v;
    float scale;
    float *out; /* [batch, heads, dim_v], contiguous */
} decode_args;

typedef struct {
    const decode_args *a;
    int64_t first, last; /* work items [first, last) */
    int64_t bad_request; /* -1, or the request with an out-of-range block */
} decode_job;

/* Sixteen independent partial sums: lets the compiler keep them in vector registers. */
static inline float dot(const float *restrict x, const float *restrict y, int64_t n) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += x[i + j] * y[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += x[i] * y[i];
    for (int j = 0; j < 16; j++) s += part[j];
    return s;
}

static int64_t block_of(const decode_args *a, int64_t b, int64_t t) {
    if (t / a->block_size >= a->table_width) return -1;
    int64_t id = a->table[b * a->table_sb + t / a->block_size];
    return (id < 0 || id >= a->num_blocks) ? -1 : id;
}

static void run_item(const decode_args *a, int64_t item, float *scores, float *qs, float *acc,
                     int64_t *bad_request) {
    int64_t b = item / a->kv_heads, h = item % a->kv_heads;
    int64_t g_count = a->heads / a->kv_heads, len = a->kv_lens[b];
    int64_t d = a->dim, dv = a->dim_v, bs = a->block_size;
    float *out = a->out + (b * a->heads + h * g_count) * dv;
    if (len <= 0) {
        memset(out, 0, sizeof(float) * g_count * dv);
        return;
    }
    for (int64_t g = 0; g < g_count; g++) {
        const float *src = a->q + b * a->q_sb + (h * g_count + g) * a->q_sn;
        for (int64_t i = 0; i < d; i++) qs[g * d + i] = src[i] * a->scale;
    }
    /* scores[g * len + t] = scale * q_g . k_t */
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        int64_t id = block_of(a, b, t0);
        if (id < 0) {
            *bad_request = b;
            memset(out, 0, sizeof(float) * g_count * dv);
            return;
        }
        const float *kb = a->k + id * a->k_sblk + h * a->k_shead;
        int64_t rows = len - t0 < bs ? len - t0 : bs;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < g_count; g++)
                scores[g * len + t0 + r] = dot(qs + g * d, kb + r * a->k_srow, d);
    }
    for (int64_t g = 0; g < g_count; g++) {
        float *s = scores + g * len, top = s[0], sum = 0.0f;
        for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - top);
            sum += s[t];
        }
        float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * g_count * dv);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const float *vb = a->v + block_of(a, b, t0) * a->v_sblk + h * a->v_shead;
        int64_t rows = len - t0 < bs ? len - t0 : bs;
        for (int64_t r = 0; r < rows; r++) {
            const float *restrict vr = vb + r * a->v_srow;
            for (int64_t g = 0; g < g_count; g++) {
                float p = scores[g * len + t0 + r];
                float *restrict dst = acc + g * dv;
                for (int64_t i = 0; i < dv; i++) dst[i] += p * vr[i];
            }
        }
    }
    memcpy(out, acc, sizeof(float) * g_count * dv);
}

static void *run_job(void *arg) {
    decode_job *job = (decode_job *)arg;
    const decode_args *a = job->a;
    int64_t g_count = a->heads / a->kv_heads, longest = 1;
    for (int64_t it = job->first; it < job->last; it++) {
        int64_t len = a->kv_lens[it / a->kv_heads];
        longest = len > longest ? len : longest;
    }
    float *scores = malloc(sizeof(float) * g_count * longest);
    float *qs = malloc(sizeof(float) * g_count * a->dim);
    float *acc = malloc(sizeof(float) * g_count * a->dim_v);
    if (!scores || !qs || !acc) {
        job->bad_request = -2;
    } else {
        for (int64_t it = job->first; it < job->last && job->bad_request == -1; it++)
            run_item(a, it, scores, qs, acc, &job->bad_request);
    }
    free(scores);
    free(qs);
    free(acc);
    return NULL;
}

/* Returns 0 on success, 1 + request index for an out-of-range block, -1 out of memory. */
int64_t kvskill_paged_decode(const decode_args *a, int64_t threads) {
    int64_t items = a->batch * a->kv_heads, total = 0;
    for (int64_t b = 0; b < a->batch; b++) total += (a->kv_lens[b] > 0 ? a->kv_lens[b] : 0) + 1;
    total *= a->kv_heads;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
    decode_job jobs[64];
    pthread_t ids[64];
    if (threads > 64) threads = 64;
    /* Contiguous ranges of items with about equal key counts (+1 per item for its fixed cost). */
    int64_t item = 0, done = 0;
    for (int64_t j = 0; j < threads; j++) {
        int64_t goal = total * (j + 1) / threads;
        jobs[j].a = a;
        jobs[j].first = item;
        jobs[j].bad_request = -1;
        while (item < items && (j == threads - 1 || done < goal)) {
            int64_t len = a->kv_lens[item / a->kv_heads];
            done += (len > 0 ? len : 0) + 1;
            item++;
        }
        jobs[j].last = item;
    }
    int64_t started = 0;
    for (int64_t j = 1; j < threads; j++) {
        if (pthread_create(&ids[j], NULL, run_job, &jobs[j]) != 0) break;
        started = j;
    }
    /* Items of threads that could not start run here. */
    run_job(&jobs[0]);
    for (int64_t j = started + 1; j < threads; j++) run_job(&jobs[j]);
    for (int64_t j = 1; j <= started; j++) pthread_join(ids[j], NULL);
    for (int64_t j = 0; j < threads; j++) {
        if (jobs[j].bad_request == -2) return -1;
        if (jobs[j].bad_request >= 0) return 1 + jobs[j].bad_request;
    }
    return 0;
}
