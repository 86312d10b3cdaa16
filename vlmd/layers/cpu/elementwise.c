/* A decoder layer's elementwise work in one pass each, float32: the residual add fused
 * with RMSNorm, an RMSNorm of each q and k head in place, rotary embedding of q and k in
 * place, and SiLU(gate) * up or GELU-tanh(gate) * up.
 *
 * Why: in torch these are ~30 small ops per layer (RMSNorm alone is cast, pow, mean, add,
 * rsqrt, mul, cast, mul; rotate-half is two slices, neg, cat, two muls and an add, for q
 * and for k). At a decode step's 1-8 rows each op costs its dispatch, not its arithmetic:
 * ~2.5 ms of the small LLaVA's 18 ms step at batch 8 (torch.profiler, AMD EPYC fam 25
 * model 17). At prefill's hundreds of rows each op is one more pass over memory.
 *
 * Rows are split over the team only when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "kernels.h"

#include "vector_exp.h"

#ifdef __AVX512F__
#define VEC 16
#else
#define VEC 8
#endif
typedef float vf __attribute__((vector_size(VEC * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VEC * 4), aligned(4)));

VECTOR_EXP_NONPOSITIVE(vexp, vf, vi)

/* Below this many floats a single thread beats waking the team. */
#define PARALLEL_FLOATS 65536

static inline float sum_lanes(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VEC; i++) s += v[i];
    return s;
}

/* h += d (when d is given); o = h / rms(h) * weight, over one row of `width` floats. Both
 * norms below run this one body, so a head's norm is bit for bit a row's of the same width. */
static inline void norm_row(float *h, const float *d, const float *weight, float *o, int64_t width, float eps) {
    vf acc = {0};
    int64_t c = 0;
    for (; c + VEC <= width; c += VEC) {
        vf x = *(vf *)(h + c);
        if (d) {
            x += *(const vf *)(d + c);
            *(vf *)(h + c) = x;
        }
        acc += x * x;
    }
    float squares = sum_lanes(acc);
    for (; c < width; c++) {
        float x = h[c];
        if (d) h[c] = x = x + d[c];
        squares += x * x;
    }
    float inverse = 1.0f / sqrtf(squares / (float)width + eps);
    for (c = 0; c + VEC <= width; c += VEC) *(vf *)(o + c) = *(vf *)(h + c) * inverse * *(const vf *)(weight + c);
    for (; c < width; c++) o[c] = h[c] * inverse * weight[c];
}

/* hidden[r] += delta[r] (when delta is given); out[r] = hidden[r] / rms(hidden[r]) * weight.
 * Strides are in floats. */
int vlmd_add_rms_norm(float *hidden, int64_t hidden_stride, const float *delta, int64_t delta_stride,
                      const float *weight, float *out, int64_t out_stride, int64_t rows, int64_t width, float eps,
                      int threads) {
    if (rows < 0 || width <= 0) return -3;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * width >= PARALLEL_FLOATS) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_row(hidden + r * hidden_stride, delta ? delta + r * delta_stride : 0, weight, out + r * out_stride,
                 width, eps);
    return 0;
}

/* RMSNorm in place of each of `heads` heads of size dim at x + r * row_stride + h * dim,
 * every head by the same weight [dim]: Qwen3's norm of each query (or key) head between
 * the q/k/v product and rotary, read straight from the product's rows (no copy of q or k). */
int vlmd_head_rms_norm(float *x, int64_t row_stride, int64_t heads, int64_t dim, const float *weight, float eps,
                       int64_t rows, int threads) {
    if (rows < 0 || heads < 0 || dim <= 0) return -3;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * heads * dim >= PARALLEL_FLOATS) \
    schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *head = x + r * row_stride + h * dim;
            norm_row(head, 0, weight, head, dim, eps);
        }
    return 0;
}

/* Rotate-half rotary embedding in place: x = x * cos + rotate_half(x) * sin for each of
 * `heads` heads of size dim at x + r * row_stride + h * dim, with cos/sin rows [rows, dim]
 * (one row per token: M-RoPE's sections are already merged into it). */
int vlmd_rotary(float *x, int64_t row_stride, int64_t heads, int64_t dim, const float *cos_table,
                const float *sin_table, int64_t table_stride, int64_t rows, int threads) {
    if (rows < 0 || dim <= 0 || dim % 2) return -3;
    int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * heads * dim >= PARALLEL_FLOATS) \
    schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *cos_row = cos_table + r * table_stride, *sin_row = sin_table + r * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *head = x + r * row_stride + h * dim;
            int64_t c = 0;
            for (; c + VEC <= half; c += VEC) {
                vf low = *(vf *)(head + c), high = *(vf *)(head + half + c);
                *(vf *)(head + c) = low * *(const vf *)(cos_row + c) - high * *(const vf *)(sin_row + c);
                *(vf *)(head + half + c) =
                    high * *(const vf *)(cos_row + half + c) + low * *(const vf *)(sin_row + half + c);
            }
            for (; c < half; c++) {
                float low = head[c], high = head[half + c];
                head[c] = low * cos_row[c] - high * sin_row[c];
                head[half + c] = high * cos_row[half + c] + low * sin_row[half + c];
            }
        }
    }
    return 0;
}

/* out[r] = act(gate_up[r][:width]) * gate_up[r][width:2 width] for the two gated activations
 * that are g * sigmoid(z(g)): SiLU (z = g) and GELU with the tanh approximation (z = 2 sqrt(2/pi)
 * (g + 0.044715 g^3), since 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation where tanh nears -1).
 * One body, so a fix to either is a fix to both. */
static int sigmoid_gated_mul(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride, int64_t rows,
                             int64_t width, int threads, int tanh_gelu) {
    if (rows < 0 || width <= 0) return -3;
    /* 2 sqrt(2/pi) and 2 sqrt(2/pi) * 0.044715 */
    const float slope = 1.5957691216057308f, cubic = 0.0713548162726009f;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * width >= PARALLEL_FLOATS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * in_stride, *up = gate + width;
        float *o = out + r * out_stride;
        int64_t c = 0;
        for (; c + VEC <= width; c += VEC) {
            vf g = *(const vf *)(gate + c);
            vf z = tanh_gelu ? g * (slope + cubic * g * g) : g;
            vi negative = z < 0.0f;
            vf magnitude = (vf)((vi)z & 0x7fffffff); /* |z|: the sign bit cleared */
            vf e = vexp(-magnitude);                 /* exp(-|z|), at most 1 */
            /* sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e) for z < 0 */
            vf one = (vf){0} + 1.0f;
            vf numerator = (vf)(((vi)e & negative) | ((vi)one & ~negative));
            *(vf *)(o + c) = g * (numerator / (1.0f + e)) * *(const vf *)(up + c);
        }
        for (; c < width; c++) {
            float g = gate[c], z = tanh_gelu ? g * (slope + cubic * g * g) : g;
            o[c] = g / (1.0f + expf(-z)) * up[c];
        }
    }
    return 0;
}

/* out[r] = silu(gate_up[r][:width]) * gate_up[r][width:2 width]. */
int vlmd_silu_mul(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride, int64_t rows,
                  int64_t width, int threads) {
    return sigmoid_gated_mul(gate_up, in_stride, out, out_stride, rows, width, threads, 0);
}

/* out[r] = gelu_tanh(gate_up[r][:width]) * gate_up[r][width:2 width] (torch's
 * gelu(approximate="tanh"), transformers' "gelu_pytorch_tanh": Gemma's MLP). */
int vlmd_gelu_tanh_mul(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride, int64_t rows,
                       int64_t width, int threads) {
    return sigmoid_gated_mul(gate_up, in_stride, out, out_stride, rows, width, threads, 1);
}

/* The same passes over bfloat16 rows (a `--dtype bfloat16` model's prefill), rounding where
 * torch's bfloat16 ops round, so each result is the torch path's but for the order of the
 * variance's sum: a value is widened exactly, computed in float32 and rounded to nearest
 * even (any NaN the quiet NaN 0x7fc0, as torch rounds).
 *
 * Why: in torch each of these is a chain of bfloat16 ops, each a pass over the rows that
 * widens, computes and rounds (RMSNorm: widen, square, mean, rsqrt, multiply, round,
 * multiply by the weight, round), so a bfloat16 prefill spent more on them than a float32
 * one, which takes the passes above. */
typedef uint16_t vh __attribute__((vector_size(VEC * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VEC * 4)));

static inline vf widen(const uint16_t *p) { return (vf)(__builtin_convertvector(*(const vh *)p, vu) << 16); }

static inline void narrow(uint16_t *p, vf value) {
    vu bits = (vu)value;
    vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    vu is_nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);
    *(vh *)p = __builtin_convertvector((rounded & ~is_nan) | (0x7fc0u & is_nan), vh);
}

/* value rounded to bfloat16, kept as the float32 it widens to. */
static inline vf round_to_bf16(vf value) {
    vu bits = (vu)value;
    vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    vu is_nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);
    return (vf)((rounded & ~is_nan) | (0x7fc00000u & is_nan));
}

static inline float widen1(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* As vlmd_add_rms_norm on bfloat16: hidden = bf16(hidden + delta); out = bf16(weight *
 * bf16(hidden * inverse rms)), torch's RMSNorm module in bfloat16 (vlmd/layers/norm.py). */
int vlmd_add_rms_norm_bf16(uint16_t *hidden, int64_t hidden_stride, const uint16_t *delta, int64_t delta_stride,
                           const uint16_t *weight, uint16_t *out, int64_t out_stride, int64_t rows, int64_t width,
                           float eps, int threads) {
    if (rows < 0 || width <= 0) return -3;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * width >= PARALLEL_FLOATS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *h = hidden + r * hidden_stride, *o = out + r * out_stride;
        const uint16_t *d = delta ? delta + r * delta_stride : 0;
        vf acc = {0};
        int64_t c = 0;
        for (; c + VEC <= width; c += VEC) {
            vf x = widen(h + c);
            if (d) {
                narrow(h + c, x + widen(d + c));
                x = widen(h + c);
            }
            acc += x * x;
        }
        float squares = sum_lanes(acc);
        for (; c < width; c++) {
            if (d) h[c] = bf16_from_float(widen1(h[c]) + widen1(d[c]));
            float x = widen1(h[c]);
            squares += x * x;
        }
        const float inverse = 1.0f / sqrtf(squares / (float)width + eps);
        for (c = 0; c + VEC <= width; c += VEC) {
            narrow(o + c, round_to_bf16(widen(h + c) * inverse) * widen(weight + c));
        }
        for (; c < width; c++) o[c] = bf16_from_float(widen1(bf16_from_float(widen1(h[c]) * inverse)) * widen1(weight[c]));
    }
    return 0;
}

/* As vlmd_rotary on bfloat16 rows and tables: torch's x * cos + cat(-x2, x1) * sin in
 * bfloat16, each product and the sum rounded (`rotary.py:apply_rotary`), in place. */
int vlmd_rotary_bf16(uint16_t *x, int64_t row_stride, int64_t heads, int64_t dim, const uint16_t *cos_table,
                     const uint16_t *sin_table, int64_t table_stride, int64_t rows, int threads) {
    if (rows < 0 || dim <= 0 || dim % 2) return -3;
    int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * heads * dim >= PARALLEL_FLOATS) \
    schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *cos_row = cos_table + r * table_stride, *sin_row = sin_table + r * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *head = x + r * row_stride + h * dim;
            int64_t c = 0;
            for (; c + VEC <= half; c += VEC) {
                vf low = widen(head + c), high = widen(head + half + c);
                narrow(head + c, round_to_bf16(low * widen(cos_row + c)) - round_to_bf16(high * widen(sin_row + c)));
                narrow(head + half + c, round_to_bf16(high * widen(cos_row + half + c)) +
                                            round_to_bf16(low * widen(sin_row + half + c)));
            }
            for (; c < half; c++) {
                float low = widen1(head[c]), high = widen1(head[half + c]);
                head[c] = bf16_from_float(widen1(bf16_from_float(low * widen1(cos_row[c]))) - widen1(bf16_from_float(high * widen1(sin_row[c]))));
                head[half + c] = bf16_from_float(widen1(bf16_from_float(high * widen1(cos_row[half + c]))) +
                                         widen1(bf16_from_float(low * widen1(sin_row[half + c]))));
            }
        }
    }
    return 0;
}

/* As vlmd_silu_mul on bfloat16: out = bf16(bf16(silu(gate)) * up), torch's F.silu(gate) * up. */
int vlmd_silu_mul_bf16(const uint16_t *gate_up, int64_t in_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                       int64_t width, int threads) {
    if (rows < 0 || width <= 0) return -3;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * width >= PARALLEL_FLOATS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * in_stride, *up = gate + width;
        uint16_t *o = out + r * out_stride;
        int64_t c = 0;
        for (; c + VEC <= width; c += VEC) {
            vf g = widen(gate + c);
            vi negative = g < 0.0f;
            vf magnitude = (vf)((vi)g & 0x7fffffff);
            vf e = vexp(-magnitude);
            vf one = (vf){0} + 1.0f;
            vf numerator = (vf)(((vi)e & negative) | ((vi)one & ~negative));
            narrow(o + c, round_to_bf16(g * (numerator / (1.0f + e))) * widen(up + c));
        }
        for (; c < width; c++) {
            float g = widen1(gate[c]);
            o[c] = bf16_from_float(widen1(bf16_from_float(g / (1.0f + expf(-g)))) * widen1(up[c]));
        }
    }
    return 0;
}
