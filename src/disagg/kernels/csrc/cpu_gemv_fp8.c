/* Matrix-vector products with fp8 (e4m3, float8_e4m3fn) weights and float32 inputs: y[b][r] =
 * scale[r] * (W[r] . x[b]) (+ bias[r]), W [N][K] row-major bytes, one scale per row.
 *
 * An e4m3 byte (sign, 4 exponent bits of bias 7, 3 mantissa bits) moved into a float16's fields
 * (sign to bit 15, the other seven bits to bits 7-13) is a float16 of the same value times 2^-8
 * (float16's exponent bias is 15), subnormals included; so 16 weights become floats with a sign
 * extension, a shift, a mask and the hardware float16 conversion, and the 2^8 is folded into the
 * row's scale.
 * Rows are handed to threads as in cpu_gemv.c.
 */
#include "cpu_kernels.h"

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define FP8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FP8_AVX2 1 /* the same conversion, 8 weights at a time */
#endif

#define FP8_UNSCALE 256.0f /* 2^8: float16 field value -> e4m3 value */

/* One e4m3 byte as its float value / 256 (portable form of the vector conversion). */
static inline float fp8_scaled(uint8_t v) { return fp8_e4m3_value(v) / FP8_UNSCALE; }

#ifdef FP8_AVX512
static inline __m512 load16_fp8(const uint8_t *p) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                       _mm256_set1_epi16((short)0xBF80));
    return _mm512_cvtph_ps(h);
}
#endif
#ifdef FP8_AVX2
static inline __m256 load8_fp8(const uint8_t *p) {
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                                    _mm_set1_epi16((short)0xBF80));
    return _mm256_cvtph_ps(h);
}
#endif

/* y[b * ys] = scale * (w . x[b]) for one row and nb <= 4 inputs. */
static inline __attribute__((always_inline)) void gemv_block_fp8(const uint8_t *w, float scale, int64_t k,
                                                                 const float *x, int64_t xs, float *y, int64_t ys,
                                                                 const int nb) {
    int64_t j = 0;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef FP8_AVX512
    __m512 acc[4][2];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
    for (; j + 32 <= k; j += 32) {
        const __m512 w0 = load16_fp8(w + j), w1 = load16_fp8(w + j + 16);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) {
            acc[b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + b * xs + j), acc[b][0]);
            acc[b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + b * xs + j + 16), acc[b][1]);
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) s[b] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]));
#elif defined(FP8_AVX2)
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    for (; j + 16 <= k; j += 16) {
        const __m256 w0 = load8_fp8(w + j), w1 = load8_fp8(w + j + 8);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) {
            acc[b][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + b * xs + j), acc[b][0]);
            acc[b][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + b * xs + j + 8), acc[b][1]);
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc[b][0], acc[b][1]));
        for (int l = 0; l < 8; l++) s[b] += lanes[l];
    }
#endif
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        for (int64_t t = j; t < k; t++) s[b] += fp8_scaled(w[t]) * x[b * xs + t];
        y[b * ys] = s[b] * (scale * FP8_UNSCALE);
    }
}

static void rows_fp8(const uint8_t *w, const float *scale, int64_t k, const float *x, int64_t xs, float *y,
                     int64_t ys, int64_t batch, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < batch; b += 4) {
            const float *xb = x + b * xs;
            float *yb = y + b * ys + r;
            switch (batch - b < 4 ? (int)(batch - b) : 4) {
                case 1: gemv_block_fp8(w + r * k, scale[r], k, xb, xs, yb, ys, 1); break;
                case 2: gemv_block_fp8(w + r * k, scale[r], k, xb, xs, yb, ys, 2); break;
                case 3: gemv_block_fp8(w + r * k, scale[r], k, xb, xs, yb, ys, 3); break;
                default: gemv_block_fp8(w + r * k, scale[r], k, xb, xs, yb, ys, 4); break;
            }
        }
}

void gemv_rows_fp8(const uint8_t *w, const float *scale, const float *bias, int64_t k, const float *x,
                   int64_t x_stride, float *y, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1) {
    rows_fp8(w, scale, k, x, x_stride, y, y_stride, batch, r0, r1);
    if (bias)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t r = r0; r < r1; r++) y[b * y_stride + r] += bias[r];
}

void gemv_silu_rows_fp8(const uint8_t *w, const float *scale, const float *bias, int64_t k, int64_t inter,
                        const float *x, float *out, int64_t batch, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += GEMV_CHUNK) {
        const int64_t n = i1 - i < GEMV_CHUNK ? i1 - i : GEMV_CHUNK;
        float gate[batch * GEMV_CHUNK], up[batch * GEMV_CHUNK];
        rows_fp8(w + i * k, scale + i, k, x, k, gate, GEMV_CHUNK, batch, 0, n);
        rows_fp8(w + (inter + i) * k, scale + inter + i, k, x, k, up, GEMV_CHUNK, batch, 0, n);
        silu_mul_chunk(gate, up, bias, inter, i, n, batch, out);
    }
}

void gemv_fp8(const uint8_t *w, const float *scale, const float *bias, const float *x, float *y, int64_t batch,
              int64_t n, int64_t k, int64_t num_threads) {
    PARALLEL_GEMV_CHUNKS(n, num_threads, r0, r1, gemv_rows_fp8(w, scale, bias, k, x, k, y, n, batch, r0, r1))
}

/* out[i] = the float value of e4m3 byte w[i] (n of them), for products with many rows, where one
 * widening of the weight serves them all (torch's own e4m3 conversion is scalar and slow). */
void fp8_to_f32(const uint8_t *w, float *out, int64_t n, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && n >= (1 << 16))
    for (int64_t i0 = 0; i0 < n; i0 += 4096) {
        const int64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
        int64_t i = i0;
#ifdef FP8_AVX512
        const __m512 unscale = _mm512_set1_ps(FP8_UNSCALE);
        for (; i + 16 <= i1; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(load16_fp8(w + i), unscale));
#elif defined(FP8_AVX2)
        const __m256 unscale = _mm256_set1_ps(FP8_UNSCALE);
        for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(load8_fp8(w + i), unscale));
#endif
        for (; i < i1; i++) out[i] = fp8_scaled(w[i]) * FP8_UNSCALE;
    }
}
