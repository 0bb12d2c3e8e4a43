/* Native CPU kernels over a quantized KV cache (disagg.kernels.kv_quant): the rotary + KV write
 * that quantizes each token's K/V as it stores them (the paged decode attention that reads 8-bit
 * values with their scales: cpu_paged_attention.c). Built with the other kernels by
 * disagg.kernels.native_build.
 *
 * Cache layout (one layer): regions of `region_bytes` per block; a region holds the 8-bit
 * values [2][block_size][Hkv][D] (K at index 0), then float32 scales [2][block_size][Hkv].
 * `fp8` selects e4m3 values (else int8); value = stored * scale.
 */
#include "cpu_kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* e4m3fn byte nearest to y (|y| <= 448), ties to even: the grid step is 2^(E-3) at exponent E
 * (E >= -6; below, the subnormal step 2^-9). Dividing by a power of two is exact. */
static uint8_t e4m3_from(float y) {
    const uint8_t sign = signbit(y) ? 0x80 : 0;  /* -0 keeps its sign, as torch's cast */
    const float a = fabsf(y);
    int e;
    frexpf(a, &e);
    const int E = e - 1 < -6 ? -6 : e - 1;
    const float r = nearbyintf(ldexpf(a, 3 - E)) * ldexpf(1.0f, E - 3);
    if (r == 0.0f) return sign;
    frexpf(r, &e);
    if (e - 1 < -6) return sign | (uint8_t)ldexpf(r, 9);  /* subnormal: exponent field 0 */
    return sign | (uint8_t)(((e - 1 + 7) << 3) | (int)(ldexpf(r, 1 - e) * 8.0f - 8.0f));
}

/* Quantize one head's D values into dst with one scale (amax / qmax), as kv_quant.quantize. */
void kv_q8_quantize_head(const float *x, int64_t D, int fp8, uint8_t *dst, float *scale_out) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
    const float scale = fmaxf(amax, 1e-30f) / (fp8 ? 448.0f : 127.0f);
    *scale_out = scale;
    for (int64_t d = 0; d < D; d++) {
        float y = x[d] / scale;
        if (fp8) {
            y = fminf(fmaxf(y, -448.0f), 448.0f);
            dst[d] = e4m3_from(y);
        } else {
            y = fminf(fmaxf(nearbyintf(y), -127.0f), 127.0f);
            dst[d] = (uint8_t)(int8_t)y;
        }
    }
}

/* Rotary embedding (rotate-half form) of q and k in place inside the fused qkv rows
 * [T][row_stride] (q heads, k heads, v heads), then k and v quantized into the cache at
 * slot_mapping[t] (negative: not written). cos_sin: [max_pos][D], cos in the first D/2 columns. */
void rotary_write_kv_q8(float *qkv, int64_t row_stride, const float *cos_sin, const int64_t *positions,
                        uint8_t *cache, const int64_t *slot_mapping, int64_t tokens, int64_t num_q_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t region_bytes,
                        int fp8) {
    const int64_t half = head_dim / 2, values_bytes = 2 * block_size * num_kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; t++) {
        float *x = qkv + t * row_stride;
        const float *c = cos_sin + positions[t] * head_dim, *s = c + half;
        for (int64_t h = 0; h < num_q_heads + num_kv_heads; h++) rotary_head_f32(x + h * head_dim, c, s, half);
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        uint8_t *region = cache + (slot / block_size) * region_bytes;
        float *scales = (float *)(region + values_bytes);
        for (int64_t kv = 0; kv < 2; kv++)  /* K, then V */
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t at = (kv * block_size + slot % block_size) * num_kv_heads + h;
                kv_q8_quantize_head(x + (num_q_heads + kv * num_kv_heads + h) * head_dim, head_dim, fp8,
                              region + at * head_dim, scales + at);
            }
    }
}
