/* A few rows times a weight that oneDNN has packed: out = x @ W.T + bias, float32.
 *
 * oneDNN's packed weight (mkldnn._reorder_linear_weight) stores W [N, K] as panels of B
 * output columns, each panel K-major: element (n, k) at ((n / B) * Kp + k) * B + n % B,
 * with K padded to Kp and the last panel padded to B columns. The Python side checks that
 * layout on each layer's own weight before this kernel may read it
 * (vlmd_packed_layout_matches), so a different layout is never misread.
 *
 * Why: a decode step multiplies 1-32 rows by every weight, and there the product only has
 * to stream the weights once at memory bandwidth. oneDNN's kernel streams them at 18-25
 * GB/s at M = 1-8 on an AMD EPYC (family 25, model 17); this one at 27-32 (the host reads
 * at ~33). It walks each panel once per block of rows: every K step loads the panel's 64
 * contiguous floats (4 AVX-512 vectors), broadcasts one x value per row and adds into
 * rows x 4 accumulators. Software prefetch only at one row (tile_1).
 */
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "kernels.h"
#include "panels.h"

int omp_get_thread_num(void);
int omp_get_num_threads(void);

#define TILE(ROWS)                                                                                            \
    static void tile_##ROWS(const float *x, int64_t x_stride, const float *panel, int64_t panel_stride,       \
                            int64_t k_len, vf acc[ROW_BLOCK][CHUNK_VECTORS]) {                                \
        vf a[ROWS][CHUNK_VECTORS];                                                                            \
        for (int m = 0; m < ROWS; m++)                                                                        \
            for (int j = 0; j < CHUNK_VECTORS; j++) a[m][j] = (vf){0};                                        \
        for (int64_t k = 0; k < k_len; k++) {                                                                 \
            const float *row = panel + k * panel_stride;                                                      \
            vf w0 = *(const vf *)row, w1 = *(const vf *)(row + VEC), w2 = *(const vf *)(row + 2 * VEC),       \
               w3 = *(const vf *)(row + 3 * VEC);                                                             \
            for (int m = 0; m < ROWS; m++) {                                                                  \
                float s = x[m * x_stride + k];                                                                \
                a[m][0] += s * w0;                                                                            \
                a[m][1] += s * w1;                                                                            \
                a[m][2] += s * w2;                                                                            \
                a[m][3] += s * w3;                                                                            \
            }                                                                                                 \
        }                                                                                                     \
        for (int m = 0; m < ROWS; m++)                                                                        \
            for (int j = 0; j < CHUNK_VECTORS; j++) acc[m][j] = a[m][j];                                      \
    }

typedef void (*Tile)(const float *, int64_t, const float *, int64_t, int64_t, vf[ROW_BLOCK][CHUNK_VECTORS]);

/* One row: the weights go by faster than the hardware prefetcher runs ahead, so the
 * panel rows 128 K steps on (32 KiB ahead in a 64-column panel) are asked for into L2.
 * Small LLaVA's 37 decode products at M = 1, alternated in one process: 24.8 / 27.3 /
 * 26.8 -> 25.8 / 30.1 / 29.0 GB/s in three runs, 29.9 / 31.1 -> 30.7 / 31.6 in two on a
 * quieter host. (At M >= 2 the same prefetch was 2-7 % slower, and 8-32 steps ahead,
 * one line a step, slower at every M.) */
#define ROW_PREFETCH_STEPS 128
static void tile_1(const float *x, int64_t x_stride, const float *panel, int64_t panel_stride, int64_t k_len,
                   vf acc[ROW_BLOCK][CHUNK_VECTORS]) {
    (void)x_stride;
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t k = 0; k < k_len; k++) {
        const float *row = panel + k * panel_stride;
        /* Past the panel's end this is the next panel (this thread's next chunk) or beyond
         * the weight: a prefetch never faults. */
        const char *ahead = (const char *)(row + ROW_PREFETCH_STEPS * panel_stride);
        for (int line = 0; line < CHUNK * 4; line += 64) __builtin_prefetch(ahead + line, 0, 1);
        const float s = x[k];
        a0 += s * *(const vf *)row;
        a1 += s * *(const vf *)(row + VEC);
        a2 += s * *(const vf *)(row + 2 * VEC);
        a3 += s * *(const vf *)(row + 3 * VEC);
    }
    acc[0][0] = a0;
    acc[0][1] = a1;
    acc[0][2] = a2;
    acc[0][3] = a3;
}
TILE(2)
#if ROW_BLOCK > 2
TILE(3)
TILE(4)
TILE(5)
TILE(6)
static const Tile TILES[ROW_BLOCK + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
#else
static const Tile TILES[ROW_BLOCK + 1] = {0, tile_1, tile_2};
#endif

/* One row's tile (CHUNK_VECTORS vectors: columns n0 .. n0 + width) into its output, plus the bias. */
static inline void store_row(const vf acc[CHUNK_VECTORS], const float *bias, float *target, int64_t n0,
                             int64_t width) {
    float sums[CHUNK_VECTORS * VEC];
    for (int j = 0; j < CHUNK_VECTORS; j++) *(vf *)(sums + j * VEC) = acc[j];
    if (bias)
        for (int64_t i = 0; i < width; i++) target[i] = sums[i] + bias[n0 + i];
    else
        memcpy(target, sums, (size_t)width * sizeof(float));
}

/* Columns [chunk * CHUNK, +CHUNK) of every row. Later row blocks re-read the chunk's
 * weights from L2 (K x CHUNK floats: 192 KiB at K = 768). */
static void chunk_rows(const float *x, int64_t x_stride, const void *weights, const float *scale,
                       int64_t panel_width, int64_t padded_k, const float *bias, float *out, int64_t out_stride,
                       int64_t rows, int64_t n_len, int64_t k_len, int64_t chunk) {
    (void)scale;
    const float *w = weights;
    int64_t n0 = chunk * CHUNK;
    const float *panel = w + (n0 / panel_width) * padded_k * panel_width + n0 % panel_width;
    int64_t width = n_len - n0 < CHUNK ? n_len - n0 : CHUNK;
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        int block = rows - m0 < ROW_BLOCK ? (int)(rows - m0) : ROW_BLOCK;
        vf acc[ROW_BLOCK][CHUNK_VECTORS];
        TILES[block](x + m0 * x_stride, x_stride, panel, panel_width, k_len, acc);
        for (int m = 0; m < block; m++) store_row(acc[m], bias, out + (m0 + m) * out_stride + n0, n0, width);
    }
}

/* Each thread's share of the chunks, [front, back) packed in one word so that a thread
 * taking from the front and another stealing from the back agree (compare-and-swap). A
 * thread walks its own share front to back, as a static split would, then takes what
 * is left of the others' from their far ends. Why: on two vCPUs shared with the server's
 * event loop (and with other tenants), a static split waits for the thread that was
 * descheduled while the other idles. The small LLaVA's decode step in one process, with a
 * thread taking 0.4 ms of CPU every 5 ms beside it, static / stealing medians (AMD EPYC
 * fam 25 model 17): B = 1 12.25 / 12.13 and 12.97 / 12.89 ms, B = 8 28.8 / 25.8 and
 * 23.0 / 22.6; without that thread B = 1 11.12 / 10.95 and 13.87 / 13.39. */
#define MAX_TEAM 64
typedef struct {
    uint64_t span;
    char pad[56]; /* one cache line per share */
} Share;

static int64_t take(Share *share, int from_back) {
    uint64_t old = __atomic_load_n(&share->span, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t front = old & 0xffffffffu, back = old >> 32;
        if (front >= back) return -1;
        uint64_t next = from_back ? (front | ((back - 1) << 32)) : ((front + 1) | (back << 32));
        if (__atomic_compare_exchange_n(&share->span, &old, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return (int64_t)(from_back ? back - 1 : front);
    }
}

/* Every chunk of a product through ``rows_of`` (a dtype's chunk_rows), on ``threads``:
 * each thread its share front to back, then what is left of the others' from their far ends. */
/* 0, or -1: a panel width that is not a positive multiple of the chunk, -2: padded_k < k_len
 * (or not a multiple of the dtype's K pairing), -3: a size or stride out of range. */
int run_panel_chunks(ChunkRows rows_of, int64_t chunk_width, int64_t k_pairing, int threads, const float *x,
                     int64_t x_stride, const void *w, const float *scale, int64_t panel_width, int64_t padded_k,
                     const float *bias, float *out, int64_t out_stride, int64_t rows, int64_t n_len, int64_t k_len) {
    if (panel_width <= 0 || panel_width % chunk_width != 0) return -1;
    if (padded_k < k_len || padded_k % k_pairing) return -2;
    if (rows < 1 || n_len < 1 || k_len < 1 || x_stride < k_len || out_stride < n_len) return -3;
    const int64_t chunks = (n_len + chunk_width - 1) / chunk_width;
    if (threads > MAX_TEAM) threads = MAX_TEAM;
    if (threads < 2 || chunks < 2) {
        for (int64_t chunk = 0; chunk < chunks; chunk++)
            rows_of(x, x_stride, w, scale, panel_width, padded_k, bias, out, out_stride, rows, n_len, k_len, chunk);
        return 0;
    }
    Share shares[MAX_TEAM];
#pragma omp parallel num_threads(threads)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t share = (chunks + team - 1) / team, first = me * share;
        int64_t last = first + share > chunks ? chunks : first + share;
        __atomic_store_n(&shares[me].span, (uint64_t)(first < last ? first : last) | ((uint64_t)last << 32),
                         __ATOMIC_RELAXED);
#pragma omp barrier /* every share is set before anyone steals */
        int64_t chunk;
        while ((chunk = take(&shares[me], 0)) >= 0)
            rows_of(x, x_stride, w, scale, panel_width, padded_k, bias, out, out_stride, rows, n_len, k_len, chunk);
        /* Done early (the other thread was descheduled): finish its share from the far end. */
        for (int other = (me + 1) % team; other != me; other = (other + 1) % team)
            while ((chunk = take(&shares[other], 1)) >= 0)
                rows_of(x, x_stride, w, scale, panel_width, padded_k, bias, out, out_stride, rows, n_len, k_len, chunk);
    }
    return 0;
}

/* The columns one tile computes: the Python side only offers panels that are a multiple. */
int vlmd_packed_linear_chunk(void) { return CHUNK; }

/* 0, or an error of run_panel_chunks. */
int vlmd_packed_linear(const float *x, int64_t x_stride, const float *w, int64_t panel_width, int64_t padded_k,
                       const float *bias, float *out, int64_t out_stride, int64_t rows, int64_t n_len,
                       int64_t k_len, int threads) {
    return run_panel_chunks(chunk_rows, CHUNK, 1, threads, x, x_stride, w, NULL, panel_width, padded_k, bias,
                            out, out_stride, rows, n_len, k_len);
}

/* 1 if `packed` holds `plain` [N, K] in the panel layout above (bit for bit, so NaNs and
 * signed zeros count), else 0. Padding is not read: the kernel never uses it. */
/* The layout check of a dtype whose K comes in runs of PAIR (1: float32, 2: bfloat16):
 * element (n, k) at ((n / B) * Kp + (k / PAIR) * PAIR) * B + (n % B) * PAIR + k % PAIR, compared
 * bit for bit (so NaNs and signed zeros count). Padding is not read: the kernel never uses it. */
#define LAYOUT_MATCHES(NAME, TYPE, PAIR)                                                                      \
    int NAME(const TYPE *plain, const TYPE *packed, int64_t n_len, int64_t k_len, int64_t panel_width,       \
             int64_t padded_k, int threads) {                                                                 \
        if (panel_width <= 0 || padded_k < k_len || padded_k % (PAIR)) return 0;                              \
        int mismatches = 0;                                                                                   \
        _Pragma("omp parallel for num_threads(threads) if (threads > 1) reduction(+ : mismatches) schedule(static)") \
        for (int64_t n = 0; n < n_len; n++) {                                                                 \
            const TYPE *source = plain + n * k_len;                                                           \
            const TYPE *target = packed + (n / panel_width) * padded_k * panel_width + (n % panel_width) * (PAIR); \
            for (int64_t k = 0; k < k_len; k++)                                                               \
                if (source[k] != target[(k / (PAIR)) * (PAIR) * panel_width + k % (PAIR)]) {                  \
                    mismatches++;                                                                             \
                    break;                                                                                    \
                }                                                                                             \
        }                                                                                                     \
        return mismatches == 0;                                                                               \
    }

/* 1 if `packed` holds the float32 `plain` [N, K] in the panel layout above, else 0. */
LAYOUT_MATCHES(vlmd_packed_layout_matches, uint32_t, 1)

/* bfloat16 weights as oneDNN packs them (mkldnn._reorder_linear_weight of a bfloat16
 * weight): panels of B output columns, K in pairs, element (n, k) at
 * ((n / B) * Kp + (k / 2) * 2) * B + (n % B) * 2 + k % 2, K padded to Kp (even). The Python
 * side checks that layout on each layer's own weight (vlmd_packed_bf16_layout_matches).
 *
 * Why: oneDNN's bfloat16 product at M = 1 streamed the small LLaVA's decode weights at
 * ~14 GB/s (9.1 ms for its 125 MB; AMD EPYC fam 25 model 17, avx512_bf16), so a bfloat16
 * decode step was slower than a float32 one that reads twice the bytes. Here the rows are
 * float32 (a bfloat16 value widens exactly), each vector of a panel row holds VEC / 2
 * columns times a pair of K, and the pair splits into two float32 vectors by bit masks
 * (a bfloat16 is the top half of its float32): even k = bits << 16, odd k = bits with the
 * low half cleared. Products are exact in float32 and summed in float32, in another order
 * than oneDNN's: the results agree to float32 rounding before the caller rounds them to
 * bfloat16. Needs no bfloat16 instructions (AVX-512F, or AVX2 at 8 lanes). */
typedef uint32_t vu __attribute__((vector_size(VEC * 4), aligned(4)));
#define BF16_ROW_BLOCK 4 /* 4 x 4 accumulators + 8 widened weight vectors of 32 registers */
#define BF16_CHUNK (CHUNK_VECTORS * VEC) /* columns one tile computes: a vector holds VEC columns x a K pair */

#define TILE_BF16(ROWS)                                                                                       \
    static void tile_bf16_##ROWS(const float *x, int64_t x_stride, const uint16_t *panel, int64_t panel_width, \
                                 int64_t k_len, vf acc[BF16_ROW_BLOCK][CHUNK_VECTORS]) {                      \
        vf a[ROWS][CHUNK_VECTORS];                                                                            \
        for (int m = 0; m < ROWS; m++)                                                                        \
            for (int j = 0; j < CHUNK_VECTORS; j++) a[m][j] = (vf){0};                                        \
        const vu high = (vu){0} + 0xffff0000u;                                                                \
        int64_t k = 0;                                                                                        \
        for (; k + 1 < k_len; k += 2) {                                                                       \
            const uint16_t *row = panel + k * panel_width;                                                    \
            vf even[CHUNK_VECTORS], odd[CHUNK_VECTORS];                                                       \
            for (int j = 0; j < CHUNK_VECTORS; j++) {                                                         \
                const vu bits = *(const vu *)(row + j * VEC * 2);                                             \
                even[j] = (vf)(bits << 16);                                                                   \
                odd[j] = (vf)(bits & high);                                                                   \
            }                                                                                                 \
            for (int m = 0; m < ROWS; m++) {                                                                  \
                const float s0 = x[m * x_stride + k], s1 = x[m * x_stride + k + 1];                           \
                for (int j = 0; j < CHUNK_VECTORS; j++) a[m][j] += s0 * even[j] + s1 * odd[j];                \
            }                                                                                                 \
        }                                                                                                     \
        if (k < k_len) { /* odd K: the last pair's second half is padding */                                 \
            const uint16_t *row = panel + k * panel_width;                                                    \
            for (int j = 0; j < CHUNK_VECTORS; j++) {                                                         \
                const vf even = (vf)(*(const vu *)(row + j * VEC * 2) << 16);                                 \
                for (int m = 0; m < ROWS; m++) a[m][j] += x[m * x_stride + k] * even;                         \
            }                                                                                                 \
        }                                                                                                     \
        for (int m = 0; m < ROWS; m++)                                                                        \
            for (int j = 0; j < CHUNK_VECTORS; j++) acc[m][j] = a[m][j];                                      \
    }

typedef void (*TileBf16)(const float *, int64_t, const uint16_t *, int64_t, int64_t, vf[BF16_ROW_BLOCK][CHUNK_VECTORS]);
TILE_BF16(1)
TILE_BF16(2)
TILE_BF16(3)
TILE_BF16(4)
static const TileBf16 TILES_BF16[BF16_ROW_BLOCK + 1] = {0, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4};

/* Columns [chunk * BF16_CHUNK, +BF16_CHUNK) of every row: lane i of vector j is column
 * n0 + j * VEC + i, its even-k and odd-k weights summed into the same accumulator. */
static void chunk_rows_bf16(const float *x, int64_t x_stride, const void *weights, const float *scale,
                            int64_t panel_width, int64_t padded_k, const float *bias, float *out, int64_t out_stride,
                            int64_t rows, int64_t n_len, int64_t k_len, int64_t chunk) {
    (void)scale;
    const uint16_t *w = weights;
    int64_t n0 = chunk * BF16_CHUNK;
    const uint16_t *panel = w + (n0 / panel_width) * padded_k * panel_width + (n0 % panel_width) * 2;
    int64_t width = n_len - n0 < BF16_CHUNK ? n_len - n0 : BF16_CHUNK;
    for (int64_t m0 = 0; m0 < rows; m0 += BF16_ROW_BLOCK) {
        int block = rows - m0 < BF16_ROW_BLOCK ? (int)(rows - m0) : BF16_ROW_BLOCK;
        vf acc[BF16_ROW_BLOCK][CHUNK_VECTORS];
        TILES_BF16[block](x + m0 * x_stride, x_stride, panel, panel_width, k_len, acc);
        for (int m = 0; m < block; m++) store_row(acc[m], bias, out + (m0 + m) * out_stride + n0, n0, width);
    }
}

int vlmd_packed_linear_bf16_chunk(void) { return BF16_CHUNK; }

/* The same panels through the AVX512-BF16 dot product (below), where this variant can
 * build it and the host has the instruction. */
#ifdef __AVX512F__
#include <immintrin.h>
#include <stdlib.h>
#define DOT_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
#define DOT_ROW_BLOCK 6 /* 6 x 4 accumulators + 4 weight vectors + 1 broadcast of 32 registers */

/* Why: at 2 or more rows the widening kernel above is bound by its float32 multiplies (two
 * FMAs a pair of K a vector, plus the widening), not by the bytes: the small LLaVA's decode
 * step at batch 8 took ~13 ms in bfloat16 against a 3.2 ms bytes floor (roofline.py, AMD
 * EPYC fam 25 model 17). VDPBF16PS multiplies a pair of bfloat16 values per lane and adds
 * both products into a float32 lane, straight from the panel's (even k, odd k) pairs, so
 * one instruction does the work of the two FMAs and the widening. Its cost: the rows are
 * rounded to bfloat16 first (to nearest even, as torch rounds), as a bfloat16 model's rows
 * are on the module path and as oneDNN's bfloat16 product rounds them; the products are
 * exact and summed in float32, in another order (the instruction flushes subnormals). */
#define TILE_DOT(ROWS)                                                                                        \
    DOT_TARGET static void tile_dot_##ROWS(const uint32_t *x, int64_t x_stride, const uint16_t *panel,       \
                                           int64_t panel_width, int64_t pairs, uint32_t odd_mask,            \
                                           vf acc[DOT_ROW_BLOCK][CHUNK_VECTORS]) {                            \
        __m512 a[ROWS][CHUNK_VECTORS];                                                                        \
        for (int m = 0; m < ROWS; m++)                                                                        \
            for (int j = 0; j < CHUNK_VECTORS; j++) a[m][j] = _mm512_setzero_ps();                            \
        for (int64_t p = 0; p < pairs; p++) {                                                                 \
            const uint16_t *row = panel + 2 * p * panel_width;                                                \
            __m512i w[CHUNK_VECTORS];                                                                         \
            for (int j = 0; j < CHUNK_VECTORS; j++) w[j] = _mm512_loadu_si512(row + j * VEC * 2);             \
            if (p == pairs - 1) /* odd K: the last pair's second half is padding, never multiplied */         \
                for (int j = 0; j < CHUNK_VECTORS; j++) w[j] = _mm512_and_si512(w[j], _mm512_set1_epi32((int)odd_mask)); \
            for (int m = 0; m < ROWS; m++) {                                                                  \
                const __m512bh s = (__m512bh)_mm512_set1_epi32((int)x[m * x_stride + p]);                     \
                for (int j = 0; j < CHUNK_VECTORS; j++) a[m][j] = _mm512_dpbf16_ps(a[m][j], s, (__m512bh)w[j]); \
            }                                                                                                 \
        }                                                                                                     \
        for (int m = 0; m < ROWS; m++)                                                                        \
            for (int j = 0; j < CHUNK_VECTORS; j++) acc[m][j] = (vf)a[m][j];                                  \
    }

typedef void (*TileDot)(const uint32_t *, int64_t, const uint16_t *, int64_t, int64_t, uint32_t,
                        vf[DOT_ROW_BLOCK][CHUNK_VECTORS]);
TILE_DOT(1)
TILE_DOT(2)
TILE_DOT(3)
TILE_DOT(4)
TILE_DOT(5)
TILE_DOT(6)
static const TileDot TILES_DOT[DOT_ROW_BLOCK + 1] = {0,          tile_dot_1, tile_dot_2, tile_dot_3,
                                                     tile_dot_4, tile_dot_5, tile_dot_6};

/* As chunk_rows_bf16, with x the rows already rounded to bfloat16 pairs (handed through
 * run_panel_chunks' float pointer): x_stride counts bfloat16 values, an even number. */
static void chunk_rows_dot(const float *x, int64_t x_stride, const void *weights, const float *scale,
                           int64_t panel_width, int64_t padded_k, const float *bias, float *out, int64_t out_stride,
                           int64_t rows, int64_t n_len, int64_t k_len, int64_t chunk) {
    (void)scale;
    const uint32_t *pairs_of_rows = (const uint32_t *)(const void *)x;
    const uint16_t *w = weights;
    int64_t n0 = chunk * BF16_CHUNK;
    const uint16_t *panel = w + (n0 / panel_width) * padded_k * panel_width + (n0 % panel_width) * 2;
    int64_t width = n_len - n0 < BF16_CHUNK ? n_len - n0 : BF16_CHUNK;
    const int64_t pairs = (k_len + 1) / 2;
    const uint32_t odd_mask = k_len % 2 ? 0x0000ffffu : 0xffffffffu;
    for (int64_t m0 = 0; m0 < rows; m0 += DOT_ROW_BLOCK) {
        int block = rows - m0 < DOT_ROW_BLOCK ? (int)(rows - m0) : DOT_ROW_BLOCK;
        vf acc[DOT_ROW_BLOCK][CHUNK_VECTORS];
        TILES_DOT[block](pairs_of_rows + m0 * (x_stride / 2), x_stride / 2, panel, panel_width, pairs, odd_mask, acc);
        for (int m = 0; m < block; m++) store_row(acc[m], bias, out + (m0 + m) * out_stride + n0, n0, width);
    }
}

/* Each row of x rounded to bfloat16 pairs (k even, k odd; an odd K's last pair's odd half 0)
 * into `rounded` (rows x pairs), 32 values a step by VCVTNE2PS2BF16: to nearest with ties to
 * even, as torch rounds (a NaN stays a NaN; a subnormal row value becomes 0, as the dot
 * product would flush it). */
DOT_TARGET static void round_rows(const float *x, int64_t x_stride, int64_t rows, int64_t k_len, uint32_t *rounded) {
    const int64_t pairs = (k_len + 1) / 2;
    for (int64_t m = 0; m < rows; m++) {
        const float *row = x + m * x_stride;
        for (int64_t k0 = 0; k0 < k_len; k0 += 32) {
            const int64_t left = k_len - k0;
            const __mmask16 low = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __mmask16 high = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            const __m512 a = _mm512_maskz_loadu_ps(low, row + k0), b = _mm512_maskz_loadu_ps(high, row + k0 + 16);
            const int64_t step_pairs = pairs - k0 / 2 < 16 ? pairs - k0 / 2 : 16;
            _mm512_mask_storeu_epi32(rounded + m * pairs + k0 / 2, (__mmask16)((1u << step_pairs) - 1),
                                     (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

/* The rounded rows' scratch, kept per thread between calls (a decode step makes ~40
 * products, each of a few rows): grown, never shrunk, never freed while the thread lives. */
static _Thread_local uint32_t *dot_scratch = NULL;
static _Thread_local size_t dot_scratch_bytes = 0;

static int dot_products(const float *x, int64_t x_stride, const uint16_t *w, int64_t panel_width, int64_t padded_k,
                        const float *bias, float *out, int64_t out_stride, int64_t rows, int64_t n_len,
                        int64_t k_len, int threads) {
    if (rows < 1 || k_len < 1 || x_stride < k_len) return -3; /* before sizing the scratch */
    const int64_t pairs = (k_len + 1) / 2;
    const size_t bytes = (size_t)(rows * pairs) * sizeof(uint32_t);
    if (bytes > dot_scratch_bytes) {
        const size_t grown = (bytes + 4095) & ~(size_t)4095;
        uint32_t *larger = aligned_alloc(64, grown);
        if (!larger) return -6;
        free(dot_scratch);
        dot_scratch = larger;
        dot_scratch_bytes = grown;
    }
    round_rows(x, x_stride, rows, k_len, dot_scratch);
    return run_panel_chunks(chunk_rows_dot, BF16_CHUNK, 2, threads, (const float *)(const void *)dot_scratch, 2 * pairs,
                            w, NULL, panel_width, padded_k, bias, out, out_stride, rows, n_len, k_len);
}
#endif

/* Whether bfloat16 panels take the dot-product kernel (bf16_switch's setting). */
static int bf16_dot = -1;

/* Asked with -1: whether bfloat16 products of 2 or more rows take the AVX512-BF16 dot
 * kernel (1) or widen to float32 (0); 0 or 1 sets it (bfloat16.h). */
int vlmd_packed_bf16_dot(int wanted) { return bf16_switch(&bf16_dot, wanted); }

/* As vlmd_packed_linear, for bfloat16 panels (w) and float32 rows and output. */
int vlmd_packed_linear_bf16(const float *x, int64_t x_stride, const uint16_t *w, int64_t panel_width,
                            int64_t padded_k, const float *bias, float *out, int64_t out_stride, int64_t rows,
                            int64_t n_len, int64_t k_len, int threads) {
#ifdef __AVX512F__
    /* One row streams the weights at the bytes' rate either way, and the widening reader was
     * the faster there (LLaVA small's decode step at batch 1: 4.8 against 5.45 ms). */
    if (rows >= 2 && (bf16_dot > 0 || (bf16_dot < 0 && vlmd_packed_bf16_dot(-1))))
        return dot_products(x, x_stride, w, panel_width, padded_k, bias, out, out_stride, rows, n_len, k_len,
                            threads);
#endif
    return run_panel_chunks(chunk_rows_bf16, BF16_CHUNK, 2, threads, x, x_stride, w, NULL, panel_width, padded_k,
                            bias, out, out_stride, rows, n_len, k_len);
}

/* 1 if `packed` holds the bfloat16 `plain` [N, K] in the paired panel layout above, else 0. */
LAYOUT_MATCHES(vlmd_packed_bf16_layout_matches, uint16_t, 2)

