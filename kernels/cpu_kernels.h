/* Shared by the native CPU kernel sources (cpu_kernels.c, cpu_gemv.c, cpu_gemv_int8.c,
 * cpu_decode_step.c), which are built into one shared object. */
#ifndef DISAGG_CPU_KERNELS_H
#define DISAGG_CPU_KERNELS_H

#include <stdint.h>

/* exp for the vectorized loops (a call to expf would keep them scalar): 2^n * e^r with
 * |r| <= ln2/2 and a degree-6 polynomial, relative error below 1e-6; x is clamped to [-87, 88]. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline float silu_mul(float gate, float up) { return gate / (1.0f + exp_approx(-gate)) * up; }

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                      int64_t hidden, float eps);
void rotary_write_kv_f32(float *qkv, int64_t row_stride, const float *cos_sin, const int64_t *positions,
                         float *kv, const int64_t *slot_mapping, int64_t tokens, int64_t num_q_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size);
/* Decode attention of one sequence and one KV head for its group of query heads (q: the group's
 * heads, contiguous; out: the same); scores holds group * len floats. */
void decode_attention_head_f32(const float *q, const float *kv, const int32_t *table, int64_t len,
                               int64_t group, int64_t head_dim, int64_t kv_head, int64_t num_kv_heads,
                               int64_t block_size, float scale, float *scores, float *out);

/* The same over one layer of a quantized cache (cpu_kv_quant.c: byte regions of 8-bit values, then
 * float32 scales; fp8 selects e4m3 values, else int8). D <= 512. */
void decode_attention_head_q8(const float *q, const uint8_t *cache, const int32_t *table, int64_t len,
                              int64_t group, int64_t head_dim, int64_t kv_head, int64_t num_kv_heads,
                              int64_t block_size, int64_t region_bytes, int fp8, float scale, float *scores,
                              float *out);
/* One head's D values quantized into dst (8-bit) with their scale, as the quantized cache stores them. */
void kv_q8_quantize_head(const float *x, int64_t head_dim, int fp8, uint8_t *dst, float *scale_out);

/* Weight rows handed out to a thread at a time: small enough that a late thread catches up on a
 * shared machine, large enough that taking one (an atomic increment) costs nothing next to
 * reading the rows. */
#define GEMV_CHUNK 32

/* From this many inputs (up to 6) the GEMV takes gemv_tiled_rows_f32 (cpu_gemm.c: tiles of 4
 * weight rows by up to 6 inputs in registers) instead of one weight row at a time: one row against
 * 2-4 inputs is bound by its loads, not by memory (measured here, one thread, a 92 MB weight: 1.5x
 * the time of one input at 2 and 3, 2.7x at 4; the tiles 1.1-1.25x). At one input the one-row
 * loop reads memory faster (0.9x the tiles). */
#define GEMV_TILED_MIN_BATCH 2
/* y[b * ys + r] = W[r] . x[b] for weight rows [r0, r1) and batch <= 6 inputs (xs apart). */
void gemv_tiled_rows_f32(const float *w, int64_t k, const float *x, int64_t xs, float *y, int64_t ys,
                         int64_t batch, int64_t r0, int64_t r1);

/* y[b][r] = W[r] . x[b] (+ bias[r]) for weight rows [r0, r1) of W [N][K] and `batch` inputs
 * x [batch][K] (rows x_stride apart; y rows y_stride apart). Called from inside a parallel region
 * by the thread that owns those rows. */
void gemv_rows_f32(const float *w, const float *bias, int64_t k, const float *x, int64_t x_stride,
                   float *y, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1);
/* For W = [gate; up] [2I][K]: out[b][i] = silu(gate_i . x[b] + bias) * (up_i . x[b] + bias) for
 * i in [i0, i1), each weight row read once. */
void gemv_silu_rows_f32(const float *w, const float *bias, int64_t k, int64_t inter, const float *x,
                        float *out, int64_t batch, int64_t i0, int64_t i1);
/* The same two for int8 weights with one float scale per row (W8A16): y = scale[r] * (W[r] . x). */
void gemv_rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t k, const float *x,
                  int64_t x_stride, float *y, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1);
void gemv_silu_rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t k, int64_t inter,
                       const float *x, float *out, int64_t batch, int64_t i0, int64_t i1);
/* ... and for fp8 (e4m3) weights, bytes with one float scale per row. */
void gemv_rows_fp8(const uint8_t *w, const float *scale, const float *bias, int64_t k, const float *x,
                   int64_t x_stride, float *y, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1);
void gemv_silu_rows_fp8(const uint8_t *w, const float *scale, const float *bias, int64_t k, int64_t inter,
                        const float *x, float *out, int64_t batch, int64_t i0, int64_t i1);

#endif
