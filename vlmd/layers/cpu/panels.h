/* What the panel readers share (packed_linear.c: float32 and bfloat16 panels;
 * quantized_linear.c: int8 panels): the vector width each variant builds at, the columns
 * one tile computes, and the work-stealing loop over a product's column chunks, which
 * packed_linear.c defines once. Not bound from Python (kernels.h lists what is). */
#ifndef VLMD_PANELS_H
#define VLMD_PANELS_H
#include <stdint.h>

#ifdef __AVX512F__
#define VEC 16
#define ROW_BLOCK 6 /* 6 x 4 accumulators + 4 weight vectors + 1 broadcast of 32 registers */
#else
#define VEC 8
#define ROW_BLOCK 2 /* 16 registers */
#endif
#define CHUNK_VECTORS 4
#define CHUNK (CHUNK_VECTORS * VEC) /* columns one tile computes */

typedef float vf __attribute__((vector_size(VEC * 4), aligned(4)));

/* One chunk of columns of every row: (x, x_stride, weights, per-column scale or NULL,
 * panel_width, padded_k, bias, out, out_stride, rows, n_len, k_len, chunk). */
typedef void (*ChunkRows)(const float *, int64_t, const void *, const float *, int64_t, int64_t, const float *,
                          float *, int64_t, int64_t, int64_t, int64_t, int64_t);

/* Every chunk of a product through ``rows_of``; shared by the library's sources and not
 * exported from it (hidden). 0, or -1: a panel width that is not a
 * positive multiple of the chunk, -2: padded_k < k_len (or not a multiple of k_pairing),
 * -3: a size or stride out of range. */
__attribute__((visibility("hidden"))) int run_panel_chunks(ChunkRows rows_of, int64_t chunk_width,
                                                          int64_t k_pairing, int threads, const float *x,
                                                          int64_t x_stride, const void *w, const float *scale,
                                                          int64_t panel_width, int64_t padded_k, const float *bias,
                                                          float *out, int64_t out_stride, int64_t rows,
                                                          int64_t n_len, int64_t k_len);
#endif
