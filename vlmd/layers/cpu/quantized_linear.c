/* A few rows times a weight-only int8 weight: out = (x @ Q.T) * scale + bias, float32.
 *
 * Q [N, K] int8 holds round(W / scale) per output channel (symmetric, |q| <= 127,
 * scale[n] = max_k |W[n, k]| / 127), quantized once at load time from the float32
 * checkpoint (layers/linear/quantize.py). Stored as the float32 panels are
 * (packed_linear.c): panels of B output columns, K-major, element (n, k) at
 * ((n / B) * K + k) * B + n % B, so each K step of a tile reads B contiguous bytes.
 *
 * Why: a decode step reads every weight once, so its time is the weights' bytes over
 * memory bandwidth; int8 is a quarter of float32's bytes. Each K step widens the panel
 * row's int8 values to float32 (vpmovsxbd + vcvtdq2ps at 8 lanes on AVX2, 16 on
 * AVX-512F; element by element on other variants), multiplies by the row's float32 x and sums in float32;
 * the column's scale is applied once, on the sum. The rows stay float32, so no VNNI
 * (int8 x int8 dot products) is used: that would need the activations quantized too,
 * an error this weight-only format does not take. Exact apart from float32 summation:
 * every q * x product is exact in float32 (8-bit times 24-bit significands).
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "panels.h"

/* VEC int8 values widened to float32: sign extension and conversion in two instructions
 * where the variant has them (GCC's __builtin_convertvector scalarised this). */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf widen(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vf widen(const int8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline vf widen(const int8_t *p) {
    vf out;
    for (int i = 0; i < VEC; i++) out[i] = (float)p[i];
    return out;
}
#endif

/* As packed_linear.c's tile_1: the panel rows this many K steps on are asked for ahead
 * (a K step is B bytes here, a quarter of float32's). */
#define INT8_PREFETCH_STEPS 256

#define TILE_INT8(ROWS)                                                                                       \
    static void tile_int8_##ROWS(const float *x, int64_t x_stride, const int8_t *panel, int64_t panel_width,   \
                                 int64_t k_len, vf acc[ROW_BLOCK][CHUNK_VECTORS]) {                           \
        vf a[ROWS][CHUNK_VECTORS];                                                                            \
        for (int m = 0; m < ROWS; m++)                                                                        \
            for (int j = 0; j < CHUNK_VECTORS; j++) a[m][j] = (vf){0};                                        \
        for (int64_t k = 0; k < k_len; k++) {                                                                 \
            const int8_t *row = panel + k * panel_width;                                                      \
            if (ROWS == 1) __builtin_prefetch(row + INT8_PREFETCH_STEPS * panel_width, 0, 1);                 \
            vf w[CHUNK_VECTORS];                                                                              \
            for (int j = 0; j < CHUNK_VECTORS; j++) w[j] = widen(row + j * VEC);                              \
            for (int m = 0; m < ROWS; m++) {                                                                  \
                const float s = x[m * x_stride + k];                                                          \
                for (int j = 0; j < CHUNK_VECTORS; j++) a[m][j] += s * w[j];                                  \
            }                                                                                                 \
        }                                                                                                     \
        for (int m = 0; m < ROWS; m++)                                                                        \
            for (int j = 0; j < CHUNK_VECTORS; j++) acc[m][j] = a[m][j];                                      \
    }

typedef void (*TileInt8)(const float *, int64_t, const int8_t *, int64_t, int64_t, vf[ROW_BLOCK][CHUNK_VECTORS]);
TILE_INT8(1)
TILE_INT8(2)
#if ROW_BLOCK > 2
TILE_INT8(3)
TILE_INT8(4)
TILE_INT8(5)
TILE_INT8(6)
static const TileInt8 TILES_INT8[ROW_BLOCK + 1] = {0, tile_int8_1, tile_int8_2, tile_int8_3, tile_int8_4,
                                                   tile_int8_5, tile_int8_6};
#else
static const TileInt8 TILES_INT8[ROW_BLOCK + 1] = {0, tile_int8_1, tile_int8_2};
#endif

/* Columns [chunk * CHUNK, +CHUNK) of every row, each sum times its column's scale, plus the bias. */
static void chunk_rows_int8(const float *x, int64_t x_stride, const void *weights, const float *scale,
                            int64_t panel_width, int64_t padded_k, const float *bias, float *out, int64_t out_stride,
                            int64_t rows, int64_t n_len, int64_t k_len, int64_t chunk) {
    const int8_t *w = weights;
    const int64_t n0 = chunk * CHUNK;
    const int8_t *panel = w + (n0 / panel_width) * padded_k * panel_width + n0 % panel_width;
    const int64_t width = n_len - n0 < CHUNK ? n_len - n0 : CHUNK;
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        const int block = rows - m0 < ROW_BLOCK ? (int)(rows - m0) : ROW_BLOCK;
        vf acc[ROW_BLOCK][CHUNK_VECTORS];
        TILES_INT8[block](x + m0 * x_stride, x_stride, panel, panel_width, k_len, acc);
        for (int m = 0; m < block; m++) {
            float sums[CHUNK];
            for (int j = 0; j < CHUNK_VECTORS; j++) memcpy(sums + j * VEC, &acc[m][j], sizeof(vf));
            float *target = out + (m0 + m) * out_stride + n0;
            for (int64_t i = 0; i < width; i++)
                target[i] = bias ? sums[i] * scale[n0 + i] + bias[n0 + i] : sums[i] * scale[n0 + i];
        }
    }
}

/* The columns one tile computes: panels are built at a multiple of it. */
int vlmd_packed_linear_int8_chunk(void) { return CHUNK; }

/* As vlmd_packed_linear, for int8 panels (w, K-major, padded_k >= K) and their per-column
 * float32 scales [N]. 0, or an error of run_panel_chunks (-4: no scales). */
int vlmd_packed_linear_int8(const float *x, int64_t x_stride, const int8_t *w, const float *scale,
                            int64_t panel_width, int64_t padded_k, const float *bias, float *out, int64_t out_stride,
                            int64_t rows, int64_t n_len, int64_t k_len, int threads) {
    if (!scale) return -4;
    return run_panel_chunks(chunk_rows_int8, CHUNK, 1, threads, x, x_stride, w, scale, panel_width, padded_k,
                            bias, out, out_stride, rows, n_len, k_len);
}
