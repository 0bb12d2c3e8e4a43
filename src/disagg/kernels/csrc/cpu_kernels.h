/* Shared by the native CPU kernel sources (cpu_kernels.c, cpu_gemv.c, cpu_decode_step.c, ...), which
 * are built into one shared object. */
#ifndef DISAGG_CPU_KERNELS_H
#define DISAGG_CPU_KERNELS_H

#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Floats in one vector register. GCC's generic vectors of this width are single registers; wider
 * ones are split on AVX2, and arrays of them (a GEMV's accumulators) went through the stack there:
 * the bf16 GEMV ran at 7 GB/s from cache on such a CPU with 16-float vectors. */
#if defined(__AVX512F__)
#define NATIVE_FLOATS 16
#else
#define NATIVE_FLOATS 8
#endif
typedef float vnat __attribute__((vector_size(NATIVE_FLOATS * 4)));
typedef float vnat_u __attribute__((vector_size(NATIVE_FLOATS * 4), aligned(4))); /* unaligned loads */

static inline vnat load_vnat(const float *p) { return *(const vnat_u *)p; }

static inline float hsum_vnat(vnat v) {
    float s = 0.0f;
#pragma GCC unroll 16
    for (int i = 0; i < NATIVE_FLOATS; i++) s += v[i];
    return s;
}

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

/* s[0..len) <- softmax(s), in place: the maximum subtracted, exp_approx, divided by the sum. */
static inline void softmax_in_place(float *s, int64_t len) {
    float m = s[0], sum = 0.0f;
    for (int64_t j = 1; j < len; j++) m = s[j] > m ? s[j] : m;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; j++) {
        s[j] = exp_approx(s[j] - m);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < len; j++) s[j] *= inv;
}

/* bfloat16 values as stored (the top half of a float32). */
typedef uint16_t bf16;

static inline float bf16_widen(bf16 h) {
    union { uint32_t i; float f; } u = {.i = (uint32_t)h << 16};
    return u.f;
}

/* One float8_e4m3fn byte's value: sign, 4 exponent bits of bias 7 (0: subnormal), 3 mantissa bits.
 * (0x7f / 0xff, e4m3fn's NaN, reads as 480: quantizers never write it.) */
static inline float fp8_e4m3_value(uint8_t v) {
    const int e = (v >> 3) & 15, m = v & 7;
    const float mag = e ? (1.0f + m / 8.0f) * (float)(1 << e) / 128.0f : m / 8.0f / 64.0f;
    return v & 0x80 ? -mag : mag;
}

/* Round to nearest even; a NaN stays a (quiet) NaN. */
static inline bf16 bf16_narrow(float f) {
    union { float f; uint32_t i; } u = {.f = f};
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (bf16)((u.i >> 16) | 0x40u);
    return (bf16)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

/* Rotary embedding (rotate-half form) of one float32 head of D = 2 half values in place, angles c
 * (cos) and s (sin). */
static inline void rotary_head_f32(float *head, const float *c, const float *s, int64_t half) {
    float *b = head + half;
#pragma omp simd
    for (int64_t j = 0; j < half; j++) {
        const float lo = head[j], hi = b[j];
        head[j] = lo * c[j] - hi * s[j];
        b[j] = hi * c[j] + lo * s[j];
    }
}

/* The same of one bf16 head, angles in float32; each rotated value rounded to bf16 once. */
static inline void rotary_head_bf16(bf16 *head, const float *c, const float *s, int64_t half) {
    bf16 *b = head + half;
#pragma omp simd
    for (int64_t j = 0; j < half; j++) {
        const float lo = bf16_widen(head[j]), hi = bf16_widen(b[j]);
        head[j] = bf16_narrow(lo * c[j] - hi * s[j]);
        b[j] = bf16_narrow(hi * c[j] + lo * s[j]);
    }
}

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                      int64_t hidden, float eps);
void rotary_write_kv_f32(float *qkv, int64_t row_stride, const float *cos_sin, const int64_t *positions,
                         float *kv, const int64_t *slot_mapping, int64_t tokens, int64_t num_q_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size);
/* One head's D values quantized into dst (8-bit) with their scale, as the quantized cache stores them. */
void kv_q8_quantize_head(const float *x, int64_t head_dim, int fp8, uint8_t *dst, float *scale_out);

/* Weight rows handed out to a thread at a time: small enough that a late thread catches up on a
 * shared machine, large enough that taking one (an atomic increment) costs nothing next to
 * reading the rows. */
#define GEMV_CHUNK 32

/* out[b * inter + i + t] = silu(gate + bias[i + t]) * (up + bias[inter + i + t]) for the n rows of
 * one chunk (t < n) of each of `batch` inputs, their sums GEMV_CHUNK apart in gate and up (the
 * bias added there in place). The bias gets a loop of its own: `bias ? bias[i] : 0` inside the
 * vectorised loop becomes masked loads from a null pointer, which no CPU faults on but an
 * emulator may (qemu 7.2: SIGSEGV). */
static inline void silu_mul_chunk(float *gate, float *up, const float *bias, int64_t inter, int64_t i, int64_t n,
                                  int64_t batch, float *out) {
    if (bias)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t t = 0; t < n; t++) {
                gate[b * GEMV_CHUNK + t] += bias[i + t];
                up[b * GEMV_CHUNK + t] += bias[inter + i + t];
            }
    for (int64_t b = 0; b < batch; b++)
        for (int64_t t = 0; t < n; t++)
            out[b * inter + i + t] = silu_mul(gate[b * GEMV_CHUNK + t], up[b * GEMV_CHUNK + t]);
}
/* How far ahead of its loads a GEMV's row walk asks for the weight: on weights served from a large
 * L3, the hardware prefetcher alone leaves the row walk waiting on its loads (bench/peers.py's
 * decode column shows it). A prefetch past the weight's end is a hint and never faults. */
#define GEMV_PREFETCH_BYTES 8192

/* The prefetch of one step of a GEMV's row walk, which reads up to 128 bytes of the weight from `p`
 * on: the 128 bytes GEMV_PREFETCH_BYTES past `p`. */
static inline __attribute__((always_inline)) void gemv_prefetch_ahead(const void *p) {
    __builtin_prefetch((const char *)p + GEMV_PREFETCH_BYTES);
    __builtin_prefetch((const char *)p + GEMV_PREFETCH_BYTES + 64);
}

/* Handing out a GEMV's chunks of rows inside a parallel region. Each thread owns a contiguous span
 * of chunks and takes them front to back, so that its reads are one sequential stream; a thread
 * done with its own span takes chunks from the back of the others', so that a thread the machine
 * delays is caught up on. (OpenMP's dynamic schedule interleaves the threads' chunks. Two threads
 * reading a 256 MiB bf16 weight here, the two schedules taken in turn for a minute: at moments when
 * the machine's memory is fast, 31-35 GB/s that way against 45-57 GB/s in contiguous spans; at the
 * others both 28-35 GB/s, the spans a few percent ahead.)
 * A span is one 64-bit word, generation | front | back (16 | 24 | 24 bits), changed by
 * compare-and-swap; the generation is the walk's number, so that whoever first meets a span left
 * from an earlier walk resets it. All threads start the same walks in the same order, with a
 * barrier between two walks (a span is only reset once every claim of the last walk is done). */
#define CHUNK_SPAN_STRIDE 8 /* uint64 words per span: one cache line each */

typedef struct {
    uint64_t *spans; /* threads * CHUNK_SPAN_STRIDE words, zeroed before the first walk */
    int64_t chunks;
    uint64_t generation; /* 1..65535 */
    int thread, threads, victim;
} chunk_walk;

static inline chunk_walk chunk_walk_start(uint64_t *spans, int64_t chunks, int thread, int threads,
                                          int64_t *walks_begun) {
    const uint64_t generation = (uint64_t)(*walks_begun % 65535) + 1;
    ++*walks_begun;
    return (chunk_walk){spans, chunks, generation, thread, threads, 0};
}

/* The next chunk this thread computes (its own span first, then the others'); 0 when none is left. */
static inline int chunk_walk_next(chunk_walk *walk, int64_t *chunk) {
    for (; walk->victim < walk->threads; walk->victim++) {
        const int t = (walk->thread + walk->victim) % walk->threads, from_back = walk->victim > 0;
        uint64_t *word = walk->spans + t * CHUNK_SPAN_STRIDE;
        uint64_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        for (;;) {
            uint64_t front = (seen >> 24) & 0xffffff, back = seen & 0xffffff;
            if (seen >> 48 != walk->generation) { /* left from an earlier walk: this walk's span of t */
                front = walk->chunks * t / walk->threads;
                back = walk->chunks * (t + 1) / walk->threads;
            }
            if (front >= back) break;
            const uint64_t taken = from_back ? back - 1 : front;
            const uint64_t next = walk->generation << 48 | (from_back ? front << 24 | (back - 1) : (front + 1) << 24 | back);
            if (__atomic_compare_exchange_n(word, &seen, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                *chunk = (int64_t)taken;
                return 1;
            }
        }
    }
    return 0;
}

/* A GEMV's chunks of GEMV_CHUNK rows over n rows, split by chunk_walk over num_threads threads in a
 * parallel region of its own: the statement after it runs for each chunk [r0, r1). */
#ifdef _OPENMP
#define WALK_THREAD omp_get_thread_num()
#define WALK_THREADS omp_get_num_threads()
#else
#define WALK_THREAD 0
#define WALK_THREADS 1
#endif
#define PARALLEL_GEMV_CHUNKS(n, num_threads, r0, r1, ...)                                                   \
    {                                                                                                       \
        uint64_t spans_[(num_threads) * CHUNK_SPAN_STRIDE];                                                 \
        memset(spans_, 0, sizeof spans_);                                                                   \
        _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1)") {                            \
            int64_t walks_ = 0, c_;                                                                         \
            chunk_walk walk_ =                                                                              \
                chunk_walk_start(spans_, ((n) + GEMV_CHUNK - 1) / GEMV_CHUNK, WALK_THREAD, WALK_THREADS, &walks_); \
            while (chunk_walk_next(&walk_, &c_)) {                                                          \
                const int64_t r0 = c_ * GEMV_CHUNK, r1 = r0 + GEMV_CHUNK < (n) ? r0 + GEMV_CHUNK : (n);     \
                __VA_ARGS__;                                                                                \
            }                                                                                               \
        }                                                                                                   \
    }

/* y[b * ys + r] = W[r] . x[b] for weight rows [r0, r1) and any number of inputs (xs apart), in the
 * float32 GEMM's own tiles of 4 weight rows by up to 6 inputs (gemm_f32 takes the same products
 * for the same rows); the GEMV's rows of two or more inputs (measured here, one thread, a 92 MB
 * weight: 1.1-1.25x the time of one input, where one row at a time took 1.5-2.7x). */
void gemv_tiled_rows_f32(const float *w, int64_t k, const float *x, int64_t xs, float *y, int64_t ys,
                         int64_t batch, int64_t r0, int64_t r1);

/* The same tiles for bf16 weights and inputs (widened in registers, float32 sums, y float32). */
void gemv_tiled_rows_bf16(const bf16 *w, int64_t k, const bf16 *x, int64_t xs, float *y, int64_t ys, int64_t batch,
                          int64_t r0, int64_t r1);

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

/* The bf16 kernels of the whole-step decode (cpu_bf16.c; sums in float32, each result rounded to
 * bf16 once, as the per-op bf16 kernels do). Rows [r0, r1) of y = W x (+ bias), stored as bf16 in
 * y, or (y_f32 not NULL) rounded to bf16 and stored widened in y_f32 (logits). */
void gemv_rows_bf16(const bf16 *w, const bf16 *bias, int64_t k, const bf16 *x, int64_t x_stride, bf16 *y,
                    float *y_f32, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1);
/* For W = [gate; up] [2I][K]: out[b][i] = silu(gate_i . x[b]) * (up_i . x[b]), each product rounded to
 * bf16 before the SiLU as the per-op path rounds its gate_up output. */
void gemv_silu_rows_bf16(const bf16 *w, const bf16 *bias, int64_t k, int64_t inter, const bf16 *x, bf16 *out,
                         int64_t batch, int64_t i0, int64_t i1);
/* The AMX bf16 GEMM in pieces, for a whole-step decode's own parallel region (cpu_amx.c): per
 * thread, amx_tiles_begin (-2: AMX not usable), then amx_pack_bf16 of the inputs into that thread's
 * scratch (amx_scratch_bytes(0, m_max, k_max)) and amx_rows_bf16 for its rows (y[i][r - r0], bf16, or
 * the bf16-rounded value widened into y_f32), then amx_tiles_end. */
int64_t amx_tiles_begin(void);
void amx_tiles_end(void);
int64_t amx_scratch_bytes(int64_t int8, int64_t m, int64_t k);
void amx_pack_bf16(const bf16 *x, int64_t m, int64_t k, void *scratch);
void amx_rows_bf16(const bf16 *w, const bf16 *bias, int64_t n, int64_t k, int64_t m, int64_t r0, int64_t r1,
                   bf16 *y, float *y_f32, int64_t y_stride, void *scratch, int64_t m_max, int64_t k_max);
/* The same for int8 weights and float32 inputs (gemm_i8_amx's W8A16 numbers, y float32; scratch
 * of amx_scratch_bytes(1, m_max, k_max)). */
void amx_pack_i8(const float *x, int64_t m, int64_t k, void *scratch, int64_t m_max, int64_t k_max);
void amx_rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t n, int64_t k, int64_t m, int64_t r0,
                 int64_t r1, float *y, int64_t y_stride, void *scratch, int64_t m_max, int64_t k_max);

#endif
