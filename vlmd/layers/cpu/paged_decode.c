/* Paged decode attention on the CPU: every decode's query heads against its whole cached
 * context, read in place through the block table (no gathered copy of any context).
 *
 * Built with the package, once per instruction-set level (setup.py, variants.py), and
 * loaded with ctypes (library.py). One work item is one decode's part of its context,
 * all heads: a block's K (then V) rows for every KV head are one contiguous run of the
 * cache, which the hardware prefetcher streams (an item per KV head read a quarter of each
 * row and ran latency-bound: 4x slower at 16k tokens). GQA: the G query heads of a KV head
 * share each key and value row read. Softmax is online, per chunk of a block. Few decodes
 * with long contexts are split into parts, merged exactly by the log-sum-exp rule, so
 * every thread has work. Decodes whose tables start with the same blocks (the prefix
 * cache's shared prompt) read those once for all of them (cascade): an item then stacks
 * the queries of several decodes (attend_stacked: a small matrix product per KV head),
 * and each decode merges its shared and own parts. A sliding-window layer's decodes read
 * only their window's tokens, the same way (``window``).
 *
 * Parallel over items with OpenMP: loaded into a process that already holds torch's
 * libgomp, the soname resolves to that runtime, and the calling thread reuses its team.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"
#include "kernels.h"

#include "vector_exp.h"

#define CHUNK 16       /* tokens whose scores are held at once */
#define MAX_HEADS 128  /* query heads of one decode */
#define MAX_QUERIES 256  /* queries of one work item (decodes sharing a prefix are stacked) */
#define MAX_DIM 256
#define MIN_PART 128   /* fewest tokens a part of a split context holds */

enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1 };

/* exp for x <= 0 (scores minus their running maximum), Cephes-style: ~1 ulp, vectorises. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return y * scale.f;
}

/* count values from the cache as float32 (bfloat16 widened: its bits are float32's top half). */
static inline const float *rows_as_float(const void *cache, int64_t offset, int64_t count, int dtype, float *buffer) {
    if (dtype == KV_FLOAT32) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) {
        union { uint32_t u; float f; } v;
        v.u = (uint32_t)src[i] << 16;
        buffer[i] = v.f;
    }
    return buffer;
}

typedef struct {
    int heads, kv_heads, group, dim, block_size, dtype;
    int dot_scores; /* bfloat16 keys' scores by AVX512-BF16 (attend_part_dot, stacked_scores_dot) */
} Shape;

/* Tokens of the chunk that starts at ``token``: to the end of its block, of the part, or
 * CHUNK, whichever comes first. */
static inline int chunk_tokens(const Shape *s, int token, int end) {
    int count = s->block_size - token % s->block_size;
    if (count > end - token) count = end - token;
    return count > CHUNK ? CHUNK : count;
}

/* Offset (in elements) of the chunk's first row: its block's slot times a row's width. */
static inline int64_t chunk_offset(const Shape *s, const int32_t *table, int token, int64_t token_floats) {
    return ((int64_t)table[token / s->block_size] * s->block_size + token % s->block_size) * token_floats;
}

/* An item's running softmax state, empty: no key seen. */
static inline void start_part(float *acc, float *maxes, float *sums, int num_queries, int dim) {
    for (int h = 0; h < num_queries; h++) {
        maxes[h] = -INFINITY;
        sums[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num_queries * dim);
}

/* One item: Q queries (pre-scaled, [Q, D]: the heads of one decode, or of several decodes
 * stacked, query j being head j % H) against tokens [first, end) of one block table.
 * Leaves acc [Q, D] (unnormalised), maxes [Q], sums [Q]. This is the generic copy, for a
 * head size the vector copies below do not cover; they do the same, faster. */
static void attend_part_generic(
        const Shape *s, const float *queries, int num_queries, const void *k_cache, const void *v_cache,
        const int32_t *table, int first, int end, float *acc, float *maxes, float *sums, float *buffer) {
    const int dim = s->dim, group = s->group, heads = s->heads, kv_heads = s->kv_heads;
    const int64_t token_floats = (int64_t)kv_heads * dim;
    float scores[MAX_QUERIES][CHUNK];
    start_part(acc, maxes, sums, num_queries, dim);
    int token = first;
    while (token < end) {
        const int count = chunk_tokens(s, token, end);
        const int64_t at = chunk_offset(s, table, token, token_floats);
        const float *keys = rows_as_float(k_cache, at, count * token_floats, s->dtype, buffer);
        for (int t = 0; t < count; t++) {
            for (int j = 0; j < num_queries; j++) {
                const float *key = keys + t * token_floats + ((j % heads) / group) * dim;
                {
                    const int h = j;
                    const float *q = queries + h * dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < dim; d++) dot += q[d] * key[d];
                    scores[h][t] = dot;
                }
            }
        }
        for (int h = 0; h < num_queries; h++) {
            float chunk_max = maxes[h];
            for (int t = 0; t < count; t++) chunk_max = scores[h][t] > chunk_max ? scores[h][t] : chunk_max;
            float correction = exp_nonpositive(maxes[h] - chunk_max);
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int t = 0; t < count; t++) {
                float p = exp_nonpositive(scores[h][t] - chunk_max);
                scores[h][t] = p;
                total += p;
            }
            sums[h] = sums[h] * correction + total;
            maxes[h] = chunk_max;
            if (correction != 1.0f) {
                float *a = acc + h * dim;
#pragma omp simd
                for (int d = 0; d < dim; d++) a[d] *= correction;
            }
        }
        const float *values = rows_as_float(v_cache, at, count * token_floats, s->dtype, buffer);
        for (int h = 0; h < num_queries; h++) {
            const float *column = values + ((h % heads) / group) * dim;
            float *a = acc + h * dim;
            for (int t = 0; t < count; t++) {
                const float p = scores[h][t], *value = column + t * token_floats;
#pragma omp simd
                for (int d = 0; d < dim; d++) a[d] += p * value[d];
            }
        }
        token += count;
    }
}

/* The vector path: DIM a compile-time multiple of 8 (the copies below), GCC vector types of 8 floats
 * (one AVX2 register; AVX-512 hosts run them as well). Eight tokens' dot products are
 * summed across lanes at once (a transpose-reduce: 7 adds instead of 8 serial lane
 * sums), softmax and exp run on vectors, and each head's accumulator stays in registers
 * across the chunk. 1 thread, 2,000 tokens in cache, 12 heads over 4 KV heads of 64:
 * 0.17 ms against 0.29 for the generic copy at D = 64 (AMD EPYC fam 25 model 17). */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  /* unaligned loads */

static inline v8 pair_sum(v8 a, v8 b, v8i even, v8i odd) {
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* r[0..7] -> (sum of r[0]'s lanes, ..., sum of r[7]'s lanes). */
static inline v8 transpose_sums(const v8 r[8]) {
    const v8i e1 = {0, 8, 2, 10, 4, 12, 6, 14}, o1 = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8i e2 = {0, 1, 8, 9, 4, 5, 12, 13}, o2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i e3 = {0, 1, 2, 3, 8, 9, 10, 11}, o3 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 t0 = pair_sum(r[0], r[1], e1, o1), t1 = pair_sum(r[2], r[3], e1, o1);
    v8 t2 = pair_sum(r[4], r[5], e1, o1), t3 = pair_sum(r[6], r[7], e1, o1);
    v8 u0 = pair_sum(t0, t1, e2, o2), u1 = pair_sum(t2, t3, e2, o2);
    return pair_sum(u0, u1, e3, o3);
}

/* exp_nonpositive on 8 lanes. */
VECTOR_EXP_NONPOSITIVE(exp8, v8, v8i)

static inline float lane_max(v8 v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float lane_sum(v8 v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* The K and V rows of the chunk two after the current one, asked for a share at a time:
 * blocks are scattered, and the hardware prefetcher, which follows one run within a 4 KiB
 * page, cannot cross into the next block. Each query's pass over the current chunk asks
 * for its share of the lines (1/queries of them), so the requests go out spread over the
 * chunk's work: all at once (a 32 KiB burst at the start of the chunk) they filled the
 * miss queues and stalled it. Cold caches, 9 layers' shape, alternated in one process:
 * c1 640 tokens 125-140 -> 108-119 us per layer, c1 4k 534-637 -> 474-537, c8 640
 * 693-855 -> 572-670 (one chunk ahead: 110-118, 497-539, 601-723). Into L2, not L1: two
 * chunks of K and V are 64 KiB, twice L1, and perf put a quarter of the kernel's samples
 * on the L1 prefetches themselves (8 unshared decodes of 620 tokens, huge pages as the
 * server has them: 712 / 796 -> 520 / 626 us per layer, hot / cold). */
typedef struct {
    const char *keys, *values;
    int64_t lines, per_query;
} Upcoming;

static inline Upcoming upcoming_chunk(const Shape *s, const void *k_cache, const void *v_cache, const int32_t *table,
                                      int token, int end, int64_t token_floats, int num_queries) {
    Upcoming up = {NULL, NULL, 0, 0};
    for (int skip = 0; skip < 2 && token < end; skip++) token += chunk_tokens(s, token, end);
    if (token >= end) return up;
    const int element = s->dtype == KV_FLOAT32 ? 4 : 2;
    const int64_t at = chunk_offset(s, table, token, token_floats) * element;
    up.keys = (const char *)k_cache + at;
    up.values = (const char *)v_cache + at;
    up.lines = (chunk_tokens(s, token, end) * token_floats * element + 63) / 64;
    up.per_query = (up.lines + num_queries - 1) / num_queries;
    return up;
}

/* Query h's share of the upcoming chunk's lines of ``base`` (its keys or its values). */
static inline void prefetch_share(const Upcoming *up, const char *base, int h) {
    if (base == NULL) return;
    const int64_t last = (h + 1) * up->per_query < up->lines ? (h + 1) * up->per_query : up->lines;
    for (int64_t line = h * up->per_query; line < last; line++) __builtin_prefetch(base + line * 64, 0, 2);
}

/* One query's scores (q: [DIM]) against the chunk's keys (key0: the KV head's columns of
 * its first row, rows token_floats apart), eight tokens' dot products at a time. */
static inline __attribute__((always_inline)) void query_scores(
        const float *q, const float *key0, int count, int groups_of_8, int64_t token_floats, const int DIM,
        v8 *scores) {
    const v8 zero = {0};
    for (int c8 = 0; c8 < groups_of_8; c8++) {
        v8 partial[8];
        for (int i = 0; i < 8; i++) {
            const int t = c8 * 8 + i;
            v8 sum = zero;
            if (t < count) {  /* rows past the chunk may lie past the cache */
                const float *key = key0 + t * token_floats;
                for (int d = 0; d < DIM; d += 8) sum += *(const v8u *)(q + d) * *(const v8u *)(key + d);
            }
            partial[i] = sum;
        }
        scores[c8] = transpose_sums(partial);
    }
}

/* acc += sum over the chunk's tokens t of p[t] * value row t (column: the KV head's
 * columns of the first value row), the accumulator in registers across the chunk. */
static inline __attribute__((always_inline)) void query_values(
        float *acc, const float *column, int count, int64_t token_floats, const int DIM, const float *p) {
    v8 local[DIM / 8];
    for (int c = 0; c < DIM / 8; c++) local[c] = *(const v8u *)(acc + c * 8);
    for (int t = 0; t < count; t++) {
        const float *value = column + t * token_floats;
        for (int c = 0; c < DIM / 8; c++) local[c] += p[t] * *(const v8u *)(value + c * 8);
    }
    for (int c = 0; c < DIM / 8; c++) *(v8u *)(acc + c * 8) = local[c];
}

/* Stacked queries (several decodes against their shared prefix): per KV head, the queries
 * of every stacked decode (rows x group of them, u = row * group + i) are one small
 * matrix product per chunk, run in vectors across queries. Scores S[t][u] = sum over d of
 * K[t][d] * QT[d][u]: each key element broadcast against the queries transposed once per
 * item, so no sums across lanes; softmax runs down each query's column (maxima and sums
 * lane-wise); then the accumulators take P[t][u] * V[t]. The one-query-at-a-time loop
 * below is bound by its row loads and lane sums where many queries share each row (three
 * queries a load, as a49f6db had it, was the halfway step). c8 and c16 sharing 608
 * tokens, 9 layers, alternated in one process against a49f6db's source
 * (contrib/bench/ab_paged_decode.py, AMD EPYC fam 25 model 17, huge pages): 344 / 275 ->
 * 289 / 244 and 491 / 524 -> 439 / 434 us per layer (hot / cold); one layer, own parts
 * of one token: 253 -> 190 us (78 GFLOP/s on 2 threads). */
#ifdef __AVX512F__
#define STACK_TOKENS 8       /* tokens' scores in registers at once, for 3 vectors of queries */
#define STACK_VALUE_ACC 24   /* value accumulators (vectors of 8) in registers at once */
#else
#define STACK_TOKENS 4
#define STACK_VALUE_ACC 12
#endif
#define STACK_CASES(N, CALL) switch (N) { case 3: { enum { NV = 3 }; CALL; break; } \
                                          case 2: { enum { NV = 2 }; CALL; break; } \
                                          default: { enum { NV = 1 }; CALL; break; } }

static inline v8 lane_max8(v8 a, v8 b) {
    const v8i bigger = a > b;
    return (v8)(((v8i)a & bigger) | ((v8i)b & ~bigger));
}

#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16m __attribute__((vector_size(64), aligned(4))); /* in memory: any float's alignment */
VECTOR_EXP_NONPOSITIVE(exp16, v16, v16i)

static inline v16 lane_max16(v16 a, v16 b) {
    const v16i bigger = a > b;
    return (v16)(((v16i)a & bigger) | ((v16i)b & ~bigger));
}
#endif

/* S[t][v0 * 8 ..] for the chunk's tokens, NV vectors of queries (qt: [DIM][qp]). Tokens
 * past the chunk reuse its last row (inside the cache); their scores are never read. */
static inline __attribute__((always_inline)) void stacked_scores(
        const float *qt, int qp, int v0, const int NV, const float *key0, int count, int64_t token_floats,
        const int DIM, float *scores) {
    for (int t0 = 0; t0 < count; t0 += STACK_TOKENS) {
        const float *row[STACK_TOKENS];
        for (int t = 0; t < STACK_TOKENS; t++) row[t] = key0 + (t0 + t < count ? t0 + t : count - 1) * token_floats;
        v8 acc[STACK_TOKENS][3];
        const v8 zero = {0};
        for (int t = 0; t < STACK_TOKENS; t++)
            for (int v = 0; v < NV; v++) acc[t][v] = zero;
        for (int d = 0; d < DIM; d++) {
            v8 column[3];
            for (int v = 0; v < NV; v++) column[v] = *(const v8 *)(qt + (int64_t)d * qp + (v0 + v) * 8);
            for (int t = 0; t < STACK_TOKENS; t++) {
                const float k = row[t][d];
                for (int v = 0; v < NV; v++) acc[t][v] += k * column[v];
            }
        }
        for (int t = 0; t < STACK_TOKENS && t0 + t < count; t++)
            for (int v = 0; v < NV; v++) *(v8 *)(scores + (t0 + t) * qp + (v0 + v) * 8) = acc[t][v];
    }
}

/* rows[j] (NV of them, DIM wide) = rows[j] * correction[j] + sum over t of p[t][j] * V[t]. */
static inline __attribute__((always_inline)) void stacked_values(
        float *const *rows, const float *correction, const int NV, const float *p, int qp, const float *column,
        int count, int64_t token_floats, const int DIM) {
    v8 local[3][DIM / 8];
    for (int j = 0; j < NV; j++)
        for (int c = 0; c < DIM / 8; c++) local[j][c] = *(const v8u *)(rows[j] + c * 8) * correction[j];
    for (int t = 0; t < count; t++) {
        const float *value = column + t * token_floats;
        for (int c = 0; c < DIM / 8; c++) {
            const v8 v = *(const v8u *)(value + c * 8);
            for (int j = 0; j < NV; j++) local[j][c] += p[t * qp + j] * v;
        }
    }
    for (int j = 0; j < NV; j++)
        for (int c = 0; c < DIM / 8; c++) *(v8u *)(rows[j] + c * 8) = local[j][c];
}

#ifdef __AVX512F__
typedef float v16u __attribute__((vector_size(64), aligned(4)));
#define STACK_ROWS16 6  /* 6 rows x 4 vectors of 16 (DIM 64) accumulators + 4 value vectors + 1 */
/* stacked_values in vectors of 16 for NR rows at once (DIM a multiple of 16, at most 64):
 * each value row's vectors are loaded once for all NR rows, where the 8-lane form takes
 * them from memory again for every row (its accumulators fill the registers). The same
 * products in the same order: outputs are bit-identical. c8 / c16 sharing 608 tokens, 9
 * layers (contrib/bench/ab_paged_decode.py, AMD EPYC fam 25 model 17, huge pages), us per
 * layer hot / cold: 264 / 293 -> 224 / 242 and 494 / 471 -> 426 / 415. */
static inline __attribute__((always_inline)) void stacked_values16(
        float *const *rows, const float *correction, const int NR, const float *p, int qp, const float *column,
        int count, int64_t token_floats, const int DIM) {
    v16u local[STACK_ROWS16][64 / 16];
    for (int j = 0; j < NR; j++)
        for (int c = 0; c < DIM / 16; c++) local[j][c] = *(const v16u *)(rows[j] + c * 16) * correction[j];
    for (int t = 0; t < count; t++) {
        const float *value = column + t * token_floats;
        v16u v[64 / 16];
        for (int c = 0; c < DIM / 16; c++) v[c] = *(const v16u *)(value + c * 16);
        for (int j = 0; j < NR; j++) {
            const float weight = p[t * qp + j];
            for (int c = 0; c < DIM / 16; c++) local[j][c] += weight * v[c];
        }
    }
    for (int j = 0; j < NR; j++)
        for (int c = 0; c < DIM / 16; c++) *(v16u *)(rows[j] + c * 16) = local[j][c];
}
#define ROWS16_CASES(N, CALL) switch (N) { case 6: { enum { NR = 6 }; CALL; break; } \
                                           case 5: { enum { NR = 5 }; CALL; break; } \
                                           case 4: { enum { NR = 4 }; CALL; break; } \
                                           case 3: { enum { NR = 3 }; CALL; break; } \
                                           case 2: { enum { NR = 2 }; CALL; break; } \
                                           default: { enum { NR = 1 }; CALL; break; } }
#endif

#ifdef __AVX512F__
static void stacked_scores_dot(const uint32_t *qt, int qp, const uint16_t *key0, int count, int64_t token_floats,
                               int dim, float *scores);
#endif

/* The item's stacked queries ([rows x heads, DIM], pre-scaled) against tokens [first, end):
 * the same acc / maxes / sums as attend_part_vec. Chunk by chunk, every KV head's scores
 * (K rows read as one run), then every KV head's values: a KV head at a time over the whole
 * part read a quarter of each row per pass and waited on memory. work: floats for, per KV
 * head, qt [DIM][qp], scores [CHUNK][qp], maxima and sums [qp], and corrections [qp]
 * (qp = rows x group rounded up to 8). */
static void attend_stacked(const Shape *s, const int DIM, const float *queries, int num_queries,
                           const void *k_cache, const void *v_cache, const int32_t *table, int first, int end,
                           float *acc, float *maxes, float *sums, float *buffer, float *work) {
    const int group = s->group, heads = s->heads, kv_heads = s->kv_heads, rows = num_queries / heads;
    const int64_t token_floats = (int64_t)kv_heads * DIM;
    const int nq = rows * group, qp = s->dot_scores ? (nq + 15) / 16 * 16 : (nq + 7) / 8 * 8;
    const int64_t per_head = (int64_t)qp * (DIM + CHUNK + 3);
    const int value_batch = STACK_VALUE_ACC / (DIM / 8) < 1 ? 1 : STACK_VALUE_ACC / (DIM / 8) > 3 ? 3
                            : STACK_VALUE_ACC / (DIM / 8);
    /* KV head g's query u: row u / group, head g * group + u % group */
#define QUERY_ROW(g, u) (((u) / group) * heads + (g) * group + (u) % group)
#define QT(g) (work + (g) * per_head)
#define SCORES(g) (QT(g) + (int64_t)DIM * qp)
#define MAXES(g) (SCORES(g) + CHUNK * qp)
#define SUMS(g) (MAXES(g) + qp)
#define CORRECTIONS(g) (SUMS(g) + qp)
    memset(acc, 0, sizeof(float) * num_queries * DIM);
    for (int g = 0; g < kv_heads; g++) {
        float *qt = QT(g);
        if (s->dot_scores) /* [DIM / 2][qp] pairs, rounded to bfloat16 */
            for (int u = 0; u < qp; u++)
                for (int d = 0; d < DIM; d += 2) {
                    const float *query = queries + (int64_t)QUERY_ROW(g, u) * DIM + d;
                    ((uint32_t *)qt)[(int64_t)(d / 2) * qp + u] =
                        u < nq ? (uint32_t)bf16_from_float(query[0]) | (uint32_t)bf16_from_float(query[1]) << 16 : 0u;
                }
        else
            for (int u = 0; u < qp; u++)
                for (int d = 0; d < DIM; d++)
                    qt[(int64_t)d * qp + u] = u < nq ? queries[(int64_t)QUERY_ROW(g, u) * DIM + d] : 0.0f;
        for (int u = 0; u < qp; u++) {
            MAXES(g)[u] = -3.0e38f;  /* finite: the vector exp takes no -inf */
            SUMS(g)[u] = 0.0f;
        }
    }
    int token = first;
    while (token < end) {
        const int count = chunk_tokens(s, token, end);
        const int64_t at = chunk_offset(s, table, token, token_floats);
        const Upcoming upcoming = upcoming_chunk(s, k_cache, v_cache, table, token, end, token_floats, kv_heads);
        /* bfloat16 keys as they lie for the dot scores, else float32 (widened) */
        const float *keys = s->dot_scores ? NULL : rows_as_float(k_cache, at, count * token_floats, s->dtype, buffer);
        for (int g = 0; g < kv_heads; g++) {
            prefetch_share(&upcoming, upcoming.keys, g);
            float *scores = SCORES(g), *m = MAXES(g), *l = SUMS(g), *corr = CORRECTIONS(g);
#ifdef __AVX512F__
            if (s->dot_scores)
                stacked_scores_dot((const uint32_t *)QT(g), qp, (const uint16_t *)k_cache + at + g * DIM, count,
                                   token_floats, DIM, scores);
            else
#endif
            for (int v0 = 0; v0 < qp / 8; v0 += 3) {
                const int n = qp / 8 - v0 < 3 ? qp / 8 - v0 : 3;
                STACK_CASES(n, stacked_scores(QT(g), qp, v0, NV, keys + g * DIM, count, token_floats, DIM, scores))
            }
            int c = 0;
#ifdef __AVX512F__
            /* 16 queries a vector where they come in 16s (the dot scores' layout) */
            for (; qp % 16 == 0 && c < qp; c += 16) {
                const v16 old = *(const v16m *)(m + c);
                v16 top = old;
                for (int t = 0; t < count; t++) top = lane_max16(*(const v16m *)(scores + t * qp + c), top);
                const v16 scale = exp16(old - top);
                v16 total = {0};
                for (int t = 0; t < count; t++) {
                    const v16 p = exp16(*(const v16m *)(scores + t * qp + c) - top);
                    *(v16m *)(scores + t * qp + c) = p;
                    total += p;
                }
                *(v16m *)(l + c) = *(const v16m *)(l + c) * scale + total;
                *(v16m *)(m + c) = top;
                *(v16m *)(corr + c) = scale;
            }
#endif
            for (; c < qp; c += 8) {
                const v8 old = *(const v8 *)(m + c);
                v8 top = old;
                for (int t = 0; t < count; t++) top = lane_max8(*(const v8 *)(scores + t * qp + c), top);
                const v8 scale = exp8(old - top);
                v8 total = {0};
                for (int t = 0; t < count; t++) {
                    const v8 p = exp8(*(const v8 *)(scores + t * qp + c) - top);
                    *(v8 *)(scores + t * qp + c) = p;
                    total += p;
                }
                *(v8 *)(l + c) = *(const v8 *)(l + c) * scale + total;
                *(v8 *)(m + c) = top;
                *(v8 *)(corr + c) = scale;
            }
        }
        const float *values = rows_as_float(v_cache, at, count * token_floats, s->dtype, buffer);
        for (int g = 0; g < kv_heads; g++) {
            prefetch_share(&upcoming, upcoming.values, g);
#ifdef __AVX512F__
            if (DIM % 16 == 0 && DIM <= 64) {
                for (int u = 0; u < nq; u += STACK_ROWS16) {
                    const int n = nq - u < STACK_ROWS16 ? nq - u : STACK_ROWS16;
                    float *targets[STACK_ROWS16];
                    for (int j = 0; j < n; j++) targets[j] = acc + (int64_t)QUERY_ROW(g, u + j) * DIM;
                    ROWS16_CASES(n, stacked_values16(targets, CORRECTIONS(g) + u, NR, SCORES(g) + u, qp,
                                                     values + g * DIM, count, token_floats, DIM))
                }
                continue;
            }
#endif
            for (int u = 0; u < nq; u += value_batch) {
                const int n = nq - u < value_batch ? nq - u : value_batch;
                float *targets[3];
                for (int j = 0; j < n; j++) targets[j] = acc + (int64_t)QUERY_ROW(g, u + j) * DIM;
                STACK_CASES(n, stacked_values(targets, CORRECTIONS(g) + u, NV, SCORES(g) + u, qp, values + g * DIM,
                                              count, token_floats, DIM))
            }
        }
        token += count;
    }
    for (int g = 0; g < kv_heads; g++)
        for (int u = 0; u < nq; u++) {
            maxes[QUERY_ROW(g, u)] = MAXES(g)[u];
            sums[QUERY_ROW(g, u)] = SUMS(g)[u];
        }
#undef QUERY_ROW
#undef QT
#undef SCORES
#undef MAXES
#undef SUMS
#undef CORRECTIONS
}

static inline __attribute__((always_inline)) void attend_part_vec(
        const Shape *s, const int DIM, const float *queries, int num_queries, const void *k_cache,
        const void *v_cache, const int32_t *table, int first, int end, float *acc, float *maxes, float *sums,
        float *buffer, float *work) {
    enum { LANES = 8 };
    if (num_queries > s->heads) {
        attend_stacked(s, DIM, queries, num_queries, k_cache, v_cache, table, first, end, acc, maxes, sums, buffer,
                       work);
        return;
    }
    const int group = s->group, kv_heads = s->kv_heads;
    const int64_t token_floats = (int64_t)kv_heads * DIM;
    v8 scores[MAX_QUERIES][CHUNK / LANES];
    start_part(acc, maxes, sums, num_queries, DIM);
    /* One decode's queries one at a time: its item streams its own rows from memory, and
     * taking a KV head's queries together there was 15 % slower (8 unshared decodes of 620
     * tokens, alternated in one process: 596 / 606 against 510 / 526 us). */
    int token = first;
    while (token < end) {
        const int count = chunk_tokens(s, token, end);
        const int64_t at = chunk_offset(s, table, token, token_floats);
        const Upcoming upcoming = upcoming_chunk(s, k_cache, v_cache, table, token, end, token_floats, num_queries);
        const float *keys = rows_as_float(k_cache, at, count * token_floats, s->dtype, buffer);
        const int groups_of_8 = (count + LANES - 1) / LANES;
        for (int h = 0; h < num_queries; h++) {
            prefetch_share(&upcoming, upcoming.keys, h);
            query_scores(queries + h * DIM, keys + (h / group) * DIM, count, groups_of_8, token_floats, DIM, scores[h]);
        }
        const v8 minus_inf = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        for (int h = 0; h < num_queries; h++) {
            float chunk_max = maxes[h];
            for (int c8 = 0; c8 < groups_of_8; c8++) {
                v8 v = scores[h][c8];
                if ((c8 + 1) * LANES > count) {  /* the tail lanes: no token */
                    for (int i = count - c8 * LANES; i < LANES; i++) v[i] = -INFINITY;
                    scores[h][c8] = v;
                }
                float m = lane_max(v);
                chunk_max = m > chunk_max ? m : chunk_max;
            }
            const float correction = exp_nonpositive(maxes[h] - chunk_max);
            float total = 0.0f;
            for (int c8 = 0; c8 < groups_of_8; c8++) {
                v8 p = exp8(scores[h][c8] - chunk_max);
                v8i padded = scores[h][c8] == minus_inf;
                p = (v8)((v8i)p & ~padded);
                scores[h][c8] = p;
                total += lane_sum(p);
            }
            sums[h] = sums[h] * correction + total;
            maxes[h] = chunk_max;
            float *a = acc + h * DIM;
            if (correction != 1.0f)
                for (int d = 0; d < DIM; d++) a[d] *= correction;
        }
        const float *values = rows_as_float(v_cache, at, count * token_floats, s->dtype, buffer);
        for (int h = 0; h < num_queries; h++) {
            prefetch_share(&upcoming, upcoming.values, h);
            query_values(acc + h * DIM, values + (h / group) * DIM, count, token_floats, DIM, (const float *)scores[h]);
        }
        token += count;
    }
}

#define SPECIALISE(D) \
    static void attend_part_##D(const Shape *s, const float *q, int nq, const void *k, const void *v, \
                                const int32_t *table, int first, int end, float *acc, float *maxes, float *sums, \
                                float *buffer, float *work) { \
        attend_part_vec(s, D, q, nq, k, v, table, first, end, acc, maxes, sums, buffer, work); \
    }
static void attend_part_0(const Shape *s, const float *q, int nq, const void *k, const void *v, const int32_t *table,
                          int first, int end, float *acc, float *maxes, float *sums, float *buffer, float *work) {
    (void)work;
    attend_part_generic(s, q, nq, k, v, table, first, end, acc, maxes, sums, buffer);
}
SPECIALISE(16)
SPECIALISE(32)
SPECIALISE(64)
SPECIALISE(80)
SPECIALISE(96)
SPECIALISE(128)

typedef void (*AttendPart)(const Shape *, const float *, int, const void *, const void *, const int32_t *, int, int,
                           float *, float *, float *, float *, float *);

static AttendPart attend_part_for(int dim) {
    switch (dim) {
        case 16: return attend_part_16;
        case 32: return attend_part_32;
        case 64: return attend_part_64;
        case 80: return attend_part_80;
        case 96: return attend_part_96;
        case 128: return attend_part_128;
        default: return attend_part_0;
    }
}

/* bfloat16 caches on a host with AVX512-BF16: the scores by VDPBF16PS, reading the cache's
 * key rows as they lie.
 *
 * Why: the widening copy above widens every row and multiplies in float32 vectors of 8,
 * and at batch 8 it was bound by that arithmetic, not by the bytes: the small LLaVA's 8
 * unshared decodes of 620 tokens (12 heads over 4 KV heads of 64, bfloat16 caches, 5 MB a
 * layer) took 328-375 us a layer (ab_paged_decode.py --dtype bfloat16, AMD EPYC family 25
 * model 17, 2 threads), ~15 GB/s against the host's ~45, and about a third of the fused
 * decode step. VDPBF16PS multiplies a pair of bfloat16 values per lane and adds both
 * products into a float32 lane: a query's (d, d+1) pairs against a key row's, 16 pairs a
 * vector, into one accumulator per token; 16 tokens' accumulators are summed across lanes
 * together (reduce16: a transpose by shuffles) into one vector of 16 scores. The query is
 * rounded to bfloat16 (to nearest even) for it, as a bfloat16 model's query already is on
 * the module path; products are exact and summed in float32 (the instruction flushes
 * subnormals). P x V stays float32 (the chunk's value rows widened once, rows_as_float, every
 * query of a head against its head's, unrounded weights): rounding the weights to bfloat16
 * for a second VDPBF16PS product was ~9 % faster on this case and put the Gemma 3 fused
 * step's bfloat16 error past the module path's. Same case: 216-254 us a layer. Stacked
 * decodes (a shared prefix) keep attend_stacked, whose product across queries was as fast
 * as this item's, with its scores by VDPBF16PS too (stacked_scores_dot: 8 and 16 decodes
 * sharing 608 tokens, 216 / 378 -> 207 / 345 us a layer, hot). Head sizes 32, 64, 128
 * and 256 (whole vectors of pairs; stacked: up to 128). */
#ifdef __AVX512F__
#include <immintrin.h>
#define DOT_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))


/* 16 vectors -> one vector whose lane t is the sum of s[t]'s lanes. */
DOT_TARGET static inline __attribute__((always_inline)) __m512 reduce16(const __m512 s[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: (s0 a, s1 a, s0 b, s1 b) */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]),
                                 _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: that lane's sums of tokens 4i .. 4i+3 */
        quads[i] = _mm512_add_ps((__m512)_mm512_unpacklo_pd((__m512d)pairs[2 * i], (__m512d)pairs[2 * i + 1]),
                                 (__m512)_mm512_unpackhi_pd((__m512d)pairs[2 * i], (__m512d)pairs[2 * i + 1]));
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),   /* lanes 0, 1 */
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));  /* + lanes 2, 3 */
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

/* attend_stacked's scores of one KV head's stacked queries for a chunk, by VDPBF16PS:
 * S[t][u] = sum over pairs of K[t]'s (d, d+1) pair broadcast against the queries' pairs
 * (qt: [dim / 2][qp] 32-bit pairs, qp a multiple of 16), 16 queries a vector, so no sums
 * across lanes; 8 tokens x 2 vectors of queries in registers at once. Tokens past the chunk
 * reuse its last row (inside the cache); their scores are never read. */
#define DOT_STACK_TOKENS 8
DOT_TARGET static void stacked_scores_dot(const uint32_t *qt, int qp, const uint16_t *key0, int count,
                                          int64_t token_floats, int dim, float *scores) {
    const int pairs = dim / 2;
    for (int t0 = 0; t0 < count; t0 += DOT_STACK_TOKENS) {
        const uint32_t *row[DOT_STACK_TOKENS];
        for (int t = 0; t < DOT_STACK_TOKENS; t++)
            row[t] = (const uint32_t *)(key0 + (t0 + t < count ? t0 + t : count - 1) * token_floats);
        for (int v0 = 0; v0 < qp / 16; v0 += 2) {
            const int two = qp / 16 - v0 >= 2;
            __m512 acc[DOT_STACK_TOKENS][2];
            for (int t = 0; t < DOT_STACK_TOKENS; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
            for (int p = 0; p < pairs; p++) {
                const __m512bh column0 = (__m512bh)_mm512_loadu_si512(qt + (int64_t)p * qp + v0 * 16);
                const __m512bh column1 = two ? (__m512bh)_mm512_loadu_si512(qt + (int64_t)p * qp + v0 * 16 + 16)
                                             : (__m512bh)_mm512_setzero_si512();
                for (int t = 0; t < DOT_STACK_TOKENS; t++) {
                    const __m512bh k = (__m512bh)_mm512_set1_epi32((int)row[t][p]);
                    acc[t][0] = _mm512_dpbf16_ps(acc[t][0], column0, k);
                    acc[t][1] = _mm512_dpbf16_ps(acc[t][1], column1, k);
                }
            }
            for (int t = 0; t < DOT_STACK_TOKENS && t0 + t < count; t++) {
                _mm512_storeu_ps(scores + (int64_t)(t0 + t) * qp + v0 * 16, acc[t][0]);
                if (two) _mm512_storeu_ps(scores + (int64_t)(t0 + t) * qp + v0 * 16 + 16, acc[t][1]);
            }
        }
    }
}

/* One decode's item (Q = H queries, query j its head j) as attend_part_vec's contract: acc
 * [Q, D] unnormalised, maxes [Q], sums [Q]. scratch: dot_scratch_floats(D) floats. Each chunk takes three passes: every query's scores, then
 * every query's softmax (independent of one another, so their chains of reductions and exp
 * can overlap), then P x V a KV head at a time. */
DOT_TARGET static inline __attribute__((always_inline)) void attend_part_dot(
        const Shape *s, const int DIM, const float *queries, int num_queries, const void *k_cache,
        const void *v_cache, const int32_t *table, int first, int end, float *acc, float *maxes, float *sums,
        float *scratch) {
    const int PAIRS = DIM / 2, QV = DIM / 32, AV = DIM / 16; /* pairs a row; vectors a row: of pairs, of sums */
    const int group = s->group, kv_heads = s->kv_heads;
    const int64_t token_floats = (int64_t)kv_heads * DIM;
    float *scores = scratch;                                                    /* [Q][CHUNK]: then the weights */
    uint32_t *query_pairs = (uint32_t *)(scores + (int64_t)num_queries * CHUNK); /* [Q][PAIRS] */
    float *widened = (float *)(query_pairs + (int64_t)num_queries * PAIRS);     /* the chunk's values, float32 */
    start_part(acc, maxes, sums, num_queries, DIM);
    for (int j = 0; j < num_queries; j++)
        for (int c = 0; c < QV; c++)
            _mm512_storeu_si512(query_pairs + (int64_t)j * PAIRS + c * 16,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(queries + (int64_t)j * DIM + c * 32 + 16),
                                                             _mm512_loadu_ps(queries + (int64_t)j * DIM + c * 32)));
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    int token = first;
    while (token < end) {
        const int count = chunk_tokens(s, token, end);
        const __mmask16 valid = (__mmask16)((1u << count) - 1);
        const int64_t at = chunk_offset(s, table, token, token_floats);
        const Upcoming upcoming = upcoming_chunk(s, k_cache, v_cache, table, token, end, token_floats, num_queries);
        const uint16_t *keys = (const uint16_t *)k_cache + at;
        for (int g = 0; g < kv_heads; g++) {
            const uint16_t *key0 = keys + g * DIM;
            for (int j = g * group; j < (g + 1) * group; j++) {
                prefetch_share(&upcoming, upcoming.keys, j);
                __m512bh q[MAX_DIM / 32];
                for (int c = 0; c < QV; c++)
                    q[c] = (__m512bh)_mm512_loadu_si512(query_pairs + (int64_t)j * PAIRS + c * 16);
                __m512 partial[CHUNK];
                for (int t = 0; t < CHUNK; t++) {
                    partial[t] = _mm512_setzero_ps();
                    if (t < count) /* rows past the chunk may lie past the cache */
                        for (int c = 0; c < QV; c++)
                            partial[t] = _mm512_dpbf16_ps(
                                partial[t], (__m512bh)_mm512_loadu_si512(key0 + t * token_floats + c * 32), q[c]);
                }
                _mm512_storeu_ps(scores + (int64_t)j * CHUNK, _mm512_mask_mov_ps(minus_inf, valid, reduce16(partial)));
            }
        }
        for (int j = 0; j < num_queries; j++) {
            const __m512 row = _mm512_loadu_ps(scores + (int64_t)j * CHUNK);
            const float chunk_max = fmaxf(maxes[j], _mm512_reduce_max_ps(row));
            const float correction = exp_nonpositive(maxes[j] - chunk_max);
            const __m512 p = _mm512_maskz_mov_ps(valid, (__m512)exp16((v16)_mm512_sub_ps(row, _mm512_set1_ps(chunk_max))));
            sums[j] = sums[j] * correction + _mm512_reduce_add_ps(p);
            maxes[j] = chunk_max;
            _mm512_storeu_ps(scores + (int64_t)j * CHUNK, p);
            if (correction != 1.0f) {
                float *a = acc + (int64_t)j * DIM;
                for (int v = 0; v < AV; v++)
                    _mm512_storeu_ps(a + v * 16, _mm512_mul_ps(_mm512_loadu_ps(a + v * 16), _mm512_set1_ps(correction)));
            }
        }
        const float *values = rows_as_float(v_cache, at, count * token_floats, s->dtype, widened);
        for (int g = 0; g < kv_heads; g++) {
            const float *value0 = values + g * DIM; /* KV head g's value rows, token_floats apart */
            for (int j = g * group; j < (g + 1) * group; j++) {
                prefetch_share(&upcoming, upcoming.values, j);
                float *a = acc + (int64_t)j * DIM;
                const float *p = scores + (int64_t)j * CHUNK;
                __m512 even[MAX_DIM / 16], odd[MAX_DIM / 16]; /* two chains a vector: half as deep */
                for (int v = 0; v < AV; v++) {
                    even[v] = _mm512_loadu_ps(a + v * 16);
                    odd[v] = _mm512_setzero_ps();
                }
                int t = 0;
                for (; t + 1 < count; t += 2) {
                    const __m512 pe = _mm512_set1_ps(p[t]), po = _mm512_set1_ps(p[t + 1]);
                    for (int v = 0; v < AV; v++) {
                        even[v] = _mm512_fmadd_ps(pe, _mm512_loadu_ps(value0 + t * token_floats + v * 16), even[v]);
                        odd[v] = _mm512_fmadd_ps(po, _mm512_loadu_ps(value0 + (t + 1) * token_floats + v * 16), odd[v]);
                    }
                }
                if (t < count)
                    for (int v = 0; v < AV; v++)
                        even[v] = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(value0 + t * token_floats + v * 16), even[v]);
                for (int v = 0; v < AV; v++) _mm512_storeu_ps(a + v * 16, _mm512_add_ps(even[v], odd[v]));
            }
        }
        token += count;
    }
}
#endif

/* Whether bfloat16 caches take attend_part_dot (bf16_switch's setting). */
static int decode_dot = -1;

/* Asked with -1: whether bfloat16 caches' scores are the AVX512-BF16 kernel's (1) or the
 * widening copy's (0); 0 or 1 sets it (bfloat16.h). */
int vlmd_paged_decode_bf16_dot(int wanted) { return bf16_switch(&decode_dot, wanted); }

#ifdef __AVX512F__
#define SPECIALISE_DOT(D) \
    DOT_TARGET static void attend_dot_##D(const Shape *s, const float *q, int nq, const void *k, const void *v, \
                                          const int32_t *table, int first, int end, float *acc, float *maxes, \
                                          float *sums, float *buffer, float *work) { \
        if (nq > s->heads) /* stacked decodes: attend_stacked, its scores by stacked_scores_dot */ \
            attend_part_for(D)(s, q, nq, k, v, table, first, end, acc, maxes, sums, buffer, work); \
        else \
            attend_part_dot(s, D, q, nq, k, v, table, first, end, acc, maxes, sums, buffer); \
    }
SPECIALISE_DOT(32)
SPECIALISE_DOT(64)
SPECIALISE_DOT(128)
SPECIALISE_DOT(256)
#endif

/* The AVX512-BF16 item for bfloat16 caches of this head size, or NULL: the widening one serves. */
static AttendPart attend_part_dot_for(int dim, int dtype) {
    if (dtype != KV_BFLOAT16 || vlmd_paged_decode_bf16_dot(-1) <= 0) return NULL;
#ifdef __AVX512F__
    switch (dim) {
        case 32: return attend_dot_32;
        case 64: return attend_dot_64;
        case 128: return attend_dot_128;
        case 256: return attend_dot_256;
    }
#endif
    return NULL;
}

/* Floats of attend_part_dot's scratch for an item of up to MAX_HEADS queries: their scores
 * (then weights) of a chunk, their bfloat16 pairs, the chunk's values widened. */
static int64_t dot_scratch_floats(int dim, int kv_heads) {
    return (int64_t)MAX_HEADS * (CHUNK + dim / 2) + (int64_t)CHUNK * kv_heads * dim;
}

typedef struct {
    int32_t table_row;  /* the decode whose block table the item reads */
    int32_t first, end;  /* tokens of that table */
    int32_t rows_at, num_rows;  /* its decodes: item_rows[rows_at .. rows_at + num_rows) */
    int64_t scratch_at;  /* its acc [Q, D], maxes [Q], sums [Q], Q = num_rows * heads */
} Item;

/* q [B, H, D] float32; caches [slots, Hkv, D] (float32 or bfloat16, contiguous);
 * block_tables [B, max_blocks] int32; context_lens [B] int32 (own token included);
 * out [B, H, D] float32; num_slots: rows of each cache. Decodes sharing a prefix
 * (cascade): group g's members are group_members[group_offsets[g] .. group_offsets[g + 1]),
 * whose tables agree on their first group_tokens[g] tokens (whole blocks); those are read
 * once for all members, their queries stacked. part_tokens 0: split contexts only as far
 * as the threads need. window > 0 (a sliding-window layer): each decode attends to its
 * last `window` tokens only (keys at positions > its own - window), through its window
 * group's table, whose entries before them may be FREED (-1); no shared groups then.
 * Returns 0, or a negative code for arguments it cannot serve. */
int vlmd_paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                      const int32_t *block_tables, const int32_t *context_lens, float *out,
                      int batch, int heads, int kv_heads, int dim, int block_size, int max_blocks,
                      int64_t num_slots, int num_groups, const int32_t *group_offsets,
                      const int32_t *group_members, const int32_t *group_tokens,
                      float scale, int num_threads, int part_tokens, int window) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads > MAX_HEADS) return -1;
    if (dim > MAX_DIM || dim <= 0 || block_size <= 0 || batch <= 0) return -2;
    if (dtype != KV_FLOAT32 && dtype != KV_BFLOAT16) return -3;
    if (window < 0 || (window > 0 && num_groups > 0)) return -7;  /* a window's decodes share no prefix read */
    int longest = 0;
    for (int b = 0; b < batch; b++) {
        if (context_lens[b] <= 0 || context_lens[b] > max_blocks * block_size) return -4;
        /* A windowed decode reads its last `window` tokens only: the blocks before them may
         * be FREED (-1) or another sequence's by now, and are neither checked nor read. */
        const int first = window > 0 && context_lens[b] > window ? context_lens[b] - window : 0;
        if (context_lens[b] - first > longest) longest = context_lens[b] - first;
        const int32_t *table = block_tables + (int64_t)b * max_blocks;
        for (int i = first / block_size; i < (context_lens[b] + block_size - 1) / block_size; i++)
            if (table[i] < 0 || ((int64_t)table[i] + 1) * block_size > num_slots) return -6;
    }
    /* Every allocation below is freed at ``done``, whatever the outcome. */
    int code = 0;
    Item *items = NULL;
    int32_t *item_rows = NULL, *entry_offsets = NULL, *fill = NULL;
    int64_t *entries = NULL;
    float *scratch = NULL;
    /* Where each decode's own part starts: after its group's shared tokens. */
    int32_t *own_first = (int32_t *)calloc(batch, sizeof(int32_t));
    if (own_first == NULL) {
        code = -5;
        goto done;
    }
    for (int b = 0; b < batch && window > 0; b++)
        own_first[b] = context_lens[b] > window ? context_lens[b] - window : 0;
    for (int g = 0; g < num_groups; g++) {
        const int32_t shared = group_tokens[g];
        if (shared <= 0 || shared % block_size != 0 || group_offsets[g + 1] <= group_offsets[g]) {
            code = -7;
            goto done;
        }
        for (int i = group_offsets[g]; i < group_offsets[g + 1]; i++) {
            const int b = group_members[i];
            if (b < 0 || b >= batch || own_first[b] != 0 || shared >= context_lens[b]) {
                code = -7;
                goto done;
            }
            own_first[b] = shared;
        }
    }
    const int part_tokens_given = part_tokens;
    if (part_tokens <= 0) {  /* enough items for two per thread, none shorter than MIN_PART */
        int wanted = (2 * num_threads + batch - 1) / batch;
        part_tokens = (longest + wanted - 1) / wanted;
        if (part_tokens < MIN_PART) part_tokens = MIN_PART;
    }
    part_tokens = ((part_tokens + block_size - 1) / block_size) * block_size;
    const int tile = MAX_QUERIES / heads;  /* decodes stacked in one shared item */
    /* A shared prefix is most of the step's work (every member's queries against it):
     * split it so every thread takes a share, however few decodes there are. */
    int shared_part = part_tokens;
    if (part_tokens_given <= 0) {
        int longest_shared = 0;
        for (int g = 0; g < num_groups; g++) longest_shared = group_tokens[g] > longest_shared ? group_tokens[g] : longest_shared;
        shared_part = (longest_shared + 2 * num_threads - 1) / (2 * num_threads);
        if (shared_part < MIN_PART) shared_part = MIN_PART;
        shared_part = ((shared_part + block_size - 1) / block_size) * block_size;
    }

    /* The items: every decode's own tokens in parts, every group's shared tokens in parts
     * for each tile of its members. item_rows lists each item's decodes. */
    int64_t num_items = 0, num_item_rows = 0;
    for (int b = 0; b < batch; b++) {
        const int64_t parts = (context_lens[b] - own_first[b] + part_tokens - 1) / part_tokens;
        num_items += parts;
        num_item_rows += parts;
    }
    for (int g = 0; g < num_groups; g++) {
        const int members = group_offsets[g + 1] - group_offsets[g];
        const int64_t parts = (group_tokens[g] + shared_part - 1) / shared_part;
        num_items += parts * ((members + tile - 1) / tile);
        num_item_rows += parts * members;
    }
    items = (Item *)malloc(sizeof(Item) * num_items);
    item_rows = (int32_t *)malloc(sizeof(int32_t) * num_item_rows);
    /* Per decode, the items holding it and its position there (CSR by decode). */
    entry_offsets = (int32_t *)calloc(batch + 1, sizeof(int32_t));
    entries = (int64_t *)malloc(sizeof(int64_t) * num_item_rows);
    fill = (int32_t *)malloc(sizeof(int32_t) * batch);
    if (!items || !item_rows || !entry_offsets || !entries || !fill) {
        code = -5;
        goto done;
    }
    int64_t n = 0, r = 0, scratch_floats = 0;
    for (int b = 0; b < batch; b++) {
        for (int first = own_first[b]; first < context_lens[b]; first += part_tokens) {
            const int end = first + part_tokens < context_lens[b] ? first + part_tokens : context_lens[b];
            items[n] = (Item){b, first, end, (int32_t)r, 1, scratch_floats};
            item_rows[r++] = b;
            scratch_floats += (int64_t)heads * (dim + 2);
            n++;
        }
    }
    for (int g = 0; g < num_groups; g++) {
        for (int at = group_offsets[g]; at < group_offsets[g + 1]; at += tile) {
            const int rows = group_offsets[g + 1] - at < tile ? group_offsets[g + 1] - at : tile;
            for (int first = 0; first < group_tokens[g]; first += shared_part) {
                const int end = first + shared_part < group_tokens[g] ? first + shared_part : group_tokens[g];
                items[n] = (Item){group_members[at], first, end, (int32_t)r, rows, scratch_floats};
                for (int i = 0; i < rows; i++) item_rows[r++] = group_members[at + i];
                scratch_floats += (int64_t)rows * heads * (dim + 2);
                n++;
            }
        }
    }
    for (int64_t i = 0; i < num_items; i++)
        for (int j = 0; j < items[i].num_rows; j++) entry_offsets[item_rows[items[i].rows_at + j] + 1]++;
    for (int b = 0; b < batch; b++) entry_offsets[b + 1] += entry_offsets[b];
    memcpy(fill, entry_offsets, sizeof(int32_t) * batch);
    for (int64_t i = 0; i < num_items; i++)
        for (int j = 0; j < items[i].num_rows; j++) entries[fill[item_rows[items[i].rows_at + j]]++] = i * MAX_QUERIES + j;
    scratch = (float *)malloc(sizeof(float) * (scratch_floats > 0 ? scratch_floats : 1));
    if (scratch == NULL) {
        code = -5;
        goto done;
    }
    int out_of_memory = 0;
    const AttendPart dot = attend_part_dot_for(dim, dtype), attend = dot ? dot : attend_part_for(dim);
    const Shape shape = {heads, kv_heads, heads / kv_heads, dim, block_size, dtype, dot != NULL};
    const int64_t widened_floats = dtype == KV_FLOAT32 ? 1 : (int64_t)CHUNK * kv_heads * dim;
    const int64_t buffer_floats = dot ? dot_scratch_floats(dim, kv_heads) : widened_floats; /* the larger */
    /* attend_stacked's work: a tile's queries of one KV head, rounded up to vectors of 16 (the
     * dot scores' width; the widening copy's 8 divides it) */
    const int stacked_qp = (tile * (heads / kv_heads) + 15) / 16 * 16;
    const int64_t work_floats = num_groups > 0 ? (int64_t)kv_heads * stacked_qp * (dim + CHUNK + 3) : 1;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        float *buffer = (float *)malloc(sizeof(float) * buffer_floats);
        float *queries = (float *)malloc(sizeof(float) * MAX_QUERIES * dim);
        float *work = (float *)aligned_alloc(32, sizeof(float) * ((work_floats + 7) / 8 * 8));
        if (buffer == NULL || queries == NULL || work == NULL) {
#pragma omp atomic write
            out_of_memory = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            if (buffer == NULL || queries == NULL || work == NULL) continue;  /* every thread still meets the loop */
            const Item *item = &items[i];
            const int count = item->num_rows * heads;
            for (int j = 0; j < item->num_rows; j++) {
                const float *src = q + (int64_t)item_rows[item->rows_at + j] * heads * dim;
                for (int e = 0; e < heads * dim; e++) queries[j * heads * dim + e] = src[e] * scale;
            }
            float *acc = scratch + item->scratch_at, *maxes = acc + (int64_t)count * dim, *sums = maxes + count;
            attend(&shape, queries, count, k_cache, v_cache, block_tables + (int64_t)item->table_row * max_blocks,
                   item->first, item->end, acc, maxes, sums, buffer, work);
        }
        free(work);
        free(queries);
        free(buffer);
        /* Each decode's heads: merge its parts (own and shared) by log-sum-exp. */
#pragma omp for
        for (int64_t pair = 0; pair < (int64_t)batch * heads; pair++) {
            const int b = (int)(pair / heads), h = (int)(pair % heads);
            float top = -INFINITY;
            for (int e = entry_offsets[b]; e < entry_offsets[b + 1]; e++) {
                const Item *item = &items[entries[e] / MAX_QUERIES];
                const int row = (int)(entries[e] % MAX_QUERIES), count = item->num_rows * heads;
                const float m = scratch[item->scratch_at + (int64_t)count * dim + row * heads + h];
                top = m > top ? m : top;
            }
            float total = 0.0f;
            float *o = out + ((int64_t)b * heads + h) * dim;
            memset(o, 0, sizeof(float) * dim);
            for (int e = entry_offsets[b]; e < entry_offsets[b + 1]; e++) {
                const Item *item = &items[entries[e] / MAX_QUERIES];
                const int row = (int)(entries[e] % MAX_QUERIES), count = item->num_rows * heads;
                const float *base = scratch + item->scratch_at;
                const int j = row * heads + h;
                const float m = base[(int64_t)count * dim + j];
                if (m == -INFINITY) continue;
                const float w = expf(m - top);
                total += base[(int64_t)count * dim + count + j] * w;
#pragma omp simd
                for (int d = 0; d < dim; d++) o[d] += base[(int64_t)j * dim + d] * w;
            }
            const float inverse = 1.0f / total;
#pragma omp simd
            for (int d = 0; d < dim; d++) o[d] *= inverse;
        }
    }
    if (out_of_memory) code = -5;
done:
    free(scratch);
    free(items);
    free(item_rows);
    free(entry_offsets);
    free(entries);
    free(fill);
    free(own_first);
    return code;
}

/* The kernel's fixed limits, so its binding checks the same ones: 0 most query heads of a
 * decode, 1 largest head size. */
int vlmd_paged_decode_limit(int which) {
    return which == 0 ? MAX_HEADS : which == 1 ? MAX_DIM : -1;
}
