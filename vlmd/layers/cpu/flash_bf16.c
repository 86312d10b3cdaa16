/* Attention over bfloat16 queries, keys and values by AVX512-BF16's dot product: a prefill
 * chunk of n query tokens (positions start .. start+n-1) against keys 0 .. start+n-1 read
 * through the sequence's block table (causal), or every query against all start+n keys
 * (causal 0: a vision tower's image, its K/V a one-block "cache").
 *
 * Why: in bfloat16 the attention was the largest part of a prefill left outside oneDNN's
 * products. The small LLaVA's 1,750-token prefill (three images; 12 heads over 4 KV heads
 * of 64), AMD EPYC family 25 model 17, 2 threads: 374 ms of its ~900 in torch's flash kernel
 * (113 GFLOP/s of useful work, against ~400 for the host's bfloat16 products), and a 577-token
 * CLIP image's 7 layers 41 of its 115 ms; paged_prefill.c widens bfloat16 to float32 and
 * multiplies in float32 (its own peak ~185 GFLOP/s). VDPBF16PS multiplies a pair of
 * bfloat16 values per lane and adds both products into a float32 lane, so both products of
 * attention read bfloat16 as it lies:
 *   scores: the keys, packed once per call as [KV head][dim pair][key] 32-bit pairs, against
 *     one broadcast query pair per row and step: 8 rows x 32 keys in 16 accumulators;
 *   P x V: each row's softmax weights rounded to bfloat16 (to nearest even, as torch's CPU
 *     flash kernel rounds its weights for a bfloat16 product) and broadcast a key pair at a
 *     time against the values packed as [KV head][key pair][column] pairs.
 * The softmax runs in float32 (online, one running maximum and a vector of sums a row);
 * the output is rounded to bfloat16 once, at the end. Products are exact and summed in
 * float32 (the instruction flushes subnormals).
 *
 * A host without AVX512-BF16, or a variant without AVX-512, serves nothing here
 * (vlmd_flash_bf16_serves answers 0): the caller keeps its other path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"
#include "kernels.h"
#include "prefill_checks.h"

#ifdef __AVX512F__
#include <immintrin.h>

#include "vector_exp.h"

#define FLASH_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#define ROWS 8        /* query rows a tile: 8 x 2 score accumulators, 8 x 2 output ones */
#define KEYS 32       /* keys a step: two vectors of scores a row */
#define MAX_DIM 256   /* head sizes: a multiple of 8 up to this */

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
VECTOR_EXP_NONPOSITIVE(exp16, vf16, vi16)

typedef struct {
    const uint32_t *keys;   /* [Hkv][dim / 2][stride]: key t's (d, d+1) pair at [g][d / 2][t] */
    const uint32_t *values; /* [Hkv][stride / 2][dim]: keys (2j, 2j+1) of column c at [g][j][c] */
    int64_t stride;         /* keys a packed row, a multiple of KEYS (padding: zeros) */
    int dim, causal, total;
    float scale;
} Packed;

/* The columns of output vector c (16 a vector) that lie inside a head of `dim`. */
static inline __mmask16 column_mask(int dim, int c) {
    const int left = dim - c * 16;
    return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
}

/* `rows` (<= ROWS) query tokens of one head, positions pos0.., bfloat16 rows q_stride apart,
 * against the packed keys of their KV head; out: bfloat16 rows out_stride apart. */
FLASH_TARGET static void flash_tile(const Packed *packed, const uint16_t *q, int64_t q_stride, int rows, int pos0,
                                    int kv_head, uint16_t *out, int64_t out_stride) {
    const int dim = packed->dim, dim_pairs = dim / 2, vectors = (dim + 15) / 16;
    const int64_t stride = packed->stride;
    const uint32_t *keys = packed->keys + (int64_t)kv_head * dim_pairs * stride;
    const uint32_t *values = packed->values + (int64_t)kv_head * (stride / 2) * dim;
    const uint32_t *query[ROWS];
    for (int r = 0; r < ROWS; r++) /* rows past the tile's repeat its last: computed, never written */
        query[r] = (const uint32_t *)(q + (int64_t)(r < rows ? r : rows - 1) * q_stride);
    float o[ROWS][MAX_DIM + 16] __attribute__((aligned(64))); /* + a vector: a pair's second past dim */
    uint32_t weights[ROWS][KEYS / 2] __attribute__((aligned(64)));
    float maxes[ROWS], corrections[ROWS];
    __m512 sums[ROWS];
    for (int r = 0; r < ROWS; r++) {
        maxes[r] = -INFINITY;
        sums[r] = _mm512_setzero_ps();
        memset(o[r], 0, sizeof(float) * (vectors + 1) * 16);
    }
    const __m512 scale = _mm512_set1_ps(packed->scale), hidden = _mm512_set1_ps(-INFINITY);
    const int end = packed->causal ? pos0 + rows : packed->total; /* keys [0, end) */
    for (int k0 = 0; k0 < end; k0 += KEYS) {
        __m512 s[ROWS][2];
        for (int r = 0; r < ROWS; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
        for (int d = 0; d < dim_pairs; d++) {
            const __m512bh low = (__m512bh)_mm512_load_si512(keys + d * stride + k0);
            const __m512bh high = (__m512bh)_mm512_load_si512(keys + d * stride + k0 + 16);
            for (int r = 0; r < ROWS; r++) {
                const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)query[r][d]);
                s[r][0] = _mm512_dpbf16_ps(s[r][0], pair, low);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], pair, high);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            const int visible = (packed->causal ? pos0 + r + 1 : packed->total) - k0; /* of this step's keys */
            if (visible <= 0) { /* a causal row whose keys ended in an earlier step */
                memset(weights[r], 0, sizeof weights[r]);
                corrections[r] = 1.0f;
                continue;
            }
            const __mmask16 m0 = visible >= 16 ? 0xFFFF : (__mmask16)((1u << visible) - 1);
            const __mmask16 m1 = visible >= KEYS ? 0xFFFF : visible <= 16 ? 0 : (__mmask16)((1u << (visible - 16)) - 1);
            const __m512 a = _mm512_mask_mul_ps(hidden, m0, s[r][0], scale);
            const __m512 b = _mm512_mask_mul_ps(hidden, m1, s[r][1], scale);
            const float step_max = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
            const float new_max = step_max > maxes[r] ? step_max : maxes[r];
            const float correction = maxes[r] == -INFINITY ? 0.0f : expf(maxes[r] - new_max);
            const __m512 top = _mm512_set1_ps(new_max);
            const __m512 e0 = _mm512_maskz_mov_ps(m0, (__m512)exp16((vf16)_mm512_sub_ps(a, top)));
            const __m512 e1 = _mm512_maskz_mov_ps(m1, (__m512)exp16((vf16)_mm512_sub_ps(b, top)));
            sums[r] = _mm512_add_ps(_mm512_mul_ps(sums[r], _mm512_set1_ps(correction)), _mm512_add_ps(e0, e1));
            maxes[r] = new_max;
            corrections[r] = correction;
            _mm512_store_si512(weights[r], (__m512i)_mm512_cvtne2ps_pbh(e1, e0)); /* keys 0..15 low, 16..31 high */
        }
        const int count = end - k0 < KEYS ? end - k0 : KEYS, key_pairs = (count + 1) / 2;
        const uint32_t *step_values = values + (int64_t)(k0 / 2) * dim;
        /* Two output vectors at a time; the last one alone, masked past dim (72 = 4.5 x 16). */
        for (int c = 0; c < vectors; c += 2) {
            const __mmask16 m0 = column_mask(dim, c), m1 = c + 1 < vectors ? column_mask(dim, c + 1) : 0;
            __m512 acc[ROWS][2];
            for (int r = 0; r < ROWS; r++) {
                const __m512 correction = _mm512_set1_ps(corrections[r]);
                acc[r][0] = _mm512_mul_ps(_mm512_load_ps(o[r] + c * 16), correction);
                acc[r][1] = _mm512_mul_ps(_mm512_load_ps(o[r] + c * 16 + 16), correction);
            }
            if (m1) {
                for (int j = 0; j < key_pairs; j++) {
                    const uint32_t *row = step_values + (int64_t)j * dim + c * 16;
                    const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, row);
                    const __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, row + 16);
                    for (int r = 0; r < ROWS; r++) {
                        const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)weights[r][j]);
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pair, v0);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pair, v1);
                    }
                }
            } else {
                for (int j = 0; j < key_pairs; j++) {
                    const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, step_values + (int64_t)j * dim + c * 16);
                    for (int r = 0; r < ROWS; r++)
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32((int)weights[r][j]), v0);
                }
            }
            for (int r = 0; r < ROWS; r++) {
                _mm512_store_ps(o[r] + c * 16, acc[r][0]);
                _mm512_store_ps(o[r] + c * 16 + 16, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sums[r]));
        for (int c = 0; c < vectors; c++)
            _mm256_mask_storeu_epi16(out + r * out_stride + c * 16, column_mask(dim, c),
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o[r] + c * 16), inverse)));
    }
}

int vlmd_flash_bf16_serves(int dim) {
    return host_runs_avx512bf16() && dim > 0 && dim % 8 == 0 && dim <= MAX_DIM;
}

/* q: n query tokens, token t's head h at q + t * q_stride + h * dim (bfloat16); caches
 * [slots, Hkv, dim] bfloat16, contiguous; table: the sequence's block ids (enough for
 * start + n tokens, each < num_slots / block_size); out like q with out_stride. Returns 0,
 * or -1 heads not a multiple of KV heads, -2 a head size or host this does not serve, -3
 * sizes, -5 out of memory, -6 a block id outside the cache. */
int vlmd_flash_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int32_t *table, int num_table_blocks, int64_t num_slots, int block_size, int start, int n,
                    int heads, int kv_heads, int dim, float scale, int causal, uint16_t *out, int64_t out_stride,
                    int threads) {
    if (kv_heads <= 0 || heads <= 0 || heads % kv_heads != 0) return -1;
    if (!vlmd_flash_bf16_serves(dim)) return -2;
    const int checked = check_prefill_chunk(table, num_table_blocks, num_slots, block_size, start, n, heads, dim,
                                            q_stride, out_stride);
    if (checked != 0) return checked;
    const int total = start + n;
    const int group = heads / kv_heads, dim_pairs = dim / 2;
    const int64_t token_values = (int64_t)kv_heads * dim, stride = ((int64_t)(total + KEYS - 1) / KEYS) * KEYS;
    uint32_t *keys = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * kv_heads * dim_pairs * stride);
    uint32_t *values = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * kv_heads * (stride / 2) * dim);
    if (keys == NULL || values == NULL) {
        free(keys);
        free(values);
        return -5;
    }
    const Packed packed = {keys, values, stride, dim, causal, total, scale};
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* Packing: each key's pairs are 32-bit words of its cache row already; a value pair
         * interleaves two keys' rows column by column. Padding keys are zeros (finite: a
         * masked weight is an exact 0, and 0 x a finite value adds nothing). */
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < stride / 2; pair++) {
            for (int g = 0; g < kv_heads; g++) {
                uint16_t *value_pairs = (uint16_t *)(values + ((int64_t)g * (stride / 2) + pair) * dim);
                for (int half = 0; half < 2; half++) {
                    const int64_t t = 2 * pair + half;
                    uint32_t *column = keys + (int64_t)g * dim_pairs * stride + t;
                    if (t < total) {
                        const int64_t offset =
                            ((int64_t)table[t / block_size] * block_size + t % block_size) * token_values +
                            (int64_t)g * dim;
                        const uint32_t *key_row = (const uint32_t *)(k_cache + offset);
                        const uint16_t *value_row = v_cache + offset;
                        for (int d = 0; d < dim_pairs; d++) column[d * stride] = key_row[d];
                        for (int c = 0; c < dim; c++) value_pairs[2 * c + half] = value_row[c];
                    } else {
                        for (int d = 0; d < dim_pairs; d++) column[d * stride] = 0;
                        for (int c = 0; c < dim; c++) value_pairs[2 * c + half] = 0;
                    }
                }
            }
        }
        const int tiles = (n + ROWS - 1) / ROWS;
        const int64_t tasks = (int64_t)tiles * heads;
        /* Latest tiles first: under the causal mask they see the most keys. */
#pragma omp for schedule(dynamic, 2)
        for (int64_t task = 0; task < tasks; task++) {
            const int tile = causal ? tiles - 1 - (int)(task / heads) : (int)(task / heads), head = (int)(task % heads);
            const int first = tile * ROWS, count = n - first < ROWS ? n - first : ROWS;
            flash_tile(&packed, q + first * q_stride + (int64_t)head * dim, q_stride, count, start + first, head / group,
                       out + first * out_stride + (int64_t)head * dim, out_stride);
        }
    }
    free(keys);
    free(values);
    return 0;
}

#else /* no AVX-512 in this variant: nothing served */

int vlmd_flash_bf16_serves(int dim) {
    (void)dim;
    return 0;
}

int vlmd_flash_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int32_t *table, int num_table_blocks, int64_t num_slots, int block_size, int start, int n,
                    int heads, int kv_heads, int dim, float scale, int causal, uint16_t *out, int64_t out_stride,
                    int threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)table, (void)num_table_blocks, (void)num_slots;
    (void)block_size, (void)start, (void)n, (void)heads, (void)kv_heads, (void)dim, (void)scale, (void)causal;
    (void)out, (void)out_stride, (void)threads;
    return -2;
}
#endif
