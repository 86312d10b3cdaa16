/* Every function of the kernel library that Python binds, declared once.
 *
 * VLMD_KERNELS(X) expands X(return type, name, (parameters)) per function. Each .c file
 * includes this header, so the compiler checks each definition against its line here;
 * signatures.c exports the same lines as text (vlmd_kernel_signatures), from which the
 * Python side (library.py) builds every ctypes signature when it loads the library. So a
 * signature is written here and in its definition, and nowhere else: a parameter added
 * to a definition and not here fails the build; one added here is bound as declared.
 *
 * Parameter types the binding reads: any pointer, int, int32_t, int64_t, float.
 */
#ifndef VLMD_KERNELS_H
#define VLMD_KERNELS_H
#include <stdint.h>

struct vlmd_decoder; /* decoder_step.c */
struct vlmd_step;

#define VLMD_KERNELS(X)                                                                                           \
    /* packed_linear.c */                                                                                         \
    X(int, vlmd_packed_linear_chunk, (void))                                                                      \
    X(int, vlmd_packed_linear,                                                                                    \
      (const float *x, int64_t x_stride, const float *w, int64_t panel_width, int64_t padded_k, const float *bias, \
       float *out, int64_t out_stride, int64_t rows, int64_t n_len, int64_t k_len, int threads))                  \
    X(int, vlmd_packed_layout_matches,                                                                            \
      (const uint32_t *plain, const uint32_t *packed, int64_t n_len, int64_t k_len, int64_t panel_width,          \
       int64_t padded_k, int threads))                                                                            \
    X(int, vlmd_packed_linear_bf16_chunk, (void))                                                                 \
    X(int, vlmd_packed_linear_bf16,                                                                               \
      (const float *x, int64_t x_stride, const uint16_t *w, int64_t panel_width, int64_t padded_k,                \
       const float *bias, float *out, int64_t out_stride, int64_t rows, int64_t n_len, int64_t k_len,             \
       int threads))                                                                                              \
    X(int, vlmd_packed_bf16_layout_matches,                                                                       \
      (const uint16_t *plain, const uint16_t *packed, int64_t n_len, int64_t k_len, int64_t panel_width,          \
       int64_t padded_k, int threads))                                                                            \
    X(int, vlmd_packed_bf16_dot, (int wanted))                                                                    \
    /* quantized_linear.c */                                                                                      \
    X(int, vlmd_packed_linear_int8_chunk, (void))                                                                 \
    X(int, vlmd_packed_linear_int8,                                                                               \
      (const float *x, int64_t x_stride, const int8_t *w, const float *scale, int64_t panel_width,                \
       int64_t padded_k, const float *bias, float *out, int64_t out_stride, int64_t rows, int64_t n_len,          \
       int64_t k_len, int threads))                                                                               \
    /* paged_decode.c */                                                                                          \
    X(int, vlmd_paged_decode,                                                                                     \
      (const float *q, const void *k_cache, const void *v_cache, int dtype, const int32_t *block_tables,          \
       const int32_t *context_lens, float *out, int batch, int heads, int kv_heads, int dim, int block_size,      \
       int max_blocks, int64_t num_slots, int num_groups, const int32_t *group_offsets,                          \
       const int32_t *group_members, const int32_t *group_tokens, float scale, int num_threads,                  \
       int part_tokens, int window))                                                                              \
    X(int, vlmd_paged_decode_limit, (int which))                                                                  \
    X(int, vlmd_paged_decode_bf16_dot, (int wanted))                                                              \
    /* paged_prefill.c */                                                                                         \
    X(int, vlmd_paged_prefill,                                                                                    \
      (const float *q, int64_t q_stride, const float *k_cache, const float *v_cache, const int32_t *table,        \
       int num_table_blocks, int64_t num_slots, int block_size, int start, int n, int heads, int kv_heads,       \
       int dim, float scale, int causal, float *out, int64_t out_stride, int threads))                           \
    X(int, vlmd_paged_prefill_bf16,                                                                               \
      (const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,  \
       int num_table_blocks, int64_t num_slots, int block_size, int start, int n, int heads, int kv_heads,       \
       int dim, float scale, int causal, float *out, int64_t out_stride, int threads))                           \
    X(int, vlmd_paged_prefill_serves, (int dim))                                                                  \
    /* flash_bf16.c */                                                                                            \
    X(int, vlmd_flash_bf16,                                                                                       \
      (const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,                     \
       const int32_t *table, int num_table_blocks, int64_t num_slots, int block_size, int start, int n,           \
       int heads, int kv_heads, int dim, float scale, int causal, uint16_t *out, int64_t out_stride,              \
       int threads))                                                                                              \
    X(int, vlmd_flash_bf16_serves, (int dim))                                                                     \
    /* elementwise.c */                                                                                           \
    X(int, vlmd_add_rms_norm,                                                                                     \
      (float *hidden, int64_t hidden_stride, const float *delta, int64_t delta_stride, const float *weight,       \
       float *out, int64_t out_stride, int64_t rows, int64_t width, float eps, int threads))                      \
    X(int, vlmd_head_rms_norm,                                                                                    \
      (float *x, int64_t row_stride, int64_t heads, int64_t dim, const float *weight, float eps, int64_t rows,    \
       int threads))                                                                                              \
    X(int, vlmd_rotary,                                                                                           \
      (float *x, int64_t row_stride, int64_t heads, int64_t dim, const float *cos_table, const float *sin_table,  \
       int64_t table_stride, int64_t rows, int threads))                                                          \
    X(int, vlmd_silu_mul,                                                                                         \
      (const float *gate_up, int64_t in_stride, float *out, int64_t out_stride, int64_t rows, int64_t width,      \
       int threads))                                                                                              \
    X(int, vlmd_add_rms_norm_bf16,                                                                                \
      (uint16_t *hidden, int64_t hidden_stride, const uint16_t *delta, int64_t delta_stride,                      \
       const uint16_t *weight, uint16_t *out, int64_t out_stride, int64_t rows, int64_t width, float eps,         \
       int threads))                                                                                              \
    X(int, vlmd_rotary_bf16,                                                                                      \
      (uint16_t *x, int64_t row_stride, int64_t heads, int64_t dim, const uint16_t *cos_table,                    \
       const uint16_t *sin_table, int64_t table_stride, int64_t rows, int threads))                               \
    X(int, vlmd_silu_mul_bf16,                                                                                    \
      (const uint16_t *gate_up, int64_t in_stride, uint16_t *out, int64_t out_stride, int64_t rows,               \
       int64_t width, int threads))                                                                               \
    X(int, vlmd_gelu_tanh_mul,                                                                                    \
      (const float *gate_up, int64_t in_stride, float *out, int64_t out_stride, int64_t rows, int64_t width,      \
       int threads))                                                                                              \
    /* decoder_step.c */                                                                                          \
    X(int, vlmd_decoder_step,                                                                                     \
      (const struct vlmd_decoder *d, const struct vlmd_step *s, const float *embeds, float *out))

#define VLMD_DECLARE(RETURN, NAME, PARAMETERS) RETURN NAME PARAMETERS;
VLMD_KERNELS(VLMD_DECLARE)
#undef VLMD_DECLARE

#endif
