/* A decode step of a pre-norm decoder (Llama's layer: RMSNorm, fused q/k/v product,
 * rotary, paged attention, output product, RMSNorm, fused gate/up product, SiLU * up,
 * down product; Qwen3's adds an RMSNorm of each q and k head before rotary; Gemma 3's
 * norms the attention's and the MLP's outputs before adding them, gates by GELU-tanh,
 * rotates its local and global layers by different tables and attends back a window in
 * its local layers, read through that window group's tables) through every layer in one
 * call, float32 activations.
 *
 * Why: a decode step's arithmetic is a few large kernel calls per layer, but each layer
 * also ran ~40 torch ops and ~15 module calls of Python around them: perf of the small
 * LLaVA decoding one request in one process put 15 % of both threads' samples in the
 * interpreter (~3 ms of an 11.5 ms step: per layer ~350 us that is neither a product nor
 * attention). Here the same kernels run in the same order on the same buffers, so the
 * results are the module path's bit for bit; only the Python between them is gone, and
 * the GIL is released once for the whole step instead of around every product.
 *
 * The kernels are the library's own functions (kernels.h), called directly: nothing here
 * duplicates them.
 *
 * Weights: each product's panels are float32, bfloat16 or weight-only int8 (one of the
 * three panel readers: packed_linear.c, quantized_linear.c); the rows, sums, norms and
 * activations are float32 whatever the weights are, so a bfloat16 or int8 model's step
 * needs no bfloat16 or int8 instructions and reads half or a quarter of the bytes. The
 * caches are float32 or bfloat16 (a bfloat16 model's): K and V are rounded to bfloat16 as
 * they are written, as torch rounds them (to nearest, ties to even).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"
#include "kernels.h"

enum { WEIGHT_FLOAT32 = 0, WEIGHT_BFLOAT16 = 1, WEIGHT_INT8 = 2 };
enum { CACHE_FLOAT32 = 0, CACHE_BFLOAT16 = 1 }; /* paged_decode.c's dtype codes */

/* One packed weight (a panel layout of packed_linear.c or quantized_linear.c), its bias
 * (or NULL) and, for int8, its per-column scales. */
typedef struct {
    const void *weight;
    int64_t panel_width, padded_k, out_features, in_features;
    const float *bias;
    const float *scale;
    int64_t format; /* WEIGHT_* */
} Product;

typedef struct {
    const float *input_norm, *post_norm;
    const float *query_norm, *key_norm; /* [head_dim] each, or NULL: a layer that norms no q/k head */
    /* [hidden] each, or NULL: a layer that adds its attention's and its MLP's outputs unnormed */
    const float *post_attention_norm, *post_feedforward_norm;
    Product qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_slots, kv_heads, head_dim] of cache_dtype */
    int64_t cache_dtype;     /* CACHE_* */
    int64_t window;          /* tokens attended back; 0: the whole context */
    int64_t rotary;          /* the step's rotary table for q and k */
} Layer;

enum { ACTIVATION_SILU = 0, ACTIVATION_GELU_TANH = 1 };

typedef struct vlmd_decoder {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, num_slots;
    float eps, scale;
    int64_t activation; /* ACTIVATION_* */
    const float *final_norm;
    const Layer *layers;
} Decoder;

/* The attention tables of one KV group (and window) as paged_decode.c reads them, and the
 * cache slot of each row's K/V there. */
typedef struct {
    const int64_t *slots;
    const int32_t *block_tables, *context_lens;
    int32_t max_blocks, num_groups;
    const int32_t *group_offsets, *group_members, *group_tokens;
} Tables;

/* This step's decodes: one row each. */
typedef struct vlmd_step {
    int64_t rows;
    const float *cos, *sin; /* table t's row r at (t * rotary_stride + r * table_stride), head_dim floats */
    int64_t table_stride, rotary_stride;
    int32_t block_size, threads;
    const Tables *tables;         /* the step's distinct table sets */
    const int32_t *layer_tables; /* [num_layers]: each layer's entry of tables */
} Step;

enum { STAGE_MEMORY = -1, STAGE_NORM = -2, STAGE_PRODUCT = -3, STAGE_ROTARY = -4, STAGE_ATTENTION = -5,
       STAGE_ACTIVATION = -6, STAGE_ARGUMENTS = -7 };

static int product(const Product *p, const float *x, int64_t rows, float *out, int threads) {
    switch (p->format) {
    case WEIGHT_FLOAT32:
        return vlmd_packed_linear(x, p->in_features, p->weight, p->panel_width, p->padded_k, p->bias, out,
                                  p->out_features, rows, p->out_features, p->in_features, threads);
    case WEIGHT_BFLOAT16:
        return vlmd_packed_linear_bf16(x, p->in_features, p->weight, p->panel_width, p->padded_k, p->bias, out,
                                       p->out_features, rows, p->out_features, p->in_features, threads);
    case WEIGHT_INT8:
        return vlmd_packed_linear_int8(x, p->in_features, p->weight, p->scale, p->panel_width, p->padded_k, p->bias,
                                       out, p->out_features, rows, p->out_features, p->in_features, threads);
    default:
        return -5;
    }
}

/* count floats into a cache row of the layer's dtype, at element offset `at`. */
static void write_cache(void *cache, int64_t dtype, int64_t at, const float *values, int64_t count) {
    if (dtype == CACHE_FLOAT32) {
        memcpy((float *)cache + at, values, sizeof(float) * count);
        return;
    }
    uint16_t *target = (uint16_t *)cache + at;
    for (int64_t i = 0; i < count; i++) target[i] = bf16_from_float(values[i]);
}

/* embeds [rows, hidden] -> out [rows, hidden], the final norm's output; every layer's K/V
 * written to its cache. 0, or the (negative) stage that failed. */
int vlmd_decoder_step(const Decoder *d, const Step *s, const float *embeds, float *out) {
    const int64_t rows = s->rows, hidden = d->hidden, threads = s->threads;
    const int64_t q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size, intermediate = d->intermediate;
    if (rows <= 0 || d->num_layers <= 0) return STAGE_ARGUMENTS;
    for (int64_t l = 0; l < d->num_layers; l++) {
        const Tables *tables = &s->tables[s->layer_tables[l]];
        for (int64_t r = 0; r < rows; r++)
            if (tables->slots[r] < 0 || tables->slots[r] >= d->num_slots) return STAGE_ARGUMENTS;
    }
    int code = 0;
    float *residual = malloc(sizeof(float) * rows * hidden), *normed = malloc(sizeof(float) * rows * hidden);
    float *delta = malloc(sizeof(float) * rows * hidden), *qkv = malloc(sizeof(float) * rows * qkv_width);
    float *queries = malloc(sizeof(float) * rows * q_size), *attended = malloc(sizeof(float) * rows * q_size);
    float *gate_up = malloc(sizeof(float) * rows * 2 * intermediate);
    float *activated = malloc(sizeof(float) * rows * intermediate);
    if (!residual || !normed || !delta || !qkv || !queries || !attended || !gate_up || !activated) {
        code = STAGE_MEMORY;
        goto done;
    }
    memcpy(residual, embeds, sizeof(float) * rows * hidden);
    for (int64_t l = 0; l < d->num_layers; l++) {
        const Layer *layer = &d->layers[l];
        const Tables *tables = &s->tables[s->layer_tables[l]];
        /* The first layer norms the embeddings; every later one adds the last MLP's output first. */
        if (vlmd_add_rms_norm(residual, hidden, l == 0 ? NULL : delta, hidden, layer->input_norm, normed, hidden,
                              rows, hidden, d->eps, threads)) { code = STAGE_NORM; goto done; }
        if (product(&layer->qkv, normed, rows, qkv, threads)) { code = STAGE_PRODUCT; goto done; }
        /* Qwen3's layer norms each q and each k head (its own weight for each) before rotary. */
        if (layer->query_norm && vlmd_head_rms_norm(qkv, qkv_width, d->heads, d->head_dim, layer->query_norm, d->eps,
                                                    rows, threads)) { code = STAGE_NORM; goto done; }
        if (layer->key_norm && vlmd_head_rms_norm(qkv + q_size, qkv_width, d->kv_heads, d->head_dim, layer->key_norm,
                                                  d->eps, rows, threads)) { code = STAGE_NORM; goto done; }
        /* q's and k's heads are adjacent in each row: one pass rotates both. */
        const int64_t table_at = layer->rotary * s->rotary_stride;
        if (vlmd_rotary(qkv, qkv_width, d->heads + d->kv_heads, d->head_dim, s->cos + table_at, s->sin + table_at,
                        s->table_stride, rows, threads)) { code = STAGE_ROTARY; goto done; }
        for (int64_t r = 0; r < rows; r++) {
            const float *row = qkv + r * qkv_width;
            write_cache(layer->k_cache, layer->cache_dtype, tables->slots[r] * kv_size, row + q_size, kv_size);
            write_cache(layer->v_cache, layer->cache_dtype, tables->slots[r] * kv_size, row + q_size + kv_size,
                        kv_size);
            memcpy(queries + r * q_size, row, sizeof(float) * q_size);
        }
        if (vlmd_paged_decode(queries, layer->k_cache, layer->v_cache, (int)layer->cache_dtype, tables->block_tables,
                              tables->context_lens, attended, (int)rows, (int)d->heads, (int)d->kv_heads,
                              (int)d->head_dim, s->block_size, tables->max_blocks, d->num_slots, tables->num_groups,
                              tables->group_offsets, tables->group_members, tables->group_tokens, d->scale,
                              (int)threads, 0, (int)layer->window)) { code = STAGE_ATTENTION; goto done; }
        if (product(&layer->o, attended, rows, delta, threads)) { code = STAGE_PRODUCT; goto done; }
        /* Gemma 3's layer norms the attention's output before the residual takes it (in place). */
        if (layer->post_attention_norm && vlmd_add_rms_norm(delta, hidden, NULL, hidden, layer->post_attention_norm,
                                                            delta, hidden, rows, hidden, d->eps, threads)) {
            code = STAGE_NORM;
            goto done;
        }
        if (vlmd_add_rms_norm(residual, hidden, delta, hidden, layer->post_norm, normed, hidden, rows, hidden,
                              d->eps, threads)) { code = STAGE_NORM; goto done; }
        if (product(&layer->gate_up, normed, rows, gate_up, threads)) { code = STAGE_PRODUCT; goto done; }
        if ((d->activation == ACTIVATION_GELU_TANH ? vlmd_gelu_tanh_mul : vlmd_silu_mul)(
                gate_up, 2 * intermediate, activated, intermediate, rows, intermediate, threads)) {
            code = STAGE_ACTIVATION;
            goto done;
        }
        if (product(&layer->down, activated, rows, delta, threads)) { code = STAGE_PRODUCT; goto done; }
        if (layer->post_feedforward_norm &&
            vlmd_add_rms_norm(delta, hidden, NULL, hidden, layer->post_feedforward_norm, delta, hidden, rows, hidden,
                              d->eps, threads)) { code = STAGE_NORM; goto done; }
    }
    if (vlmd_add_rms_norm(residual, hidden, delta, hidden, d->final_norm, out, hidden, rows, hidden, d->eps, threads))
        code = STAGE_NORM;
done:
    free(residual);
    free(normed);
    free(delta);
    free(qkv);
    free(queries);
    free(attended);
    free(gate_up);
    free(activated);
    return code;
}
