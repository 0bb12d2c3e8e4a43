/* Native CPU kernels over a quantized KV cache (disagg.kernels.kv_quant): the rotary + KV write
 * that quantizes each token's K/V as it stores them, and the paged decode attention that reads
 * 8-bit values with their scales. Built with the other kernels by disagg.kernels.native_build.
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
        for (int64_t h = 0; h < num_q_heads + num_kv_heads; h++) {
            float *a = x + h * head_dim, *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float lo = a[i], hi = b[i];
                a[i] = lo * c[i] - hi * s[i];
                b[i] = hi * c[i] + lo * s[i];
            }
        }
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

/* e4m3 byte -> float with integer ops only (vectorizes, unlike a table lookup): a normal value's
 * exponent is rebiased from 7 to 127 and its 3 mantissa bits moved to the top of float's 23;
 * a subnormal (exponent field 0) is mantissa * 2^-9. */
static inline float e4m3_to_float(uint8_t b) {
    const uint32_t e = (b >> 3) & 15, m = b & 7, sign = (uint32_t)(b & 0x80) << 24;
    union { uint32_t u; float f; } normal = {.u = sign | ((e + 120) << 23) | (m << 20)};
    const float sub = (float)m * 0.001953125f;
    return e ? normal.f : (sign ? -sub : sub);
}

/* 8-bit row of D values as floats (int8 or e4m3), into a small buffer the loops below vectorize over. */
static inline void widen(const uint8_t *v, int64_t D, int fp8, float *out) {
    if (fp8) {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) out[d] = e4m3_to_float(v[d]);
    } else {
        const int8_t *s = (const int8_t *)v;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) out[d] = (float)s[d];
    }
}

/* Decode attention of one sequence and one KV head for its `group` query heads, over 8-bit K/V:
 * scores = scale * k_scale * (q . k), then softmax, then out = sum p * v_scale * v. Head dim D is a
 * macro argument so that the common sizes get fully unrolled loops (as decode_attention_head_f32). */
#define DEFINE_Q8_ATTENTION(NAME, D_EXPR)                                                            \
    static void NAME(const float *q, const uint8_t *cache, const int32_t *table, int64_t len,        \
                     int64_t group, int64_t head_dim, int64_t kv_head, int64_t num_kv_heads,         \
                     int64_t block_size, int64_t region_bytes, int fp8, float scale, float *scores,  \
                     float *out) {                                                                   \
        const int64_t D = (D_EXPR);                                                                 \
        const int64_t values_bytes = 2 * block_size * num_kv_heads * D;                             \
        float row[512]; /* one widened K or V row; D <= 512 is checked by the caller */             \
        (void)head_dim;                                                                             \
        for (int64_t j0 = 0, blk = 0; j0 < len; j0 += block_size, blk++) {                         \
            const uint8_t *region = cache + (int64_t)table[blk] * region_bytes;                     \
            const float *ks = (const float *)(region + values_bytes);                               \
            const int64_t n = len - j0 < block_size ? len - j0 : block_size;                        \
            for (int64_t t = 0; t < n; t++) {                                                       \
                const int64_t at = t * num_kv_heads + kv_head;                                      \
                widen(region + at * D, D, fp8, row);                                                \
                const float s = scale * ks[at];                                                     \
                for (int64_t g = 0; g < group; g++) {                                               \
                    const float *qg = q + g * D;                                                    \
                    float dot = 0.0f;                                                               \
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < D; d++)          \
                        dot += qg[d] * row[d];                                                      \
                    scores[g * len + j0 + t] = dot * s;                                             \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t g = 0; g < group; g++) {                                                       \
            softmax_in_place(scores + g * len, len);                                                \
            memset(out + g * D, 0, D * sizeof(float));                                              \
        }                                                                                           \
        for (int64_t j0 = 0, blk = 0; j0 < len; j0 += block_size, blk++) {                         \
            const uint8_t *region = cache + (int64_t)table[blk] * region_bytes;                     \
            const float *vs = (const float *)(region + values_bytes) + block_size * num_kv_heads;   \
            const int64_t n = len - j0 < block_size ? len - j0 : block_size;                        \
            for (int64_t t = 0; t < n; t++) {                                                       \
                const int64_t at = t * num_kv_heads + kv_head;                                      \
                widen(region + (block_size * num_kv_heads + at) * D, D, fp8, row);                  \
                for (int64_t g = 0; g < group; g++) {                                               \
                    const float p = scores[g * len + j0 + t] * vs[at];                              \
                    float *o = out + g * D;                                                         \
                    _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] += p * row[d];         \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }

DEFINE_Q8_ATTENTION(head_attention_q8_d64, 64)
DEFINE_Q8_ATTENTION(head_attention_q8_d128, 128)
DEFINE_Q8_ATTENTION(head_attention_q8_any, head_dim)

void decode_attention_head_q8(const float *q, const uint8_t *cache, const int32_t *table, int64_t len,
                              int64_t group, int64_t head_dim, int64_t kv_head, int64_t num_kv_heads,
                              int64_t block_size, int64_t region_bytes, int fp8, float scale, float *scores,
                              float *out) {
    if (head_dim == 64)
        head_attention_q8_d64(q, cache, table, len, group, head_dim, kv_head, num_kv_heads, block_size,
                              region_bytes, fp8, scale, scores, out);
    else if (head_dim == 128)
        head_attention_q8_d128(q, cache, table, len, group, head_dim, kv_head, num_kv_heads, block_size,
                               region_bytes, fp8, scale, scores, out);
    else
        head_attention_q8_any(q, cache, table, len, group, head_dim, kv_head, num_kv_heads, block_size,
                              region_bytes, fp8, scale, scores, out);
}

/* Paged decode attention of B sequences over a quantized cache; arguments as
 * paged_decode_attention_f32's, the cache given as bytes with its region size and value kind.
 * Returns 0, -1 for a sequence length outside [1, max_len], -2 for a head_dim over 512. */
int paged_decode_attention_q8(const float *q, int64_t q_row_stride, const uint8_t *cache,
                              const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                              float *out, int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t region_bytes, int fp8, float scale,
                              float *scratch, int64_t max_len, int64_t num_threads) {
    if (head_dim > 512) return -2;
    const int64_t group = num_q_heads / num_kv_heads;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1) reduction(| : bad)
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b];
        if (len < 1 || len > max_len) {
            bad = 1;
            continue;
        }
#ifdef _OPENMP
        float *scores = scratch + omp_get_thread_num() * group * max_len;
#else
        float *scores = scratch;
#endif
        const int32_t *table = block_tables + b * table_stride;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const float *qh = q + b * q_row_stride + h * group * head_dim;
            decode_attention_head_q8(qh, cache, table, len, group, head_dim, h, num_kv_heads, block_size, region_bytes,
                              fp8, scale, scores, out + (b * num_q_heads + h * group) * head_dim);
        }
    }
    return bad ? -1 : 0;
}
