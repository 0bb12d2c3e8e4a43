/* One whole decode step of a Llama-family model (float32, CPU) for a small batch, in one call.
 *
 * At batch 1 a step reads every weight once and does little else, so everything that is not
 * reading weights shows: per-op dispatch, temporaries, and threads falling asleep between ops.
 * Here every layer runs inside one OpenMP parallel region (torch's own thread pool: this library
 * binds to the libgomp torch loaded): the matrix-vector products split their rows over all
 * threads, the small ops run on one thread between two barriers, so both threads stay busy
 * reading weights for the whole step. Same arithmetic as the per-op native path: add + norm,
 * fused qkv, rotary + KV write, paged attention, o, add + norm, gate/up with SiLU, down.
 */
#include "cpu_kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Weights of one decoder layer (torch Linear layout [out][in]); biases may be NULL. A matmul whose
 * scale is not NULL has 8-bit weights (the model's weight_kind: int8 or fp8 e4m3) with that per-row
 * scale, else float32 weights. */
typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down,
        *down_bias;
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
} decode_layer_f32;

typedef struct {
    int64_t num_layers, hidden, inter, num_q_heads, num_kv_heads, head_dim, vocab;
    float eps, scale;
    const decode_layer_f32 *layers;
    const float *final_norm, *lm_head, *cos_sin;
    const float *lm_head_scale; /* as the layers' scales */
    int64_t weight_kind;        /* of the scaled weights: WEIGHTS_INT8 or WEIGHTS_FP8 */
} decode_model_f32;

enum { WEIGHTS_INT8 = 1, WEIGHTS_FP8 = 2 };

/* Rows [r0, r1) of y = W x (+ bias): float32 weights when `scale` is NULL, else the model's 8-bit kind. */
#define GEMV_ROWS(w, scale, bias, ...)                                                     \
    (!(scale) ? gemv_rows_f32(w, bias, __VA_ARGS__)                                        \
     : m->weight_kind == WEIGHTS_FP8 ? gemv_rows_fp8((const uint8_t *)(w), scale, bias, __VA_ARGS__) \
                                     : gemv_rows_i8((const int8_t *)(w), scale, bias, __VA_ARGS__))
#define GEMV_SILU_ROWS(w, scale, bias, ...)                                                     \
    (!(scale) ? gemv_silu_rows_f32(w, bias, __VA_ARGS__)                                        \
     : m->weight_kind == WEIGHTS_FP8 ? gemv_silu_rows_fp8((const uint8_t *)(w), scale, bias, __VA_ARGS__) \
                                     : gemv_silu_rows_i8((const int8_t *)(w), scale, bias, __VA_ARGS__))

/* Phases timed when the caller passes phase_seconds (seconds, accumulated; thread 0's clock, so a
 * phase also holds thread 0's wait for the others at its closing barrier). */
enum { PH_NORM, PH_QKV, PH_ATTENTION, PH_O, PH_GATE_UP_SILU, PH_DOWN, PH_LM_HEAD, PH_COUNT };

int64_t decode_step_phases(void) { return PH_COUNT; }

static inline double clock_now(void) {
#ifdef _OPENMP
    return omp_get_wtime();
#else
    return 0.0;
#endif
}

#define MARK(phase)                                           \
    if (timer) {                                              \
        const double now_ = clock_now();                      \
        phase_seconds[phase] += now_ - mark;                  \
        mark = now_;                                          \
    }

/* The rows [r0, r1) of work item c of a GEMV over n rows. */
#define CHUNK_ROWS(c, n) (c) * GEMV_CHUNK, ((c) + 1) * GEMV_CHUNK < (n) ? ((c) + 1) * GEMV_CHUNK : (n)
#define NUM_CHUNKS(n) (((n) + GEMV_CHUNK - 1) / GEMV_CHUNK)

/* normed[b] = rms_norm(res[b] + add[b]) * weight, with the sum also stored into res_out[b] when
 * res_out is not NULL. Every thread runs it on its own copy of the normed rows (no barrier to
 * share them); one thread stores the sum, into the other residual buffer, which no thread reads
 * until a GEMV's closing barrier has passed. */
static void residual_norm(const float *res, const float *add, float *res_out, const float *weight,
                          float *normed, int64_t batch, int64_t h, float eps) {
    for (int64_t b = 0; b < batch; b++) {
        const float *r = res + b * h, *a = add ? add + b * h : 0;
        float *o = normed + b * h, *keep = res_out ? res_out + b * h : 0;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < h; i++) {
            const float v = a ? r[i] + a[i] : r[i];
            o[i] = v;
            sq += v * v;
        }
        const float inv = 1.0f / sqrtf(sq / (float)h + eps);
        if (keep)
#pragma omp simd
            for (int64_t i = 0; i < h; i++) keep[i] = o[i];
#pragma omp simd
        for (int64_t i = 0; i < h; i++) o[i] = o[i] * inv * weight[i];
    }
}

/* Rotary embedding of one token's KV head kvh and its group of query heads, in place in the
 * fused qkv row, then that head's K and V written to the cache at slot (negative: not written).
 * Work items of distinct heads touch disjoint memory, so they need no barrier between them. */
static void rotary_write_kv_head(float *qkv_row, const float *cos_sin, int64_t position, void *kv,
                                 int64_t slot, int64_t hq, int64_t hkv, int64_t d, int64_t kvh,
                                 int64_t block_size, int64_t region_bytes, int fp8) {
    const int64_t half = d / 2, group = hq / hkv;
    const float *c = cos_sin + position * d, *s = c + half;
    for (int64_t i = 0; i <= group; i++) {
        const int64_t head = i < group ? kvh * group + i : hq + kvh; /* the group's q heads, then k */
        float *a = qkv_row + head * d, *b = a + half;
#pragma omp simd
        for (int64_t j = 0; j < half; j++) {
            const float lo = a[j], hi = b[j];
            a[j] = lo * c[j] - hi * s[j];
            b[j] = hi * c[j] + lo * s[j];
        }
    }
    if (slot < 0) return;
    if (region_bytes) { /* a quantized cache: K then V of this head, each with its scale */
        uint8_t *region = (uint8_t *)kv + (slot / block_size) * region_bytes;
        float *scales = (float *)(region + 2 * block_size * hkv * d);
        for (int64_t i = 0; i < 2; i++) {
            const int64_t at = (i * block_size + slot % block_size) * hkv + kvh;
            kv_q8_quantize_head(qkv_row + (hq + i * hkv + kvh) * d, d, fp8, region + at * d, scales + at);
        }
        return;
    }
    const int64_t row = hkv * d;
    float *k_dst = (float *)kv + (slot / block_size) * 2 * block_size * row + (slot % block_size) * row + kvh * d;
    memcpy(k_dst, qkv_row + (hq + kvh) * d, d * sizeof(float));
    memcpy(k_dst + block_size * row, qkv_row + (hq + hkv + kvh) * d, d * sizeof(float));
}

/* residual [batch][hidden]: the tokens' embeddings in, the last layer's residual stream out.
 * kv: the whole cache [layers][blocks][2][block_size][Hkv][D]; layer_stride floats per layer.
 * (decode_step_kvq8: a quantized cache, byte regions of region_bytes; layer_stride bytes per layer.)
 * work: scratch of decode_step_work_floats(...) floats. logits: [batch][vocab].
 * Positions, slots and block ids are trusted (checked once per step by the caller); a sequence
 * length outside [1, max_len] returns -1 before anything is written.
 *
 * Barriers: one closing each GEMV, the K/V write and the attention, none for the small ops (see above). */
static int decode_step(const decode_model_f32 *m, float *residual, int64_t batch, const int64_t *positions,
                       const int64_t *slot_mapping, void *kv, int64_t layer_stride, int64_t block_size,
                       int64_t region_bytes, int fp8, const int32_t *block_tables, int64_t table_stride,
                       const int32_t *seq_lens, int64_t max_len, float *logits, float *work,
                       int64_t num_threads, double *phase_seconds) {
    for (int64_t b = 0; b < batch; b++)
        if (seq_lens[b] < 1 || seq_lens[b] > max_len) return -1;
    const int64_t h = m->hidden, inter = m->inter, d = m->head_dim, hq = m->num_q_heads, hkv = m->num_kv_heads;
    const int64_t group = hq / hkv, q_width = hq * d, qkv_width = (hq + 2 * hkv) * d;
    /* two residual buffers taking turns (see residual_norm); the stream starts in `residual` */
    float *qkv = work, *attn = qkv + batch * qkv_width, *act = attn + batch * q_width, *out = act + batch * inter,
          *spare = out + batch * h, *per_thread = spare + batch * h;
    const int64_t per_thread_floats = batch * h + group * max_len;
    const int timed = phase_seconds != 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef _OPENMP
        const int thread = omp_get_thread_num();
#else
        const int thread = 0;
#endif
        float *normed = per_thread + thread * per_thread_floats, *scores = normed + batch * h;
        const int timer = timed && thread == 0;
        double mark = timer ? clock_now() : 0.0;
        float *res = residual, *res_next = spare;
#define NEXT_RESIDUAL(add, weight)                                                                  \
    {                                                                                               \
        residual_norm(res, add, thread == 0 ? res_next : 0, weight, normed, batch, h, m->eps);     \
        float *t_ = res;                                                                            \
        res = res_next;                                                                             \
        res_next = t_;                                                                              \
    }
        for (int64_t l = 0; l < m->num_layers; l++) {
            const decode_layer_f32 *w = &m->layers[l];
            void *layer_kv = region_bytes ? (void *)((uint8_t *)kv + l * layer_stride)
                                          : (void *)((float *)kv + l * layer_stride);
            if (l == 0)
                residual_norm(res, 0, 0, w->input_norm, normed, batch, h, m->eps);
            else
                NEXT_RESIDUAL(out, w->input_norm)
            MARK(PH_NORM)
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < NUM_CHUNKS(qkv_width); c++)
                GEMV_ROWS(w->qkv, w->qkv_scale, w->qkv_bias, h, normed, h, qkv, qkv_width, batch, CHUNK_ROWS(c, qkv_width));
            MARK(PH_QKV)
            /* every row's K/V is written before any row attends: rows of one sequence at consecutive
             * positions (a speculative verify step) see each other's keys */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < batch * hkv; item++) {
                const int64_t b = item / hkv, kvh = item % hkv;
                rotary_write_kv_head(qkv + b * qkv_width, m->cos_sin, positions[b], layer_kv, slot_mapping[b], hq,
                                     hkv, d, kvh, block_size, region_bytes, fp8);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < batch * hkv; item++) {
                const int64_t b = item / hkv, kvh = item % hkv;
                float *row = qkv + b * qkv_width;
                if (region_bytes)
                    decode_attention_head_q8(row + kvh * group * d, layer_kv, block_tables + b * table_stride,
                                             seq_lens[b], group, d, kvh, hkv, block_size, region_bytes, fp8,
                                             m->scale, scores, attn + b * q_width + kvh * group * d);
                else
                    decode_attention_head_f32(row + kvh * group * d, layer_kv, block_tables + b * table_stride,
                                              seq_lens[b], group, d, kvh, hkv, block_size, m->scale, scores,
                                              attn + b * q_width + kvh * group * d);
            }
            MARK(PH_ATTENTION)
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < NUM_CHUNKS(h); c++)
                GEMV_ROWS(w->o, w->o_scale, w->o_bias, q_width, attn, q_width, out, h, batch, CHUNK_ROWS(c, h));
            MARK(PH_O)
            NEXT_RESIDUAL(out, w->post_norm)
            MARK(PH_NORM)
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < NUM_CHUNKS(inter); c++)
                GEMV_SILU_ROWS(w->gate_up, w->gate_up_scale, w->gate_up_bias, h, inter, normed, act, batch, CHUNK_ROWS(c, inter));
            MARK(PH_GATE_UP_SILU)
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < NUM_CHUNKS(h); c++)
                GEMV_ROWS(w->down, w->down_scale, w->down_bias, inter, act, inter, out, h, batch, CHUNK_ROWS(c, h));
            MARK(PH_DOWN)
        }
        NEXT_RESIDUAL(out, m->final_norm)
#undef NEXT_RESIDUAL
        MARK(PH_NORM)
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < NUM_CHUNKS(m->vocab); c++)
            GEMV_ROWS(m->lm_head, m->lm_head_scale, 0, h, normed, h, logits, m->vocab, batch, CHUNK_ROWS(c, m->vocab));
        MARK(PH_LM_HEAD)
        /* the stream ends in `res` of thread 0; the caller's buffer holds it either way */
        if (thread == 0 && res != residual) memcpy(residual, res, batch * h * sizeof(float));
    }
    return 0;
}

int decode_step_f32(const decode_model_f32 *m, float *residual, int64_t batch, const int64_t *positions,
                    const int64_t *slot_mapping, float *kv, int64_t layer_stride, int64_t block_size,
                    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                    int64_t max_len, float *logits, float *work, int64_t num_threads,
                    double *phase_seconds) {
    return decode_step(m, residual, batch, positions, slot_mapping, kv, layer_stride, block_size, 0, 0,
                       block_tables, table_stride, seq_lens, max_len, logits, work, num_threads, phase_seconds);
}

/* decode_step_f32 over a quantized cache (head_dim <= 512, checked by the caller). */
int decode_step_kvq8(const decode_model_f32 *m, float *residual, int64_t batch, const int64_t *positions,
                     const int64_t *slot_mapping, uint8_t *kv, int64_t layer_stride, int64_t block_size,
                     int64_t region_bytes, int fp8, const int32_t *block_tables, int64_t table_stride,
                     const int32_t *seq_lens, int64_t max_len, float *logits, float *work, int64_t num_threads,
                     double *phase_seconds) {
    return decode_step(m, residual, batch, positions, slot_mapping, kv, layer_stride, block_size, region_bytes,
                       fp8, block_tables, table_stride, seq_lens, max_len, logits, work, num_threads,
                       phase_seconds);
}

/* Floats of scratch decode_step_f32 needs. */
int64_t decode_step_work_floats(const decode_model_f32 *m, int64_t batch, int64_t max_len, int64_t num_threads) {
    const int64_t h = m->hidden, qkv_width = (m->num_q_heads + 2 * m->num_kv_heads) * m->head_dim;
    return batch * (qkv_width + m->num_q_heads * m->head_dim + m->inter + 2 * h) +
           num_threads * (batch * h + (m->num_q_heads / m->num_kv_heads) * max_len);
}
