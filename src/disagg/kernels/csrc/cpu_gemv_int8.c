/* Matrix-vector products with int8 weights and float32 inputs (W8A16 decode): y[b][r] =
 * scale[r] * (W[r] . x[b]) (+ bias[r]), W [N][K] int8 row-major, one symmetric scale per row.
 *
 * The same shape as cpu_gemv.c (each thread reads its rows in order, one row at a time: one
 * sequential stream), with a quarter of the bytes. At a quarter of the bytes, widening every
 * weight to float (sign extension, conversion, FMA: three instructions per 16 weights) bounds
 * the loop below the memory's speed on one core. With AVX-512 VNNI the inputs are instead
 * rounded once per call to int16 with one scale per input row (max|x| / 16383: a relative error
 * of 3e-5 of the row's largest value, far below bfloat16's 4e-3, so activations keep 16-bit
 * precision), and a row's dot product is integer: widen 32 weights to int16, one VPDPWSSD
 * (32 products summed pairwise into 16 int32 lanes). A lane sums K / 64 products of at most
 * 16383 * 127, exact in int32 for K up to 64 * 2^31 / (16383 * 127) ~ 66K; the lanes are added
 * as floats. With AVX2 (no AVX-512) the same rounded inputs meet the weights through VPMADDWD
 * (16 products summed pairwise into 8 lanes): the same integers, so the same result to the
 * rounding of the final float additions; the float path ran at 2.2 GB/s there (Zen 3, a quarter of
 * the float32 GEMV's speed: int8 decode was slower than float32). Elsewhere the float path is kept.
 * The scales (row and input) are applied once per output, after the dot product.
 */
#include "cpu_kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMV_I8_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define GEMV_I8_AVX2 1
#endif

#if defined(GEMV_I8_VNNI) || defined(GEMV_I8_AVX2)
#define X_MAX 16383.0f

/* xq[b][i] = round(x[b][i] / sx[b]), sx[b] = max|x[b]| / X_MAX (1 for an all-zero row). */
static void quantize_inputs(const float *x, int64_t xs, int64_t batch, int64_t k, int16_t *xq, float *sx) {
    for (int64_t b = 0; b < batch; b++) {
        const float *xb = x + b * xs;
        int16_t *qb = xq + b * k;
        int64_t i = 0;
#ifdef GEMV_I8_VNNI
        __m512 vmax = _mm512_setzero_ps();
        for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
        float amax = _mm512_reduce_max_ps(vmax);
#else
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 vmax = _mm256_setzero_ps();
        for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(abs_mask, _mm256_loadu_ps(xb + i)));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, vmax);
        for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
#endif
        for (; i < k; i++) amax = fmaxf(amax, fabsf(xb[i]));
        sx[b] = amax > 0.0f ? amax / X_MAX : 1.0f;
        const float inv = 1.0f / sx[b];
        i = 0;
#ifdef GEMV_I8_VNNI
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; i + 16 <= k; i += 16) /* round to nearest, then narrow (|value| <= X_MAX) */
            _mm256_storeu_si256((__m256i *)(qb + i),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vinv))));
#else
        const __m256 vinv = _mm256_set1_ps(inv);
        for (; i + 16 <= k; i += 16) { /* round to nearest, narrow in lane pairs, put the halves back in order */
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vinv));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vinv));
            _mm256_storeu_si256((__m256i *)(qb + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8));
        }
#endif
        for (; i < k; i++) qb[i] = (int16_t)lrintf(xb[i] * inv);
    }
}

#ifdef GEMV_I8_VNNI
/* y[b * ys] = scale * sx[b] * (w . xq[b]) for one int8 row and NB <= 4 inputs; four partial sums
 * per input keep VPDPWSSD's latency off the critical path. */
static inline __attribute__((always_inline)) void gemv_block_i8(const int8_t *w, float scale, int64_t k,
                                                                const int16_t *xq, const float *sx, float *y,
                                                                int64_t ys, const int nb) {
    __m512i acc[4][4];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = _mm512_setzero_si512();
    int64_t j = 0;
    for (; j + 128 <= k; j += 128) {
        gemv_prefetch_ahead(w + j);
        __m512i wv[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) wv[u] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + j + 32 * u)));
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++)
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++)
                acc[b][u] = _mm512_dpwssd_epi32(acc[b][u], wv[u], _mm512_loadu_si512(xq + b * k + j + 32 * u));
    }
    for (; j + 32 <= k; j += 32) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + j)));
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) acc[b][0] = _mm512_dpwssd_epi32(acc[b][0], wv, _mm512_loadu_si512(xq + b * k + j));
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        /* lanes summed as floats: the whole row's sum may pass int32's range, one lane does not */
        const __m512 lanes = _mm512_add_ps(_mm512_add_ps(_mm512_cvtepi32_ps(acc[b][0]), _mm512_cvtepi32_ps(acc[b][1])),
                                           _mm512_add_ps(_mm512_cvtepi32_ps(acc[b][2]), _mm512_cvtepi32_ps(acc[b][3])));
        int64_t tail = 0;
        for (int64_t t = j; t < k; t++) tail += (int32_t)w[t] * xq[b * k + t];
        y[b * ys] = (_mm512_reduce_add_ps(lanes) + (float)tail) * (scale * sx[b]);
    }
}

#else
/* The same with AVX2: VPMADDWD multiplies 16 int16 pairs and adds them in twos into 8 int32 lanes.
 * Two partial sums per input, 16 lanes, each summing 2 products per 32 weights: K / 16 products of
 * at most 16383 * 127 per lane, exact in int32 up to K = 16K. Longer rows are summed in blocks of
 * I8_K_BLOCK, each block's integers added as floats. */
#define I8_K_BLOCK 8192
/* Bytes ahead of the loads that are prefetched, one line per 64 weights (past a row's end: the
 * next row's, which follows it): the hardware prefetcher alone left the stream at 12.5-13.8 GB/s
 * on 2 threads (Zen 3), this at 14.7-16 (a standalone loop over 256 MiB, taken in turn). */
#define I8_PREFETCH 1024
static inline __attribute__((always_inline)) void gemv_block_i8(const int8_t *w, float scale, int64_t k,
                                                                const int16_t *xq, const float *sx, float *y,
                                                                int64_t ys, const int nb) {
    __m256 total[4];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) total[b] = _mm256_setzero_ps();
    int64_t j = 0;
    for (int64_t j0 = 0; j0 < k; j0 += I8_K_BLOCK) {
        const int64_t j1 = k - j0 < I8_K_BLOCK ? k : j0 + I8_K_BLOCK;
        __m256i acc[4][2];
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
        for (j = j0; j + 32 <= j1; j += 32) {
            if (!(j & 32)) _mm_prefetch((const char *)(w + j + I8_PREFETCH), _MM_HINT_T0);
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + j)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + j + 16)));
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++) {
                const int16_t *xb = xq + b * k + j;
                acc[b][0] = _mm256_add_epi32(acc[b][0], _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xb)));
                acc[b][1] = _mm256_add_epi32(acc[b][1], _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xb + 16))));
            }
        }
        if (j + 16 <= j1) { /* only in the last block: I8_K_BLOCK is a multiple of 32 */
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + j)));
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++)
                acc[b][0] = _mm256_add_epi32(acc[b][0], _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)(xq + b * k + j))));
            j += 16;
        }
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++)
            total[b] = _mm256_add_ps(total[b], _mm256_add_ps(_mm256_cvtepi32_ps(acc[b][0]), _mm256_cvtepi32_ps(acc[b][1])));
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        float lanes[8], sum = 0.0f;
        _mm256_storeu_ps(lanes, total[b]);
        for (int l = 0; l < 8; l++) sum += lanes[l];
        int64_t tail = 0;
        for (int64_t t = j; t < k; t++) tail += (int32_t)w[t] * xq[b * k + t];
        y[b * ys] = (sum + (float)tail) * (scale * sx[b]);
    }
}
#endif

#define GEMV_BLOCK_I8_NB(w, s, k, xq, sx, y, ys, nb)            \
    switch (nb) {                                               \
        case 1: gemv_block_i8(w, s, k, xq, sx, y, ys, 1); break; \
        case 2: gemv_block_i8(w, s, k, xq, sx, y, ys, 2); break; \
        case 3: gemv_block_i8(w, s, k, xq, sx, y, ys, 3); break; \
        default: gemv_block_i8(w, s, k, xq, sx, y, ys, 4); break; \
    }

/* The inputs as the row loop reads them: rounded to int16 once per call, with their scales. */
typedef struct {
    const int16_t *q;
    const float *scale;
} inputs_i8;

static int64_t inputs_bytes(int64_t batch, int64_t k) { return batch * k * 2 + batch * 4 + 64; }

/* `buf` holds inputs_bytes(batch, k). */
static inputs_i8 prepare_inputs(const float *x, int64_t xs, int64_t batch, int64_t k, void *buf) {
    int16_t *xq = (int16_t *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    float *sx = (float *)(xq + batch * k);
    quantize_inputs(x, xs, batch, k, xq, sx);
    return (inputs_i8){xq, sx};
}

/* Inputs passed over the rows at a time: each weight row is read from memory once per block and
 * from L1 for every four of its inputs, which stay in L2 (64 x K int16: 96 KiB at K = 768). */
#define I8_INPUT_BLOCK 64

static void rows_q(const int8_t *w, const float *scale, int64_t k, inputs_i8 in, float *y, int64_t ys,
                   int64_t batch, int64_t r0, int64_t r1) {
    for (int64_t b0 = 0; b0 < batch; b0 += I8_INPUT_BLOCK) {
        const int64_t b1 = batch - b0 < I8_INPUT_BLOCK ? batch : b0 + I8_INPUT_BLOCK;
        for (int64_t r = r0; r < r1; r++)
            for (int64_t b = b0; b < b1; b += 4) {
                const int nb = b1 - b < 4 ? (int)(b1 - b) : 4;
                GEMV_BLOCK_I8_NB(w + r * k, scale[r], k, in.q + b * k, in.scale + b, y + b * ys + r, ys, nb)
            }
    }
}

#else /* float path: widen each weight */

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int8_t v16i8u __attribute__((vector_size(16), aligned(1)));

static inline v16 load16f(const float *p) { return *(const v16u *)p; }
static inline v16 load16q(const int8_t *p) { return __builtin_convertvector(*(const v16i8u *)p, v16); }

static inline float hsum16(v16 v) {
    float s = 0.0f;
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* y[b * ys] = scale * (w . x[b]) for one int8 row of k weights and NB <= 4 inputs (constant at
 * each call site), four partial sums per input. */
static inline __attribute__((always_inline)) void gemv_block_i8(const int8_t *w, float scale, int64_t k,
                                                                const float *x, int64_t xs, float *y, int64_t ys,
                                                                const int nb) {
    v16 acc[4][4];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = (v16){0};
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {
        const v16 w0 = load16q(w + j), w1 = load16q(w + j + 16), w2 = load16q(w + j + 32),
                  w3 = load16q(w + j + 48);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) {
            const float *xb = x + b * xs + j;
            acc[b][0] += w0 * load16f(xb);
            acc[b][1] += w1 * load16f(xb + 16);
            acc[b][2] += w2 * load16f(xb + 32);
            acc[b][3] += w3 * load16f(xb + 48);
        }
    }
    for (; j + 16 <= k; j += 16) {
        const v16 w0 = load16q(w + j);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) acc[b][0] += w0 * load16f(x + b * xs + j);
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        float s = hsum16((acc[b][0] + acc[b][1]) + (acc[b][2] + acc[b][3]));
        for (int64_t t = j; t < k; t++) s += (float)w[t] * x[b * xs + t];
        y[b * ys] = s * scale;
    }
}

#define GEMV_BLOCK_I8_NB(w, s, k, x, xs, y, ys, nb)            \
    switch (nb) {                                              \
        case 1: gemv_block_i8(w, s, k, x, xs, y, ys, 1); break; \
        case 2: gemv_block_i8(w, s, k, x, xs, y, ys, 2); break; \
        case 3: gemv_block_i8(w, s, k, x, xs, y, ys, 3); break; \
        default: gemv_block_i8(w, s, k, x, xs, y, ys, 4); break; \
    }

typedef struct {
    const float *x;
    int64_t xs;
} inputs_i8;

static int64_t inputs_bytes(int64_t batch, int64_t k) { return 1; }

static inputs_i8 prepare_inputs(const float *x, int64_t xs, int64_t batch, int64_t k, void *buf) {
    return (inputs_i8){x, xs};
}

static void rows_q(const int8_t *w, const float *scale, int64_t k, inputs_i8 in, float *y, int64_t ys,
                   int64_t batch, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < batch; b += 4) {
            const int nb = batch - b < 4 ? (int)(batch - b) : 4;
            GEMV_BLOCK_I8_NB(w + r * k, scale[r], k, in.x + b * in.xs, in.xs, y + b * ys + r, ys, nb)
        }
}
#endif

static void add_bias(const float *bias, float *y, int64_t ys, int64_t batch, int64_t r0, int64_t r1) {
    if (bias)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t r = r0; r < r1; r++) y[b * ys + r] += bias[r];
}

static void silu_rows_q(const int8_t *w, const float *scale, const float *bias, int64_t k, int64_t inter,
                        inputs_i8 in, float *out, int64_t batch, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += GEMV_CHUNK) {
        const int64_t n = i1 - i < GEMV_CHUNK ? i1 - i : GEMV_CHUNK;
        float gate[batch * GEMV_CHUNK], up[batch * GEMV_CHUNK];
        rows_q(w + i * k, scale + i, k, in, gate, GEMV_CHUNK, batch, 0, n);
        rows_q(w + (inter + i) * k, scale + inter + i, k, in, up, GEMV_CHUNK, batch, 0, n);
        silu_mul_chunk(gate, up, bias, inter, i, n, batch, out);
    }
}

/* Called per chunk of rows inside the decode step (a few inputs): the inputs are prepared per
 * call, on the stack, about 1/GEMV_CHUNK of the weight loop's work. */
void gemv_rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t k, const float *x,
                  int64_t x_stride, float *y, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1) {
    char buf[inputs_bytes(batch, k)];
    rows_q(w, scale, k, prepare_inputs(x, x_stride, batch, k, buf), y, y_stride, batch, r0, r1);
    add_bias(bias, y, y_stride, batch, r0, r1);
}

void gemv_silu_rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t k, int64_t inter,
                       const float *x, float *out, int64_t batch, int64_t i0, int64_t i1) {
    char buf[inputs_bytes(batch, k)];
    silu_rows_q(w, scale, bias, k, inter, prepare_inputs(x, k, batch, k, buf), out, batch, i0, i1);
}

/* The whole product over num_threads threads, rows handed out GEMV_CHUNK at a time; the inputs
 * are prepared once, before the threads split the rows. Returns -1 when out of memory. */
int gemv_i8(const int8_t *w, const float *scale, const float *bias, const float *x, float *y, int64_t batch,
            int64_t n, int64_t k, int64_t num_threads) {
    void *buf = malloc(inputs_bytes(batch, k));
    if (!buf) return -1;
    const inputs_i8 in = prepare_inputs(x, k, batch, k, buf);
    PARALLEL_GEMV_CHUNKS(n, num_threads, r0, r1, rows_q(w, scale, k, in, y, n, batch, r0, r1);
                         add_bias(bias, y, n, batch, r0, r1))
    free(buf);
    return 0;
}

/* out [batch][inter] = silu(gate) * up for int8 W = [gate; up] [2 inter][k] with per-row scales. */
int gemv_silu_i8(const int8_t *w, const float *scale, const float *bias, const float *x, float *out,
                 int64_t batch, int64_t inter, int64_t k, int64_t num_threads) {
    void *buf = malloc(inputs_bytes(batch, k));
    if (!buf) return -1;
    const inputs_i8 in = prepare_inputs(x, k, batch, k, buf);
    PARALLEL_GEMV_CHUNKS(inter, num_threads, i0, i1, silu_rows_q(w, scale, bias, k, inter, in, out, batch, i0, i1))
    free(buf);
    return 0;
}
