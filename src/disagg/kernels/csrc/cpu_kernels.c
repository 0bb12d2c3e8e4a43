/* Native CPU kernels of the float32 path, built on first use by disagg.kernels.native_build and
 * called through ctypes.
 *
 * Each replaces several torch ops of a decoder layer whose cost at small batches is dispatch and
 * temporaries rather than arithmetic, or (decode attention) a gather that moves three times the
 * bytes the computation needs.
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
        float *k_dst = kv + (slot / block_size) * 2 * block_size * row + (slot % block_size) * row;
        memcpy(k_dst, x + num_q_heads * head_dim, row * sizeof(float));
        memcpy(k_dst + block_size * row, x + (num_q_heads + num_kv_heads) * head_dim, row * sizeof(float));
    }
}

/* Decode attention of one sequence and one KV head, for the `group` query heads sharing it.
 * Head dim D is a macro argument so that the common sizes get fully unrolled dot products.
 * Pass 1 writes scale * q.k into scores[g][j], pass 2 turns them into softmax numerators,
 * pass 3 accumulates them against V; each cached row is read once per pass. */
#define DEFINE_HEAD_ATTENTION(NAME, D_EXPR)                                                          \
    static void NAME(const float *q, const float *kv, const int32_t *table, int64_t len,            \
                     int64_t group, int64_t head_dim, int64_t kv_head, int64_t num_kv_heads,         \
                     int64_t block_size, float scale, float *scores, float *out) {                   \
        const int64_t D = (D_EXPR);                                                                 \
        const int64_t row = num_kv_heads * D, kv_block = 2 * block_size * row;                     \
        (void)head_dim;                                                                             \
        for (int64_t j0 = 0, blk = 0; j0 < len; j0 += block_size, blk++) {                         \
            const float *k = kv + (int64_t)table[blk] * kv_block + kv_head * D;                     \
            const int64_t n = len - j0 < block_size ? len - j0 : block_size;                        \
            for (int64_t t = 0; t < n; t++, k += row)                                               \
                for (int64_t g = 0; g < group; g++) {                                               \
                    const float *qg = q + g * D;                                                    \
                    float dot = 0.0f;                                                               \
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < D; d++)          \
                        dot += qg[d] * k[d];                                                        \
                    scores[g * len + j0 + t] = dot * scale;                                         \
                }                                                                                   \
        }                                                                                           \
        for (int64_t g = 0; g < group; g++) {                                                       \
            softmax_in_place(scores + g * len, len);                                                \
            float *o = out + g * D;                                                                 \
            _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] = 0.0f;                        \
        }                                                                                           \
        for (int64_t j0 = 0, blk = 0; j0 < len; j0 += block_size, blk++) {                         \
            const float *v = kv + (int64_t)table[blk] * kv_block + block_size * row + kv_head * D;  \
            const int64_t n = len - j0 < block_size ? len - j0 : block_size;                        \
            for (int64_t t = 0; t < n; t++, v += row)                                               \
                for (int64_t g = 0; g < group; g++) {                                               \
                    const float p = scores[g * len + j0 + t];                                       \
                    float *o = out + g * D;                                                         \
                    _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] += p * v[d];           \
                }                                                                                   \
        }                                                                                           \
    }

DEFINE_HEAD_ATTENTION(head_attention_d64_portable, 64)
DEFINE_HEAD_ATTENTION(head_attention_d128_portable, 128)
DEFINE_HEAD_ATTENTION(head_attention_any, head_dim)

static void head_attention_d64(const float *q, const float *kv, const int32_t *table, int64_t len, int64_t group,
                               int64_t head_dim, int64_t kv_head, int64_t hkv, int64_t bs, float scale, float *scores,
                               float *out) {
#if HAVE_ATTENTION_AVX512
    if (group <= 8) return head_attention_avx512(q, kv, 0, table, len, group, 64, kv_head, hkv, bs, scale, scores, out);
#endif
    head_attention_d64_portable(q, kv, table, len, group, head_dim, kv_head, hkv, bs, scale, scores, out);
}

static void head_attention_d128(const float *q, const float *kv, const int32_t *table, int64_t len, int64_t group,
                                int64_t head_dim, int64_t kv_head, int64_t hkv, int64_t bs, float scale,
                                float *scores, float *out) {
#if HAVE_ATTENTION_AVX512
    if (group <= 8) return head_attention_avx512(q, kv, 0, table, len, group, 128, kv_head, hkv, bs, scale, scores, out);
#endif
    head_attention_d128_portable(q, kv, table, len, group, head_dim, kv_head, hkv, bs, scale, scores, out);
}

void decode_attention_head_f32(const float *q, const float *kv, const int32_t *table, int64_t len,
                               int64_t group, int64_t head_dim, int64_t kv_head, int64_t num_kv_heads,
                               int64_t block_size, float scale, float *scores, float *out) {
    if (head_dim == 64)
        head_attention_d64(q, kv, table, len, group, head_dim, kv_head, num_kv_heads, block_size, scale,
                           scores, out);
    else if (head_dim == 128)
        head_attention_d128(q, kv, table, len, group, head_dim, kv_head, num_kv_heads, block_size, scale,
                            scores, out);
    else
        head_attention_any(q, kv, table, len, group, head_dim, kv_head, num_kv_heads, block_size, scale,
                           scores, out);
}

/* Paged decode attention of the B sequences, each query reading its own cached K/V.
 * q: B rows of Hq * D floats, q_row_stride apart (a slice of the fused qkv output); out: [B][Hq][D].
 * block_tables: [B][table_stride] int32. seq_lens: [B] int32.
 * `scratch` holds num_threads * (Hq / Hkv) * max_len floats. Sequences are spread over
 * num_threads OpenMP threads: torch's own pool, as this library binds to the libgomp torch has
 * loaded, so its threads are already awake and nothing is oversubscribed.
 * Returns 0, or -1 for a sequence length outside [1, max_len]. */
int paged_decode_attention_f32(const float *q, int64_t q_row_stride, const float *kv,
                               const int32_t *block_tables, int64_t table_stride,
                               const int32_t *seq_lens, float *out, int64_t batch, int64_t num_q_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                               float *scratch, int64_t max_len, int64_t num_threads) {
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
            const int64_t first = (b * num_q_heads + h * group) * head_dim;
            decode_attention_head_f32(qh, kv, table, len, group, head_dim, h, num_kv_heads, block_size,
                                      scale, scores, out + first);
        }
    }
    return bad ? -1 : 0;
}
