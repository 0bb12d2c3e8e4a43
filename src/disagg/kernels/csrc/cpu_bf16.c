/* Native CPU kernels of the bfloat16 path: weights, activations and the KV cache in bf16, every
 * sum in float32 inside, each result rounded to bf16 once (round to nearest even), as torch's own
 * bf16 kernels do. Built with the other native sources by disagg.kernels.native_build.
 *
 * The matrix-vector product (decode) is bound by reading the weight, which bf16 halves against
 * float32. With AVX-512 BF16 (`vdpbf16ps`: 32 bf16 products summed pairwise into 16 float32
 * lanes per instruction) the bf16 values are multiplied as they are; elsewhere (`*_portable`,
 * always built so that it is tested here too) they are widened to float32 in registers, which is
 * exact, and go through the float32 GEMM's register tiles.
 *
 * KV cache layout (one layer): kv[num_blocks][2][block_size][Hkv][D] bf16, K at index 0 of dim 1.
 */
#include "cpu_kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

int64_t bf16_dot_native(void) { return HAVE_BF16_DOT; }

/* ---- matrix-vector products: y[b][r] = W[r] . x[b] (+ bias[r]), W [N][K], x [B][K], y [B][N] ----
 * Rows are handed to threads as in cpu_gemv.c. With `vdpbf16ps` each thread walks its rows in
 * order (one sequential stream), up to four inputs share each row load, larger batches reuse the
 * row from L1 four inputs at a time. */

#if HAVE_BF16_DOT
/* sums[b] = w . x[b] for NB <= 4 inputs with `vdpbf16ps`, two accumulators per input (even and odd
 * 32-value steps); the K tail is a masked load, zeros past the end. */
static inline __attribute__((always_inline)) void dot_block_dp(const bf16 *w, int64_t k, const bf16 *x, int64_t xs,
                                                               float *sums, const int nb) {
    __m512 even[4], odd[4];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) even[b] = odd[b] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {
        gemv_prefetch_ahead(w + j);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + j), w1 = (__m512bh)_mm512_loadu_si512(w + j + 32);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) {
            even[b] = _mm512_dpbf16_ps(even[b], w0, (__m512bh)_mm512_loadu_si512(x + b * xs + j));
            odd[b] = _mm512_dpbf16_ps(odd[b], w1, (__m512bh)_mm512_loadu_si512(x + b * xs + j + 32));
        }
    }
    for (; j < k; j += 32) {
        const __mmask32 m = k - j >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (k - j)) - 1u);
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++)
            even[b] = _mm512_dpbf16_ps(even[b], w0, (__m512bh)_mm512_maskz_loadu_epi16(m, x + b * xs + j));
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(even[b], odd[b]));
}

#define DOT_BLOCK_NB(FN, w, k, x, xs, sums, nb)   \
    switch (nb) {                                 \
        case 1: FN(w, k, x, xs, sums, 1); break;  \
        case 2: FN(w, k, x, xs, sums, 2); break;  \
        case 3: FN(w, k, x, xs, sums, 3); break;  \
        default: FN(w, k, x, xs, sums, 4); break; \
    }

/* Rows [r0, r1) of y = W x (+ bias) (see gemv_rows_bf16 in cpu_kernels.h), with the entry point
 * NAME that splits all N rows over the threads. */
#define DEFINE_GEMV(NAME, DOT)                                                                                \
    static void NAME##_rows(const bf16 *w, const bf16 *bias, int64_t k, const bf16 *x, int64_t xs, bf16 *y,    \
                            float *y_f32, int64_t ys, int64_t batch, int64_t r0, int64_t r1) {                \
        for (int64_t r = r0; r < r1; r++) {                                                                   \
            const float add = bias ? bf16_widen(bias[r]) : 0.0f;                                              \
            for (int64_t b = 0; b < batch; b += 4) {                                                          \
                const int nb = batch - b < 4 ? (int)(batch - b) : 4;                                          \
                float sums[4];                                                                                \
                DOT_BLOCK_NB(DOT, w + r * k, k, x + b * xs, xs, sums, nb)                                     \
                for (int i = 0; i < nb; i++) {                                                                \
                    const bf16 v = bf16_narrow(sums[i] + add);                                                \
                    if (y_f32)                                                                                \
                        y_f32[(b + i) * ys + r] = bf16_widen(v);                                              \
                    else                                                                                      \
                        y[(b + i) * ys + r] = v;                                                              \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    void NAME(const bf16 *w, const bf16 *bias, const bf16 *x, bf16 *y, int64_t batch, int64_t n, int64_t k,   \
              int64_t num_threads) {                                                                          \
        PARALLEL_GEMV_CHUNKS(n, num_threads, r0, r1, NAME##_rows(w, bias, k, x, k, y, 0, n, batch, r0, r1))  \
    }

DEFINE_GEMV(gemv_bf16_dp, dot_block_dp)
#define GEMV_ROWS_BEST gemv_bf16_dp_rows
#endif

/* Rows [r0, r1) of y = W x (+ bias) widening to float32 (any CPU, exact): the float32 GEMM's
 * register tiles (gemv_tiled_rows_bf16, cpu_gemm.c) with weights and inputs widened in registers,
 * 32 rows by up to 8 inputs at a time. (One weight row at a time against up to four inputs ran
 * 1.2-2x slower than the tiles on an AVX2 CPU, 1-8 inputs.) */
static void gemv_bf16_portable_rows(const bf16 *w, const bf16 *bias, int64_t k, const bf16 *x, int64_t xs, bf16 *y,
                                    float *y_f32, int64_t ys, int64_t batch, int64_t r0, int64_t r1) {
    enum { ROWS = 32, INPUTS = 8 };
    float part[INPUTS * ROWS];
    for (int64_t r = r0; r < r1; r += ROWS) {
        const int64_t nr = r1 - r < ROWS ? r1 - r : ROWS;
        for (int64_t b = 0; b < batch; b += INPUTS) {
            const int64_t nb = batch - b < INPUTS ? batch - b : INPUTS;
            gemv_tiled_rows_bf16(w + r * k, k, x + b * xs, xs, part, ROWS, nb, 0, nr);
            for (int64_t i = 0; i < nb; i++)
                for (int64_t c = 0; c < nr; c++) {
                    const bf16 v = bf16_narrow(part[i * ROWS + c] + (bias ? bf16_widen(bias[r + c]) : 0.0f));
                    if (y_f32)
                        y_f32[(b + i) * ys + r + c] = bf16_widen(v);
                    else
                        y[(b + i) * ys + r + c] = v;
                }
        }
    }
}

void gemv_bf16_portable(const bf16 *w, const bf16 *bias, const bf16 *x, bf16 *y, int64_t batch, int64_t n, int64_t k,
                        int64_t num_threads) {
    PARALLEL_GEMV_CHUNKS(n, num_threads, r0, r1, gemv_bf16_portable_rows(w, bias, k, x, k, y, 0, n, batch, r0, r1))
}

#if !HAVE_BF16_DOT
#define GEMV_ROWS_BEST gemv_bf16_portable_rows
#endif

void gemv_bf16(const bf16 *w, const bf16 *bias, const bf16 *x, bf16 *y, int64_t batch, int64_t n, int64_t k,
               int64_t num_threads) {
#if HAVE_BF16_DOT
    gemv_bf16_dp(w, bias, x, y, batch, n, k, num_threads);
#else
    gemv_bf16_portable(w, bias, x, y, batch, n, k, num_threads);
#endif
}

void gemv_rows_bf16(const bf16 *w, const bf16 *bias, int64_t k, const bf16 *x, int64_t x_stride, bf16 *y,
                    float *y_f32, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1) {
    GEMV_ROWS_BEST(w, bias, k, x, x_stride, y, y_f32, y_stride, batch, r0, r1);
}

void gemv_silu_rows_bf16(const bf16 *w, const bf16 *bias, int64_t k, int64_t inter, const bf16 *x, bf16 *out,
                         int64_t batch, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += GEMV_CHUNK) {
        const int64_t n = i1 - i < GEMV_CHUNK ? i1 - i : GEMV_CHUNK;
        bf16 gate[batch * GEMV_CHUNK], up[batch * GEMV_CHUNK];
        GEMV_ROWS_BEST(w + i * k, bias ? bias + i : 0, k, x, k, gate, 0, GEMV_CHUNK, batch, 0, n);
        GEMV_ROWS_BEST(w + (inter + i) * k, bias ? bias + inter + i : 0, k, x, k, up, 0, GEMV_CHUNK, batch, 0, n);
        for (int64_t b = 0; b < batch; b++)
            for (int64_t t = 0; t < n; t++)
                out[b * inter + i + t] =
                    bf16_narrow(silu_mul(bf16_widen(gate[b * GEMV_CHUNK + t]), bf16_widen(up[b * GEMV_CHUNK + t])));
    }
}

/* ---- the small per-layer ops ---- */

/* out[t] = rms_norm(x[t] (+ residual[t])) * weight. With a residual, the sum is rounded to bf16
 * and stored back into it (the next layer's residual, as the torch path keeps it), and the norm
 * is taken of that rounded sum. */
void add_rms_norm_bf16(const bf16 *x, bf16 *residual, const bf16 *weight, bf16 *out, int64_t rows,
                       int64_t hidden, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        const bf16 *xt = x + t * hidden;
        const bf16 *src = xt;
        float sq = 0.0f;
        if (residual) {
            bf16 *r = residual + t * hidden;
#pragma omp simd reduction(+ : sq)
            for (int64_t i = 0; i < hidden; i++) {
                const bf16 sum = bf16_narrow(bf16_widen(r[i]) + bf16_widen(xt[i]));
                r[i] = sum;
                sq += bf16_widen(sum) * bf16_widen(sum);
            }
            src = r;
        } else {
#pragma omp simd reduction(+ : sq)
            for (int64_t i = 0; i < hidden; i++) sq += bf16_widen(xt[i]) * bf16_widen(xt[i]);
        }
        const float inv = 1.0f / sqrtf(sq / (float)hidden + eps);
        bf16 *o = out + t * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = bf16_narrow(bf16_widen(src[i]) * inv * bf16_widen(weight[i]));
    }
}

/* out[t] = silu(x[t, :inter]) * x[t, inter:] */
void silu_and_mul_bf16(const bf16 *x, bf16 *out, int64_t rows, int64_t inter) {
    for (int64_t t = 0; t < rows; t++) {
        const bf16 *gate = x + t * 2 * inter, *up = gate + inter;
        bf16 *o = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = bf16_narrow(silu_mul(bf16_widen(gate[i]), bf16_widen(up[i])));
    }
}

/* Rotary embedding (rotate-half form, float32 angles cos_sin [max_pos][D]) of q and k in place
 * inside the fused qkv rows [T][row_stride] bf16, then k and v copied into the cache at
 * slot_mapping[t] (negative: not written). */
void rotary_write_kv_bf16(bf16 *qkv, int64_t row_stride, const float *cos_sin, const int64_t *positions, bf16 *kv,
                          const int64_t *slot_mapping, int64_t tokens, int64_t num_q_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size) {
    const int64_t half = head_dim / 2, row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; t++) {
        bf16 *x = qkv + t * row_stride;
        const float *c = cos_sin + positions[t] * head_dim, *s = c + half;
        for (int64_t h = 0; h < num_q_heads + num_kv_heads; h++) rotary_head_bf16(x + h * head_dim, c, s, half);
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        bf16 *k_dst = kv + (slot / block_size) * 2 * block_size * row + (slot % block_size) * row;
        memcpy(k_dst, x + num_q_heads * head_dim, row * sizeof(bf16));
        memcpy(k_dst + block_size * row, x + (num_q_heads + num_kv_heads) * head_dim, row * sizeof(bf16));
    }
}

/* ---- 8-bit weights through the bf16 GEMM (quantized.scaled_linear_bf16) ----
 * The int8 weight widened to bf16 for torch's bf16 GEMM, and that GEMM's bf16 output scaled per
 * output column into float32: each one pass over its data, vectorised by the compiler, threads
 * over contiguous chunks. */

/* dst[i] = src[i] as bf16, exactly: an int8 value needs at most 8 significant bits, which bf16
 * has, so the top half of its float32 pattern is the value itself (no rounding). */
void i8_to_bf16(const int8_t *src, bf16 *dst, int64_t n, int64_t num_threads) {
    const int64_t chunk = 1 << 16, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        for (int64_t i = c * chunk; i < end; i++) {
            const float f = (float)src[i];
            uint32_t bits;
            memcpy(&bits, &f, sizeof bits);
            dst[i] = (bf16)(bits >> 16);
        }
    }
}

/* The same for float8_e4m3fn bytes: at most 4 significant bits, exact in bf16 too. */
void fp8_to_bf16(const uint8_t *src, bf16 *dst, int64_t n, int64_t num_threads) {
    const int64_t chunk = 1 << 16, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        for (int64_t i = c * chunk; i < end; i++) {
            const float f = fp8_e4m3_value(src[i]);
            uint32_t bits;
            memcpy(&bits, &f, sizeof bits);
            dst[i] = (bf16)(bits >> 16);
        }
    }
}

/* out[r][j] = y[r][j] * scale[j] (+ bias[j]) in float32, for y [m][n] bf16. */
void bf16_scale_cols(const bf16 *y, const float *scale, const float *bias, float *out, int64_t m, int64_t n,
                     int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && m * n > 65536)
    for (int64_t r = 0; r < m; r++) {
        const bf16 *yr = y + r * n;
        float *o = out + r * n;
        if (bias)
            for (int64_t j = 0; j < n; j++) o[j] = bf16_widen(yr[j]) * scale[j] + bias[j];
        else
            for (int64_t j = 0; j < n; j++) o[j] = bf16_widen(yr[j]) * scale[j];
    }
}
