/* Prefill attention on the CPU: a chunk of n query tokens (positions start .. start+n-1)
 * against its sequence's keys 0 .. start+n-1 (causal) read through its block table, the
 * chunk's own K/V already written to the cache.
 *
 * Built with the package and loaded with ctypes (library.py, which has the OpenMP
 * note). The chunk's keys are first transposed per KV head
 * into a scratch [Hkv][D][keys] (the only copy, of K alone: its cost per key is 1/(n G)
 * of the attention's); then each task, a tile of ROWS consecutive query tokens of one
 * head, walks the keys in chunks of 32: 32 scores per row are 2 vectors, summed over D
 * with one broadcast query value per row and step (no horizontal sums); online softmax;
 * then the chunk's V rows, read in place through the table, are added into the rows'
 * outputs, which stay in registers for the whole walk (AVX-512; with AVX2 they live in
 * L1, below). Float32 or bfloat16 caches (the latter's chunk keys and values widened to
 * float32 once, in the transposed K scratch and a V scratch), head sizes 16, 32 and 64.
 *
 * Why: torch's flash kernel computes a causal prefill at ~2/3 of its rate without the
 * mask. The small LLaVA's causal 600-token prefill (12 heads over 4 KV heads of 64), AMD
 * EPYC (family 25, model 17): torch 8.25 ms (67 GFLOP/s of useful work), this kernel 5.24
 * (106; the host's fp32 GEMM peak is ~160). Without the mask torch's is the faster (ViT,
 * 8 heads of 64 over 577 tokens: 6.33 vs 7.79 ms), so only causal chunks come here.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "prefill_checks.h"

#include "vector_exp.h"

#ifdef __AVX512F__
#define W 16 /* floats per vector */
#else
#define W 8
#endif
#define KEY_VECTORS 2
#define KEYS (W * KEY_VECTORS) /* keys per chunk */

typedef float vf __attribute__((vector_size(W * 4)));
typedef float vfu __attribute__((vector_size(W * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

VECTOR_EXP_NONPOSITIVE(exp16, vf, vi)

static inline float lanes_max(vf v) {
    float m = v[0];
    for (int i = 1; i < W; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float lanes_sum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < W; i++) s += v[i];
    return s;
}

typedef struct {
    const float *v_cache;
    const int32_t *table;
    int block_size;
    int64_t token_floats; /* Hkv * D: one token's row in the cache */
    int64_t kt_stride;    /* keys per row of the transposed scratch */
    int causal;
} Keys;

#define ROWS 4 /* query tokens per tile */

/* The scores of one chunk of keys [k0, k0 + KEYS) for a tile's ROWS rows (qs: the rows'
 * queries, scaled, dim floats apart; rows past the tile's are zero): 32 a row on AVX-512,
 * 16 on AVX2, KEY_VECTORS vectors summed over the head size with one broadcast query value
 * per row and step (no horizontal sums). Inlined into each tile with its constant head size. */
static inline __attribute__((always_inline)) void chunk_scores(const Keys *keys, const float *qs, int dim,
                                                               const float *kt, int k0, vf s[ROWS][KEY_VECTORS]) {
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < KEY_VECTORS; j++) s[r][j] = (vf){0};
    for (int d = 0; d < dim; d++) {
        vf column[KEY_VECTORS];
        for (int j = 0; j < KEY_VECTORS; j++) column[j] = *(const vfu *)(kt + d * keys->kt_stride + k0 + j * W);
        for (int r = 0; r < ROWS; r++) {
            const float value = qs[r * dim + d];
            for (int j = 0; j < KEY_VECTORS; j++) s[r][j] += value * column[j];
        }
    }
}

/* Row r's online-softmax step over the chunk's scores s: masked past the row's last visible
 * key (`visible` keys of the chunk), p gets its unnormalised weights (0 where masked), the
 * running maximum and sum advance; returns what the row's earlier outputs must be scaled by. */
static inline __attribute__((always_inline)) float softmax_row(vf s[KEY_VECTORS], int visible, vf p[KEY_VECTORS],
                                                               float *max, float *sum) {
    if (visible < KEYS)
        for (int j = 0; j < KEY_VECTORS; j++)
            for (int t = 0; t < W; t++)
                if (j * W + t >= visible) s[j][t] = -INFINITY;
    vf top = s[0];
    for (int j = 1; j < KEY_VECTORS; j++) {
        vi greater = s[j] > top;
        top = (vf)(((vi)s[j] & greater) | ((vi)top & ~greater));
    }
    const float chunk_max = lanes_max(top);
    const float new_max = chunk_max > *max ? chunk_max : *max;
    const float correction = *max == -INFINITY ? 0.0f : expf(*max - new_max);
    vf total_p = (vf){0};
    for (int j = 0; j < KEY_VECTORS; j++) {
        vf e = exp16(s[j] - new_max);
        vi hidden = s[j] == -INFINITY; /* masked (and rows past `rows`: all zero q) */
        p[j] = (vf)((vi)e & ~hidden);
        total_p += p[j];
    }
    *sum = *sum * correction + lanes_sum(total_p);
    *max = new_max;
    return correction;
}

/* The address of the V row of `token` for this tile's KV head. */
static inline const float *value_row(const Keys *keys, int token, int kv_head, int dim) {
    return keys->v_cache +
           ((int64_t)keys->table[token / keys->block_size] * keys->block_size + token % keys->block_size) *
               keys->token_floats +
           (int64_t)kv_head * dim;
}

/* rows (<= ROWS) query tokens of one head at positions pos0.., q rows q_stride floats
 * apart, against keys 0..(causal ? pos0 + r : total - 1); kt: this KV head's transposed
 * keys; out rows out_stride apart. Each tile keeps its rows' outputs o, scaled by each
 * softmax step's correction, and adds each chunk's P x V into them. */
#define TILE_START(DIM)                                                                                          \
    static void tile_##DIM(const Keys *keys, const float *q, int64_t q_stride, int rows, int pos0, int total,   \
                           const float *kt, int kv_head, float scale, float *out, int64_t out_stride) {          \
        enum { DV = DIM / W };                                                                                   \
        float maxes[ROWS], sums[ROWS], qs[ROWS][DIM];                                                           \
        vf p[ROWS][KEY_VECTORS];                                                                                 \
        for (int r = 0; r < ROWS; r++) {                                                                         \
            maxes[r] = -INFINITY;                                                                                \
            sums[r] = 0.0f;                                                                                      \
            for (int d = 0; d < DIM; d++) qs[r][d] = r < rows ? q[r * q_stride + d] * scale : 0.0f;      \
        }                                                                                                        \
        const int end = keys->causal ? pos0 + rows : total; /* keys [0, end) */

#ifdef __AVX512F__
/* Four rows' outputs (ROWS x DIM / 16 vectors) stay in registers. Head sizes above 64
 * have no copy: with two rows a tile (all that fits the registers) this kernel ran
 * Qwen2-VL's causal 1,000-token shape (12 / 2 heads of 128) at 0.76x torch's flash. */
#define TILE(DIM)                                                                                                \
    TILE_START(DIM)                                                                                              \
        vf o[ROWS][DV];                                                                                          \
        for (int r = 0; r < ROWS; r++)                                                                           \
            for (int c = 0; c < DV; c++) o[r][c] = (vf){0};                                                      \
        for (int k0 = 0; k0 < end; k0 += KEYS) {                                                                 \
            vf s[ROWS][KEY_VECTORS];                                                                             \
            chunk_scores(keys, &qs[0][0], DIM, kt, k0, s);                                                       \
            for (int r = 0; r < ROWS; r++) {                                                                     \
                const int visible = (keys->causal ? pos0 + r + 1 : total) - k0; /* of the chunk's keys */       \
                const float correction = softmax_row(s[r], visible, p[r], &maxes[r], &sums[r]);                  \
                if (correction != 1.0f)                                                                          \
                    for (int c = 0; c < DV; c++) o[r][c] *= correction;                                          \
            }                                                                                                    \
            const int count = end - k0 < KEYS ? end - k0 : KEYS;                                                 \
            for (int t = 0; t < count; t++) {                                                                    \
                const float *row = value_row(keys, k0 + t, kv_head, DIM);                                        \
                vf value[DV];                                                                                    \
                for (int c = 0; c < DV; c++) value[c] = *(const vfu *)(row + c * W);                             \
                for (int r = 0; r < ROWS; r++) {                                                                 \
                    const float weight = p[r][t / W][t % W];                                                     \
                    for (int c = 0; c < DV; c++) o[r][c] += weight * value[c];                                   \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < rows; r++) {                                                                         \
            const float inverse = 1.0f / sums[r];                                                                \
            for (int c = 0; c < DV; c++) *(vfu *)(out + r * out_stride + c * W) = o[r][c] * inverse;             \
        }                                                                                                        \
    }
#else
/* AVX2 has 16 vector registers of 8 floats: four rows of a 64-wide head's outputs alone
 * would take 32, and the tile above, built for AVX2, spilled its outputs and scores on
 * every step (the small LLaVA's whole 600-token prefill took 2.1 s with it against 1.1 s
 * with torch's flash, AMD EPYC family 25 model 1). Here the outputs live in an L1 buffer
 * and each chunk's P x V runs as a small product over two output vectors at a time: 8
 * accumulators, 2 value loads and 4 broadcasts per key. The 600-token shape above,
 * alternated in one process (same host): this tile 13.1 ms, torch's causal flash 14.8
 * (2,000 tokens: 130 against 90: torch's blocked products win there; three rows of 32 keys
 * a chunk were no faster). */
#define TILE(DIM)                                                                                                \
    TILE_START(DIM)                                                                                              \
        float o[ROWS][DIM] __attribute__((aligned(32)));                                                         \
        float weights[ROWS][KEYS] __attribute__((aligned(32)));                                                  \
        const float *value_rows[KEYS];                                                                           \
        for (int r = 0; r < ROWS; r++)                                                                           \
            for (int d = 0; d < DIM; d++) o[r][d] = 0.0f;                                                        \
        for (int k0 = 0; k0 < end; k0 += KEYS) {                                                                 \
            vf s[ROWS][KEY_VECTORS];                                                                             \
            chunk_scores(keys, &qs[0][0], DIM, kt, k0, s);                                                       \
            for (int r = 0; r < ROWS; r++) {                                                                     \
                const int visible = (keys->causal ? pos0 + r + 1 : total) - k0;                                  \
                const float correction = softmax_row(s[r], visible, p[r], &maxes[r], &sums[r]);                  \
                for (int j = 0; j < KEY_VECTORS; j++) *(vf *)(weights[r] + j * W) = p[r][j];                     \
                if (correction != 1.0f)                                                                          \
                    for (int d = 0; d < DIM; d++) o[r][d] *= correction;                                         \
            }                                                                                                    \
            const int count = end - k0 < KEYS ? end - k0 : KEYS;                                                 \
            for (int t = 0; t < count; t++) value_rows[t] = value_row(keys, k0 + t, kv_head, DIM);               \
            for (int c = 0; c < DV; c += 2) {                                                                    \
                vf acc[ROWS][2];                                                                                 \
                for (int r = 0; r < ROWS; r++)                                                                   \
                    for (int j = 0; j < 2; j++) acc[r][j] = *(const vf *)(o[r] + (c + j) * W);                   \
                for (int t = 0; t < count; t++) {                                                                \
                    const vf v0 = *(const vfu *)(value_rows[t] + c * W);                                         \
                    const vf v1 = *(const vfu *)(value_rows[t] + (c + 1) * W);                                   \
                    for (int r = 0; r < ROWS; r++) {                                                             \
                        acc[r][0] += weights[r][t] * v0;                                                         \
                        acc[r][1] += weights[r][t] * v1;                                                         \
                    }                                                                                            \
                }                                                                                                \
                for (int r = 0; r < ROWS; r++)                                                                   \
                    for (int j = 0; j < 2; j++) *(vf *)(o[r] + (c + j) * W) = acc[r][j];                         \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < rows; r++) {                                                                         \
            const float inverse = 1.0f / sums[r];                                                                \
            for (int d = 0; d < DIM; d++) out[r * out_stride + d] = o[r][d] * inverse;                           \
        }                                                                                                        \
    }
#endif
TILE(16)
TILE(32)
TILE(64)

typedef void (*Tile)(const Keys *, const float *, int64_t, int, int, int, const float *, int, float, float *, int64_t);

static int rows_for(int dim, Tile *tile) {
    switch (dim) {
        case 16: *tile = tile_16; return 4;
        case 32: *tile = tile_32; return 4;
        case 64: *tile = tile_64; return 4;
        default: return 0;
    }
}

/* q: n query tokens, row t of head h at q + t * q_stride + h * dim (float32);
 * caches [slots, Hkv, D] float32, contiguous; table: the sequence's block ids (enough for
 * start + n tokens, each < num_slots / block_size); out like q with out_stride.
 * causal 0: every query sees all start + n keys. Returns 0, or -1 heads not a multiple
 * of KV heads, -2 a head size without a copy here, -3 sizes, -5 out of memory, -6 a block
 * id outside the cache. */
static inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* Both entry points: caches of float32 (bf16 0) or bfloat16 (bf16 1, read as uint16). */
static int prefill(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int bf16,
                   const int32_t *table, int num_table_blocks, int64_t num_slots, int block_size, int start, int n,
                   int heads, int kv_heads, int dim, float scale, int causal, float *out, int64_t out_stride,
                   int threads) {
    if (kv_heads <= 0 || heads <= 0 || heads % kv_heads != 0) return -1;
    Tile tile = NULL;
    const int rows = rows_for(dim, &tile);
    if (rows == 0) return -2;
    const int checked = check_prefill_chunk(table, num_table_blocks, num_slots, block_size, start, n, heads, dim,
                                            q_stride, out_stride);
    if (checked != 0) return checked;
    const int total = start + n;
    const int group = heads / kv_heads;
    const int64_t token_floats = (int64_t)kv_heads * dim;
    /* Padded so a chunk's vector loads past the last key stay inside (those lanes are masked). */
    const int64_t kt_stride = ((int64_t)(total + KEYS - 1) / KEYS) * KEYS;
    /* Cache-line aligned (kt_stride is a multiple of 16 floats): a chunk's row of keys is then
     * whole lines, where malloc's 16-byte alignment split every other vector load across two
     * (3-9 % of the AVX2 tile's time). */
    float *kt = (float *)aligned_alloc(64, sizeof(float) * kv_heads * dim * kt_stride);
    if (kt == NULL) return -5;
    /* A bfloat16 cache's V rows of the chunk are widened once into float32 rows, in token
     * order (each row is read by every tile of its KV head's query heads); the tiles then
     * read them as a one-block table whose block holds every key. */
    float *values = NULL;
    static const int32_t one_block = 0;
    if (bf16) {
        values = (float *)aligned_alloc(64, sizeof(float) * token_floats * kt_stride);
        if (values == NULL) {
            free(kt);
            return -5;
        }
    }
    const Keys keys = bf16 ? (Keys){values, &one_block, (int)kt_stride, token_floats, kt_stride, causal}
                           : (Keys){(const float *)v_cache, table, block_size, token_floats, kt_stride, causal};
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < kt_stride; t++) {
            for (int g = 0; g < kv_heads; g++) {
                float *column = kt + (int64_t)g * dim * kt_stride + t;
                if (t < total) {
                    const int64_t offset =
                        ((int64_t)table[t / block_size] * block_size + t % block_size) * token_floats + (int64_t)g * dim;
                    if (bf16) {
                        const uint16_t *row = (const uint16_t *)k_cache + offset;
                        const uint16_t *value_row16 = (const uint16_t *)v_cache + offset;
                        float *widened = values + t * token_floats + (int64_t)g * dim;
                        for (int d = 0; d < dim; d++) column[d * kt_stride] = bf16_to_float(row[d]);
                        for (int d = 0; d < dim; d++) widened[d] = bf16_to_float(value_row16[d]);
                    } else {
                        const float *row = (const float *)k_cache + offset;
                        for (int d = 0; d < dim; d++) column[d * kt_stride] = row[d];
                    }
                } else {
                    for (int d = 0; d < dim; d++) column[d * kt_stride] = 0.0f;
                }
            }
        }
        const int tiles = (n + rows - 1) / rows;
        const int64_t tasks = (int64_t)tiles * heads;
        /* Latest tiles first: under the causal mask they see the most keys. */
#pragma omp for schedule(dynamic, 2)
        for (int64_t task = 0; task < tasks; task++) {
            const int tile_index = tiles - 1 - (int)(task / heads), head = (int)(task % heads);
            const int first = tile_index * rows, count = n - first < rows ? n - first : rows;
            const int kv_head = head / group;
            tile(&keys, q + first * q_stride + (int64_t)head * dim, q_stride, count, start + first, total,
                 kt + (int64_t)kv_head * dim * kt_stride, kv_head, scale, out + first * out_stride + (int64_t)head * dim,
                 out_stride);
        }
    }
    free(kt);
    free(values);
    return 0;
}

int vlmd_paged_prefill(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                       const int32_t *table, int num_table_blocks, int64_t num_slots, int block_size, int start,
                       int n, int heads, int kv_heads, int dim, float scale, int causal, float *out,
                       int64_t out_stride, int threads) {
    return prefill(q, q_stride, k_cache, v_cache, 0, table, num_table_blocks, num_slots, block_size, start, n, heads,
                   kv_heads, dim, scale, causal, out, out_stride, threads);
}

/* The same over bfloat16 caches (queries and output float32: the binding widens and narrows
 * them, a chunk's rows, where the caches are every key's). */
int vlmd_paged_prefill_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *table, int num_table_blocks, int64_t num_slots, int block_size, int start,
                            int n, int heads, int kv_heads, int dim, float scale, int causal, float *out,
                            int64_t out_stride, int threads) {
    return prefill(q, q_stride, k_cache, v_cache, 1, table, num_table_blocks, num_slots, block_size, start, n, heads,
                   kv_heads, dim, scale, causal, out, out_stride, threads);
}

/* 1 if head size `dim` has a copy here (the binding asks before it calls). */
int vlmd_paged_prefill_serves(int dim) {
    Tile tile;
    return rows_for(dim, &tile) > 0;
}
