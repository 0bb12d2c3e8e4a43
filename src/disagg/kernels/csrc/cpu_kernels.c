/* Native CPU kernels of the float32 path, built on first use by disagg.kernels.native_build and
 * called through ctypes: add + RMSNorm, SiLU x mul, rotary + KV write.
 *
 * Each replaces several torch ops of a decoder layer whose cost at small batches is dispatch and
 * temporaries rather than arithmetic. (Decode attention, in torch a gather that moves three times
 * the bytes the computation needs: cpu_paged_attention.c.)
 *
 * KV cache layout (one layer): kv[num_blocks][2][block_size][Hkv][D], K at index 0 of dim 1.
 */
#include "cpu_kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* out[t] = rms_norm(x[t] (+ residual[t])) * weight, for rows of `hidden` floats. With a
 * residual, the sum is also stored back into it (the next layer's residual). */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                      int64_t hidden, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * hidden;
        float *src = (float *)xt;
        if (residual) {
            src = residual + t * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++) src[i] += xt[i];
        }
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < hidden; i++) sq += src[i] * src[i];
        const float inv = 1.0f / sqrtf(sq / (float)hidden + eps);
        float *o = out + t * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = src[i] * inv * weight[i];
    }
}

/* out[t] = silu(x[t, :inter]) * x[t, inter:] */
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t inter) {
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = x + t * 2 * inter, *up = gate + inter;
        float *o = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
    }
}

/* Rotary embedding (rotate-half form) of q and k in place inside the fused qkv rows
 * [T][row_stride] (q heads, then k heads, then v heads), then k and v written to the cache at
 * slot_mapping[t] (negative: not written). cos_sin: [max_pos][D], cos in the first D/2 columns. */
void rotary_write_kv_f32(float *qkv, int64_t row_stride, const float *cos_sin, const int64_t *positions,
                         float *kv, const int64_t *slot_mapping, int64_t tokens, int64_t num_q_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t half = head_dim / 2, row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; t++) {
        float *x = qkv + t * row_stride;
        const float *c = cos_sin + positions[t] * head_dim, *s = c + half;
        for (int64_t h = 0; h < num_q_heads + num_kv_heads; h++) rotary_head_f32(x + h * head_dim, c, s, half);
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        float *k_dst = kv + (slot / block_size) * 2 * block_size * row + (slot % block_size) * row;
        memcpy(k_dst, x + num_q_heads * head_dim, row * sizeof(float));
        memcpy(k_dst + block_size * row, x + (num_q_heads + num_kv_heads) * head_dim, row * sizeof(float));
    }
}
