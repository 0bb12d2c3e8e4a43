/* One whole decode step of a Llama-family model (float32 or bfloat16, CPU) for a small batch, in one call.
 *
 * At batch 1 a step reads every weight once and does little else, so everything that is not
 * reading weights shows: per-op dispatch, temporaries, and threads falling asleep between ops.
 * Here every layer runs inside one OpenMP parallel region (torch's own thread pool: this library
 * binds to the libgomp torch loaded): the matrix-vector products split their rows over all
 * threads (each a contiguous span, see chunk_walk), the small ops run on one thread between two
 * barriers, so both threads stay busy reading weights for the whole step. Same arithmetic as the per-op native path: add + norm,
 * fused qkv, rotary + KV write, paged attention, o, add + norm, gate/up with SiLU, down. A bf16
 * model's step keeps its activations, residual stream and cache in bf16, rounding where the per-op
 * bf16 kernels round (cpu_bf16.c), so either path gives the same result.
 */
#include "cpu_kernels.h"
#include "paged_attention.h"

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Weights of one decoder layer (torch Linear layout [out][in]); biases may be NULL. A matmul whose
 * scale is not NULL has 8-bit weights (the model's weight_kind: int8 or fp8 e4m3) with that per-row
 * scale, else float32 weights; a bf16 model (weight_kind WEIGHTS_BF16) has every tensor in bf16. */
typedef struct {
    const void *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
} decode_layer;

typedef struct {
    int64_t num_layers, hidden, inter, num_q_heads, num_kv_heads, head_dim, vocab;
    float eps, scale;
    const decode_layer *layers;
    const void *final_norm, *lm_head;
    const float *cos_sin;       /* float32 in every model */
    const float *lm_head_scale; /* as the layers' scales */
    int64_t weight_kind;        /* WEIGHTS_BF16 (the whole model), else that of the scaled weights */
    int64_t amx_min_batch;      /* bf16 or int8 matmuls on AMX tiles from this many rows (0: never) */
} decode_model;

int64_t amx_usable(void);

enum { WEIGHTS_INT8 = 1, WEIGHTS_FP8 = 2, WEIGHTS_BF16 = 3 };

/* Rows [r0, r1) of y = W x (+ bias): bf16 for a bf16 model (y_f32: logits, see gemv_rows_bf16), else
 * float32 weights when `scale` is NULL, else the model's 8-bit kind. */
static inline void gemv_rows(const decode_model *m, const void *w, const float *scale, const void *bias, int64_t k,
                             const void *x, int64_t xs, void *y, int64_t ys, int64_t batch, int64_t r0, int64_t r1,
                             int y_f32) {
    if (m->weight_kind == WEIGHTS_BF16)
        gemv_rows_bf16(w, bias, k, x, xs, y_f32 ? 0 : y, y_f32 ? y : 0, ys, batch, r0, r1);
    else if (!scale)
        gemv_rows_f32(w, bias, k, x, xs, y, ys, batch, r0, r1);
    else if (m->weight_kind == WEIGHTS_FP8)
        gemv_rows_fp8(w, scale, bias, k, x, xs, y, ys, batch, r0, r1);
    else
        gemv_rows_i8(w, scale, bias, k, x, xs, y, ys, batch, r0, r1);
}

static inline void gemv_silu_rows(const decode_model *m, const void *w, const float *scale, const void *bias,
                                  int64_t k, int64_t inter, const void *x, void *out, int64_t batch, int64_t i0,
                                  int64_t i1) {
    if (m->weight_kind == WEIGHTS_BF16)
        gemv_silu_rows_bf16(w, bias, k, inter, x, out, batch, i0, i1);
    else if (!scale)
        gemv_silu_rows_f32(w, bias, k, inter, x, out, batch, i0, i1);
    else if (m->weight_kind == WEIGHTS_FP8)
        gemv_silu_rows_fp8(w, scale, bias, k, inter, x, out, batch, i0, i1);
    else
        gemv_silu_rows_i8(w, scale, bias, k, inter, x, out, batch, i0, i1);
}

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
/* Every chunk c of a GEMV over n rows, each computed by one thread (chunk_walk), then a barrier. */
#define FOR_EACH_CHUNK(c, n)                                                                              \
    for (chunk_walk walk_ = chunk_walk_start(spans, NUM_CHUNKS(n), thread, threads, &walks); \
         chunk_walk_next(&walk_, &c);)
/* y = x W^T (+ bias) over n rows of k values (x: batch rows of k): on AMX tiles (bf16, or int8
 * weights: those with a scale), each thread packing the inputs into its own scratch first (no
 * barrier: every thread reads x whole), else the GEMVs; y_f32: float32 logits of a bf16 model. A
 * barrier follows at the call site. */
#define MATMUL(w_, scale_, bias_, k_, x_, n_, y_, y_stride_, y_f32_)                                                  \
    if (amx && (bf || (scale_))) {                                                                                 \
        if (bf)                                                                                                    \
            amx_pack_bf16((const bf16 *)(x_), batch, k_, amx_mine);                                                \
        else                                                                                                       \
            amx_pack_i8((const float *)(x_), batch, k_, amx_mine, batch, k_max);                                   \
        FOR_EACH_CHUNK(c, n_) {                                                                                    \
            const int64_t r0_ = c * GEMV_CHUNK, r1_ = r0_ + GEMV_CHUNK < (n_) ? r0_ + GEMV_CHUNK : (n_);          \
            if (bf)                                                                                                \
                amx_rows_bf16(w_, bias_, n_, k_, batch, r0_, r1_, (y_f32_) ? 0 : (bf16 *)(y_) + r0_,             \
                              (y_f32_) ? (float *)(y_) + r0_ : 0, y_stride_, amx_mine, batch, k_max);               \
            else                                                                                                   \
                amx_rows_i8(w_, scale_, bias_, n_, k_, batch, r0_, r1_, (float *)(y_) + r0_, y_stride_, amx_mine,   \
                            batch, k_max);                                                                         \
        }                                                                                                          \
    } else                                                                                                         \
        FOR_EACH_CHUNK(c, n_) gemv_rows(m, w_, scale_, bias_, k_, x_, k_, y_, y_stride_, batch, CHUNK_ROWS(c, n_), y_f32_);

/* The most values an input row of a layer's matmuls holds (hidden, the heads' width or inter):
 * what each thread's AMX scratch is sized for. */
static int64_t widest_input(const decode_model *m) {
    const int64_t h = m->hidden, q = m->num_q_heads * m->head_dim, inter = m->inter;
    return h > q ? (h > inter ? h : inter) : (q > inter ? q : inter);
}

/* Bytes of one thread's AMX scratch for `batch` inputs of up to k_max values (0: no AMX). */
static int64_t amx_thread_bytes(const decode_model *m, int64_t batch, int64_t k_max) {
    if (!(m->amx_min_batch > 0 && batch >= m->amx_min_batch)) return 0;
    if (m->weight_kind != WEIGHTS_BF16 && m->weight_kind != WEIGHTS_INT8) return 0;
    return (amx_scratch_bytes(m->weight_kind == WEIGHTS_INT8, batch, k_max) + 63) / 64 * 64;
}

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

/* The same for a bf16 model, rounding as add_rms_norm_bf16 does: the sum to bf16 (and the norm
 * taken of the rounded sum), the output to bf16. */
static void residual_norm_bf16(const bf16 *res, const bf16 *add, bf16 *res_out, const bf16 *weight, bf16 *normed,
                               int64_t batch, int64_t h, float eps) {
    for (int64_t b = 0; b < batch; b++) {
        const bf16 *r = res + b * h, *a = add ? add + b * h : 0;
        bf16 *o = normed + b * h, *keep = res_out ? res_out + b * h : 0;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < h; i++) {
            const bf16 v = a ? bf16_narrow(bf16_widen(r[i]) + bf16_widen(a[i])) : r[i];
            o[i] = v;
            sq += bf16_widen(v) * bf16_widen(v);
        }
        const float inv = 1.0f / sqrtf(sq / (float)h + eps);
        if (keep) memcpy(keep, o, h * sizeof(bf16));
#pragma omp simd
        for (int64_t i = 0; i < h; i++) o[i] = bf16_narrow(bf16_widen(o[i]) * inv * bf16_widen(weight[i]));
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
        rotary_head_f32(qkv_row + head * d, c, s, half);
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

/* The same for a bf16 model and cache, each rotated value rounded to bf16 as rotary_write_kv_bf16 does. */
static void rotary_write_kv_head_bf16(bf16 *qkv_row, const float *cos_sin, int64_t position, bf16 *kv, int64_t slot,
                                      int64_t hq, int64_t hkv, int64_t d, int64_t kvh, int64_t block_size) {
    const int64_t half = d / 2, group = hq / hkv;
    const float *c = cos_sin + position * d, *s = c + half;
    for (int64_t i = 0; i <= group; i++) {
        const int64_t head = i < group ? kvh * group + i : hq + kvh;
        rotary_head_bf16(qkv_row + head * d, c, s, half);
    }
    if (slot < 0) return;
    const int64_t row = hkv * d;
    bf16 *k_dst = kv + (slot / block_size) * 2 * block_size * row + (slot % block_size) * row + kvh * d;
    memcpy(k_dst, qkv_row + (hq + kvh) * d, d * sizeof(bf16));
    memcpy(k_dst + block_size * row, qkv_row + (hq + hkv + kvh) * d, d * sizeof(bf16));
}

/* Element i of an activation buffer: float32, or bf16 in a bf16 model's step. Every buffer is laid
 * out in floats (a bf16 one uses the first half of its room). */
#define EL(p, i) (bf ? (void *)((bf16 *)(p) + (i)) : (void *)((float *)(p) + (i)))

/* residual [batch][hidden]: the tokens' embeddings in, the last layer's residual stream out (float32,
 * or bf16 when bf). kv: the whole cache [layers][blocks][2][block_size][Hkv][D] in the same dtype;
 * layer_stride elements per layer. (decode_step_kvq8: a quantized cache, byte regions of
 * region_bytes; layer_stride bytes per layer.) work: scratch of decode_step_work_floats(...) floats.
 * logits: [batch][vocab] float32. Positions, slots and block ids are trusted (checked once per step
 * by the caller); a sequence length outside [1, max_len] returns -1 before anything is written.
 *
 * Barriers: one closing each GEMV, the K/V write and the attention, none for the small ops (see above). */
static int decode_step(const decode_model *m, void *residual, int64_t batch, const int64_t *positions,
                       const int64_t *slot_mapping, void *kv, int64_t layer_stride, int64_t block_size,
                       int64_t region_bytes, int fp8, const int32_t *block_tables, int64_t table_stride,
                       const int32_t *seq_lens, int64_t max_len, float *logits, float *work,
                       int64_t num_threads, double *phase_seconds) {
    for (int64_t b = 0; b < batch; b++)
        if (seq_lens[b] < 1 || seq_lens[b] > max_len) return -1;
    const int bf = m->weight_kind == WEIGHTS_BF16;
    const int64_t h = m->hidden, inter = m->inter, d = m->head_dim, hq = m->num_q_heads, hkv = m->num_kv_heads;
    const int64_t group = hq / hkv, q_width = hq * d, qkv_width = (hq + 2 * hkv) * d;
    const kv_kind cache_kind = bf ? KV_BF16 : !region_bytes ? KV_F32 : fp8 ? KV_FP8 : KV_INT8;
    /* two residual buffers taking turns (see residual_norm); the stream starts in `residual` */
    float *qkv = work, *attn = qkv + batch * qkv_width, *act = attn + batch * q_width, *out = act + batch * inter,
          *spare = out + batch * h, *per_thread = spare + batch * h;
    const int64_t per_thread_floats = batch * h + group * (max_len + 2 * d);
    const int timed = phase_seconds != 0;
    /* the GEMVs' chunk spans, one cache line per thread, after the threads' scratch */
    uint64_t *spans = (uint64_t *)(((uintptr_t)(per_thread + num_threads * per_thread_floats) + 63) & ~(uintptr_t)63);
    memset(spans, 0, num_threads * CHUNK_SPAN_STRIDE * sizeof(uint64_t));
    /* AMX: each thread's scratch for packed inputs, after the spans */
    const int64_t k_max = widest_input(m);
    const int64_t amx_stride = amx_thread_bytes(m, batch, k_max);
    const int amx = amx_stride > 0;
    if (amx && amx_usable() != 1) return -3;
    uint8_t *amx_base = (uint8_t *)(spans + num_threads * CHUNK_SPAN_STRIDE);

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef _OPENMP
        const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int thread = 0, threads = 1;
#endif
        int64_t walks = 0, c; /* walks: GEMVs begun, the same count in every thread; c: a chunk */
        float *normed = per_thread + thread * per_thread_floats, *scores = normed + batch * h;
        const int timer = timed && thread == 0;
        void *amx_mine = amx ? amx_base + thread * amx_stride : 0;
        if (amx) amx_tiles_begin();
        double mark = timer ? clock_now() : 0.0;
        void *res = residual, *res_next = spare;
#define NEXT_RESIDUAL(add, weight)                                                                      \
    {                                                                                                   \
        void *keep_ = thread == 0 ? res_next : 0;                                                       \
        if (bf)                                                                                         \
            residual_norm_bf16(res, (const void *)(add), keep_, weight, (bf16 *)normed, batch, h, m->eps); \
        else                                                                                            \
            residual_norm(res, add, keep_, weight, normed, batch, h, m->eps);                           \
        void *t_ = res;                                                                                 \
        res = res_next;                                                                                 \
        res_next = t_;                                                                                  \
    }
        for (int64_t l = 0; l < m->num_layers; l++) {
            const decode_layer *w = &m->layers[l];
            void *layer_kv = region_bytes ? (void *)((uint8_t *)kv + l * layer_stride) : EL(kv, l * layer_stride);
            const paged_kv layer_cache = {layer_kv, cache_kind, hkv, d, block_size, region_bytes};
            if (l == 0) {
                if (bf)
                    residual_norm_bf16(res, 0, 0, w->input_norm, (bf16 *)normed, batch, h, m->eps);
                else
                    residual_norm(res, 0, 0, w->input_norm, normed, batch, h, m->eps);
            } else
                NEXT_RESIDUAL(out, w->input_norm)
            MARK(PH_NORM)
            MATMUL(w->qkv, w->qkv_scale, w->qkv_bias, h, normed, qkv_width, qkv, qkv_width, 0)
#pragma omp barrier
            MARK(PH_QKV)
            /* every row's K/V is written before any row attends: rows of one sequence at consecutive
             * positions (a speculative verify step) see each other's keys */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < batch * hkv; item++) {
                const int64_t b = item / hkv, kvh = item % hkv;
                if (bf)
                    rotary_write_kv_head_bf16(EL(qkv, b * qkv_width), m->cos_sin, positions[b], layer_kv,
                                              slot_mapping[b], hq, hkv, d, kvh, block_size);
                else
                    rotary_write_kv_head(qkv + b * qkv_width, m->cos_sin, positions[b], layer_kv, slot_mapping[b],
                                         hq, hkv, d, kvh, block_size, region_bytes, fp8);
            }
            paged_attention_rows(&layer_cache, qkv, qkv_width, attn, q_width, block_tables, table_stride, seq_lens,
                                 batch, hq, m->scale, scores);
            MARK(PH_ATTENTION)
            MATMUL(w->o, w->o_scale, w->o_bias, q_width, attn, h, out, h, 0)
#pragma omp barrier
            MARK(PH_O)
            NEXT_RESIDUAL(out, w->post_norm)
            MARK(PH_NORM)
            if (amx && bf) {
                amx_pack_bf16((const bf16 *)normed, batch, h, amx_mine);
                FOR_EACH_CHUNK(c, inter) {
                    const int64_t i0 = c * GEMV_CHUNK, i1 = i0 + GEMV_CHUNK < inter ? i0 + GEMV_CHUNK : inter;
                    bf16 gate[batch * GEMV_CHUNK], up[batch * GEMV_CHUNK];
                    amx_rows_bf16(w->gate_up, w->gate_up_bias, 2 * inter, h, batch, i0, i1, gate, 0, GEMV_CHUNK,
                                  amx_mine, batch, k_max);
                    amx_rows_bf16(w->gate_up, w->gate_up_bias, 2 * inter, h, batch, inter + i0, inter + i1, up, 0,
                                  GEMV_CHUNK, amx_mine, batch, k_max);
                    for (int64_t b = 0; b < batch; b++)
                        for (int64_t t = 0; t < i1 - i0; t++)
                            ((bf16 *)act)[b * inter + i0 + t] = bf16_narrow(
                                silu_mul(bf16_widen(gate[b * GEMV_CHUNK + t]), bf16_widen(up[b * GEMV_CHUNK + t])));
                }
            } else if (amx && w->gate_up_scale) {
                amx_pack_i8(normed, batch, h, amx_mine, batch, k_max);
                FOR_EACH_CHUNK(c, inter) {
                    const int64_t i0 = c * GEMV_CHUNK, i1 = i0 + GEMV_CHUNK < inter ? i0 + GEMV_CHUNK : inter;
                    float gate[batch * GEMV_CHUNK], up[batch * GEMV_CHUNK];
                    amx_rows_i8(w->gate_up, w->gate_up_scale, w->gate_up_bias, 2 * inter, h, batch, i0, i1, gate,
                                GEMV_CHUNK, amx_mine, batch, k_max);
                    amx_rows_i8(w->gate_up, w->gate_up_scale, w->gate_up_bias, 2 * inter, h, batch, inter + i0,
                                inter + i1, up, GEMV_CHUNK, amx_mine, batch, k_max);
                    for (int64_t b = 0; b < batch; b++)
                        for (int64_t t = 0; t < i1 - i0; t++)
                            act[b * inter + i0 + t] = silu_mul(gate[b * GEMV_CHUNK + t], up[b * GEMV_CHUNK + t]);
                }
            } else
                FOR_EACH_CHUNK(c, inter)
                    gemv_silu_rows(m, w->gate_up, w->gate_up_scale, w->gate_up_bias, h, inter, normed, act, batch,
                                   CHUNK_ROWS(c, inter));
#pragma omp barrier
            MARK(PH_GATE_UP_SILU)
            MATMUL(w->down, w->down_scale, w->down_bias, inter, act, h, out, h, 0)
#pragma omp barrier
            MARK(PH_DOWN)
        }
        NEXT_RESIDUAL(out, m->final_norm)
#undef NEXT_RESIDUAL
        MARK(PH_NORM)
        MATMUL(m->lm_head, m->lm_head_scale, 0, h, normed, m->vocab, logits, m->vocab, 1)
#pragma omp barrier
        MARK(PH_LM_HEAD)
        if (amx) amx_tiles_end();
        /* the stream ends in `res` of thread 0; the caller's buffer holds it either way */
        if (thread == 0 && res != residual) memcpy(residual, res, batch * h * (bf ? sizeof(bf16) : sizeof(float)));
    }
    return 0;
}

/* A float32 model's step (8-bit weights allowed), float32 cache; -2 for a bf16 model. */
int decode_step_f32(const decode_model *m, float *residual, int64_t batch, const int64_t *positions,
                    const int64_t *slot_mapping, float *kv, int64_t layer_stride, int64_t block_size,
                    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                    int64_t max_len, float *logits, float *work, int64_t num_threads,
                    double *phase_seconds) {
    if (m->weight_kind == WEIGHTS_BF16) return -2;
    return decode_step(m, residual, batch, positions, slot_mapping, kv, layer_stride, block_size, 0, 0,
                       block_tables, table_stride, seq_lens, max_len, logits, work, num_threads, phase_seconds);
}

/* decode_step_f32 over a quantized cache (head_dim <= 512, checked by the caller). */
int decode_step_kvq8(const decode_model *m, float *residual, int64_t batch, const int64_t *positions,
                     const int64_t *slot_mapping, uint8_t *kv, int64_t layer_stride, int64_t block_size,
                     int64_t region_bytes, int fp8, const int32_t *block_tables, int64_t table_stride,
                     const int32_t *seq_lens, int64_t max_len, float *logits, float *work, int64_t num_threads,
                     double *phase_seconds) {
    if (m->weight_kind == WEIGHTS_BF16) return -2;
    return decode_step(m, residual, batch, positions, slot_mapping, kv, layer_stride, block_size, region_bytes,
                       fp8, block_tables, table_stride, seq_lens, max_len, logits, work, num_threads,
                       phase_seconds);
}

/* A bf16 model's step: residual and cache in bf16, logits float32; -2 for any other model. */
int decode_step_bf16(const decode_model *m, bf16 *residual, int64_t batch, const int64_t *positions,
                     const int64_t *slot_mapping, bf16 *kv, int64_t layer_stride, int64_t block_size,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, int64_t max_len,
                     float *logits, float *work, int64_t num_threads, double *phase_seconds) {
    if (m->weight_kind != WEIGHTS_BF16) return -2;
    return decode_step(m, residual, batch, positions, slot_mapping, kv, layer_stride, block_size, 0, 0,
                       block_tables, table_stride, seq_lens, max_len, logits, work, num_threads, phase_seconds);
}

/* Floats of scratch decode_step needs. */
int64_t decode_step_work_floats(const decode_model *m, int64_t batch, int64_t max_len, int64_t num_threads) {
    const int64_t h = m->hidden, d = m->head_dim, qkv_width = (m->num_q_heads + 2 * m->num_kv_heads) * d;
    const int64_t group = m->num_q_heads / m->num_kv_heads;
    const int64_t k_max = widest_input(m);
    const int64_t amx = num_threads * amx_thread_bytes(m, batch, k_max) / 4;
    return batch * (qkv_width + m->num_q_heads * d + m->inter + 2 * h) +
           num_threads * (batch * h + group * (max_len + 2 * d)) + 16 /* alignment */ +
           num_threads * CHUNK_SPAN_STRIDE * 2 /* the chunk spans */ + amx /* AMX scratch, in floats */;
}
