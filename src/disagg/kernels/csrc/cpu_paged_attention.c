/* Paged decode attention (paged_attention.h): each sequence's query row against its cached K/V,
 * read through its block table, over a float32, bf16 or 8-bit (int8, fp8 e4m3) cache.
 *
 * One walk serves every kind: sequence -> KV head (paged_attention_rows) -> the blocks of its table
 * (head_attention_blocks), in three passes: scores = scale * q.k, their softmax, the weighted sum of
 * V; each cached row is read once per pass for the whole group of query heads sharing it. What a
 * kind changes (where a row lives and its scale, how its values enter a dot and the weighted sum)
 * is in the small inline functions below, which the compiler specializes per kind and at the
 * common head dims (64, 128: fully unrolled). With AVX-512, float32 and bf16 caches at those head
 * dims take a register-blocked kernel instead (head_attention_avx512).
 */
#include "paged_attention.h"

#include "cpu_kernels.h"

#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* e4m3 byte -> float with integer ops only (vectorizes, unlike a table lookup): a normal value's
 * exponent is rebiased from 7 to 127 and its 3 mantissa bits moved to the top of float's 23;
 * a subnormal (exponent field 0) is mantissa * 2^-9. */
static inline float e4m3_to_float(uint8_t b) {
    const uint32_t e = (b >> 3) & 15, m = b & 7, sign = (uint32_t)(b & 0x80) << 24;
    union { uint32_t u; float f; } normal = {.u = sign | ((e + 120) << 23) | (m << 20)};
    const float sub = (float)m * 0.001953125f;
    return e ? normal.f : (sign ? -sub : sub);
}

/* One cached row: where its D values are, and their scale (1 but for the 8-bit kinds). */
typedef struct {
    const void *values;
    float scale;
} kv_row;

/* Token t of `block`'s K (which 0) or V (which 1) row of kv_head. */
ALWAYS_INLINE kv_row row_at(const paged_kv *kv, const kv_kind kind, const int64_t D, int64_t block, int64_t which,
                            int64_t t, int64_t kv_head) {
    const int64_t hkv = kv->num_kv_heads, bs = kv->block_size;
    if (kind == KV_INT8 || kind == KV_FP8) {
        const uint8_t *region = (const uint8_t *)kv->data + block * kv->region_bytes;
        const int64_t at = (which * bs + t) * hkv + kv_head;
        return (kv_row){region + at * D, ((const float *)(region + 2 * bs * hkv * D))[at]};
    }
    const int64_t at = ((2 * block + which) * bs + t) * hkv * D + kv_head * D;
    if (kind == KV_BF16) return (kv_row){(const bf16 *)kv->data + at, 1.0f};
    return (kv_row){(const float *)kv->data + at, 1.0f};
}

/* A row's values as the dots read them: float32 and bf16 ones in place (bf16 widened as it is
 * read), 8-bit ones widened once into buf, for the whole group. */
ALWAYS_INLINE const void *row_values(const kv_kind kind, const void *values, const int64_t D, float *buf) {
    if (kind == KV_INT8) {
        const int8_t *v = values;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) buf[d] = (float)v[d];
        return buf;
    }
    if (kind == KV_FP8) {
        const uint8_t *v = values;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) buf[d] = e4m3_to_float(v[d]);
        return buf;
    }
    return values;
}

/* q . row over D values. */
ALWAYS_INLINE float row_dot(const kv_kind kind, const float *q, const void *row, const int64_t D) {
    float dot = 0.0f;
    if (kind == KV_BF16) {
        const bf16 *r = row;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += q[d] * bf16_widen(r[d]);
    } else {
        const float *r = row;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += q[d] * r[d];
    }
    return dot;
}

/* o += p * row over D values. */
ALWAYS_INLINE void row_accumulate(const kv_kind kind, float *o, float p, const void *row, const int64_t D) {
    if (kind == KV_BF16) {
        const bf16 *r = row;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] += p * bf16_widen(r[d]);
    } else {
        const float *r = row;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] += p * r[d];
    }
}

/* Decode attention of one sequence and one KV head for its `group` query heads (q: the group's heads
 * in float32, contiguous; out: their float32 outputs), block by block of its table; scores holds
 * group * len floats. */
ALWAYS_INLINE void head_attention_blocks(const paged_kv *kv, const kv_kind kind, const int64_t D, const float *q,
                                         const int32_t *table, int64_t len, int64_t group, int64_t kv_head,
                                         float scale, float *scores, float *out) {
    float buf[KV_8BIT_MAX_HEAD_DIM]; /* one 8-bit row widened (the 8-bit kinds only) */
    const int64_t bs = kv->block_size;
    for (int64_t j0 = 0, blk = 0; j0 < len; j0 += bs, blk++) {
        const int64_t n = len - j0 < bs ? len - j0 : bs;
        for (int64_t t = 0; t < n; t++) {
            const kv_row k = row_at(kv, kind, D, table[blk], 0, t, kv_head);
            const void *values = row_values(kind, k.values, D, buf);
            const float s = scale * k.scale;
            for (int64_t g = 0; g < group; g++) scores[g * len + j0 + t] = row_dot(kind, q + g * D, values, D) * s;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        softmax_in_place(scores + g * len, len);
        memset(out + g * D, 0, D * sizeof(float));
    }
    for (int64_t j0 = 0, blk = 0; j0 < len; j0 += bs, blk++) {
        const int64_t n = len - j0 < bs ? len - j0 : bs;
        for (int64_t t = 0; t < n; t++) {
            const kv_row v = row_at(kv, kind, D, table[blk], 1, t, kv_head);
            const void *values = row_values(kind, v.values, D, buf);
            for (int64_t g = 0; g < group; g++)
                row_accumulate(kind, out + g * D, scores[g * len + j0 + t] * v.scale, values, D);
        }
    }
}

#if defined(__x86_64__) && defined(__AVX512F__)
#include <immintrin.h>
/* 16 bf16 values widened to float32 (exact: the top half of the float's bits). */
static inline __m512 widen16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* out[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once (pairwise, in four halving stages;
 * the lanes come out in order). */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 s[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

#define PREFETCH_ROWS 8 /* cached rows ahead: a head's rows are strided, which the prefetchers miss */

/* 16 cached values from p: bf16 widened (bf), else float32. */
static inline __m512 load16(const void *p, const int bf) {
    return bf ? widen16((const bf16 *)p) : _mm512_loadu_ps((const float *)p);
}

/* Decode attention of one sequence and one KV head (cache elements bf16 when bf, else float32) for
 * D a multiple of 16 up to 128 and a group of up to 8 query heads (q float32), in registers: each
 * cached row loaded once for the whole group; the scores of 16 tokens summed across lanes at once
 * (reduce16); the group's outputs accumulated in float32 vectors into acc. The same three passes
 * as head_attention_blocks, the sums in another order. */
static inline __attribute__((always_inline)) void head_attention_avx512(
    const float *q, const void *kv_base, const int bf, const int32_t *table, int64_t len, int64_t group,
    const int64_t D, int64_t kv_head, int64_t num_kv_heads, int64_t block_size, float scale, float *scores,
    float *acc) {
    const char *kv = (const char *)kv_base;
    const int64_t el = bf ? 2 : 4;
    const int64_t row = num_kv_heads * D, kv_block = 2 * block_size * row, C = D / 16;
    __m512 qv[8][8], part[8][16];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < C; c++) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t n = len - j0 < 16 ? len - j0 : 16;
        for (int64_t i = 0; i < 16; i++) {
            if (i >= n) {
                for (int64_t g = 0; g < group; g++) part[g][i] = _mm512_setzero_ps();
                continue;
            }
            const int64_t j = j0 + i;
            const char *k = kv + el * ((int64_t)table[j / block_size] * kv_block + (j % block_size) * row + kv_head * D);
            if (j + PREFETCH_ROWS < len) {
                const int64_t f = j + PREFETCH_ROWS;
                const char *next = kv + el * ((int64_t)table[f / block_size] * kv_block + (f % block_size) * row + kv_head * D);
                for (int64_t b = 0; b < D * el; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            }
            __m512 kf[8];
            for (int64_t c = 0; c < C; c++) kf[c] = load16(k + el * 16 * c, bf);
            for (int64_t g = 0; g < group; g++) {
                __m512 p = _mm512_mul_ps(qv[g][0], kf[0]);
                for (int64_t c = 1; c < C; c++) p = _mm512_fmadd_ps(qv[g][c], kf[c], p);
                part[g][i] = p;
            }
        }
        const __mmask16 keep = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
        for (int64_t g = 0; g < group; g++)
            _mm512_mask_storeu_ps(scores + g * len + j0, keep, _mm512_mul_ps(reduce16(part[g]), _mm512_set1_ps(scale)));
    }
    for (int64_t g = 0; g < group; g++) softmax_in_place(scores + g * len, len);
    __m512 out[8][8];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < C; c++) out[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j++) {
        const char *v =
            kv + el * ((int64_t)table[j / block_size] * kv_block + block_size * row + (j % block_size) * row + kv_head * D);
        if (j + PREFETCH_ROWS < len) {
            const int64_t f = j + PREFETCH_ROWS;
            const char *next =
                kv + el * ((int64_t)table[f / block_size] * kv_block + block_size * row + (f % block_size) * row + kv_head * D);
            for (int64_t b = 0; b < D * el; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
        }
        __m512 vf[8];
        for (int64_t c = 0; c < C; c++) vf[c] = load16(v + el * 16 * c, bf);
        for (int64_t g = 0; g < group; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * len + j]);
            for (int64_t c = 0; c < C; c++) out[g][c] = _mm512_fmadd_ps(p, vf[c], out[g][c]);
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(acc + g * D + 16 * c, out[g][c]);
}
#define HAVE_ATTENTION_AVX512 1
#else
#define HAVE_ATTENTION_AVX512 0
#endif

#if HAVE_ATTENTION_AVX512
/* head_attention_avx512 at one cache kind and head dim, each out of line: inlined beside the block
 * walk's instances it compiles to slower code. */
#define HEAD_ATTENTION_AVX512_AT(NAME, BF, D)                                                               \
    static __attribute__((noinline)) void NAME(const paged_kv *kv, const float *q, const int32_t *table,    \
                                               int64_t len, int64_t group, int64_t kv_head, float scale,    \
                                               float *scores, float *out) {                                 \
        head_attention_avx512(q, kv->data, BF, table, len, group, D, kv_head, kv->num_kv_heads,             \
                              kv->block_size, scale, scores, out);                                          \
    }
HEAD_ATTENTION_AVX512_AT(head_attention_avx512_f32_d64, 0, 64)
HEAD_ATTENTION_AVX512_AT(head_attention_avx512_f32_d128, 0, 128)
HEAD_ATTENTION_AVX512_AT(head_attention_avx512_bf16_d64, 1, 64)
HEAD_ATTENTION_AVX512_AT(head_attention_avx512_bf16_d128, 1, 128)
#endif

/* One KV head's attention by the fastest path for its kind and head dim. */
ALWAYS_INLINE void head_attention(const paged_kv *kv, const kv_kind kind, const float *q, const int32_t *table,
                                  int64_t len, int64_t group, int64_t kv_head, float scale, float *scores,
                                  float *out) {
    const int64_t D = kv->head_dim;
#if HAVE_ATTENTION_AVX512
    if ((kind == KV_F32 || kind == KV_BF16) && group <= 8 && (D == 64 || D == 128)) {
        if (kind == KV_F32 && D == 64)
            head_attention_avx512_f32_d64(kv, q, table, len, group, kv_head, scale, scores, out);
        else if (kind == KV_F32)
            head_attention_avx512_f32_d128(kv, q, table, len, group, kv_head, scale, scores, out);
        else if (D == 64)
            head_attention_avx512_bf16_d64(kv, q, table, len, group, kv_head, scale, scores, out);
        else
            head_attention_avx512_bf16_d128(kv, q, table, len, group, kv_head, scale, scores, out);
        return;
    }
#endif
    if (D == 64)
        head_attention_blocks(kv, kind, 64, q, table, len, group, kv_head, scale, scores, out);
    else if (D == 128)
        head_attention_blocks(kv, kind, 128, q, table, len, group, kv_head, scale, scores, out);
    else
        head_attention_blocks(kv, kind, D, q, table, len, group, kv_head, scale, scores, out);
}

/* head_attention compiled once per kind. */
#define HEAD_ATTENTION_OF(KIND, NAME)                                                                           \
    static void NAME(const paged_kv *kv, const float *q, const int32_t *table, int64_t len, int64_t group,      \
                     int64_t kv_head, float scale, float *scores, float *out) {                                 \
        head_attention(kv, KIND, q, table, len, group, kv_head, scale, scores, out);                            \
    }
HEAD_ATTENTION_OF(KV_F32, head_attention_f32)
HEAD_ATTENTION_OF(KV_BF16, head_attention_bf16)
HEAD_ATTENTION_OF(KV_INT8, head_attention_int8)
HEAD_ATTENTION_OF(KV_FP8, head_attention_fp8)

void paged_attention_rows(const paged_kv *kv, const void *q, int64_t q_row_stride, void *out,
                          int64_t out_row_stride, const int32_t *block_tables, int64_t table_stride,
                          const int32_t *seq_lens, int64_t batch, int64_t num_q_heads, float scale,
                          float *scratch) {
    const int64_t hkv = kv->num_kv_heads, D = kv->head_dim, group = num_q_heads / hkv;
    const int bf = kv->kind == KV_BF16;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * hkv; item++) {
        const int64_t b = item / hkv, h = item % hkv, len = seq_lens[b];
        const int64_t q_at = b * q_row_stride + h * group * D, out_at = b * out_row_stride + h * group * D;
        const int32_t *table = block_tables + b * table_stride;
        float *scores = scratch, *acc;
        const float *qf;
        if (bf) { /* the group's queries widened after the scores, their float32 outputs after those */
            const bf16 *qb = (const bf16 *)q + q_at;
            float *widened = scores + group * len;
            for (int64_t i = 0; i < group * D; i++) widened[i] = bf16_widen(qb[i]);
            qf = widened;
            acc = widened + group * D;
        } else {
            qf = (const float *)q + q_at;
            acc = (float *)out + out_at;
        }
        switch (kv->kind) {
        case KV_F32: head_attention_f32(kv, qf, table, len, group, h, scale, scores, acc); break;
        case KV_BF16: head_attention_bf16(kv, qf, table, len, group, h, scale, scores, acc); break;
        case KV_INT8: head_attention_int8(kv, qf, table, len, group, h, scale, scores, acc); break;
        case KV_FP8: head_attention_fp8(kv, qf, table, len, group, h, scale, scores, acc); break;
        }
        if (bf) {
            bf16 *ob = (bf16 *)out + out_at;
            for (int64_t i = 0; i < group * D; i++) ob[i] = bf16_narrow(acc[i]);
        }
    }
}

/* ---- the per-op entries: one layer's attention in one call ----
 * q: B rows of Hq * D values, q_row_stride apart (a slice of the fused qkv output); out: [B][Hq][D];
 * block_tables: [B][table_stride] int32; seq_lens: [B] int32. The (sequence, KV head) items are
 * spread over num_threads OpenMP threads: torch's own pool, as this library binds to the libgomp
 * torch has loaded, so its threads are already awake and nothing is oversubscribed. scratch holds
 * num_threads * group * max_len floats (bf16: num_threads * group * (max_len + 2 D)).
 * Returns 0, -1 for a sequence length outside [1, max_len], -2 for an 8-bit cache's head dim over
 * KV_8BIT_MAX_HEAD_DIM. */
static int paged_decode_attention(const paged_kv *kv, const void *q, int64_t q_row_stride, const int32_t *block_tables,
                                  int64_t table_stride, const int32_t *seq_lens, void *out, int64_t batch,
                                  int64_t num_q_heads, float scale, float *scratch, int64_t max_len,
                                  int64_t num_threads) {
    if ((kv->kind == KV_INT8 || kv->kind == KV_FP8) && kv->head_dim > KV_8BIT_MAX_HEAD_DIM) return -2;
    for (int64_t b = 0; b < batch; b++)
        if (seq_lens[b] < 1 || seq_lens[b] > max_len) return -1;
    const int64_t group = num_q_heads / kv->num_kv_heads;
    const int64_t per_thread = group * (max_len + (kv->kind == KV_BF16 ? 2 * kv->head_dim : 0));
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef _OPENMP
        float *mine = scratch + omp_get_thread_num() * per_thread;
#else
        float *mine = scratch;
#endif
        paged_attention_rows(kv, q, q_row_stride, out, num_q_heads * kv->head_dim, block_tables, table_stride,
                             seq_lens, batch, num_q_heads, scale, mine);
    }
    return 0;
}

int paged_decode_attention_f32(const float *q, int64_t q_row_stride, const float *kv, const int32_t *block_tables,
                               int64_t table_stride, const int32_t *seq_lens, float *out, int64_t batch,
                               int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, float *scratch, int64_t max_len, int64_t num_threads) {
    const paged_kv cache = {kv, KV_F32, num_kv_heads, head_dim, block_size, 0};
    return paged_decode_attention(&cache, q, q_row_stride, block_tables, table_stride, seq_lens, out, batch,
                                  num_q_heads, scale, scratch, max_len, num_threads);
}

/* q and out bf16. */
int paged_decode_attention_bf16(const bf16 *q, int64_t q_row_stride, const bf16 *kv, const int32_t *block_tables,
                                int64_t table_stride, const int32_t *seq_lens, bf16 *out, int64_t batch,
                                int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale, float *scratch, int64_t max_len, int64_t num_threads) {
    const paged_kv cache = {kv, KV_BF16, num_kv_heads, head_dim, block_size, 0};
    return paged_decode_attention(&cache, q, q_row_stride, block_tables, table_stride, seq_lens, out, batch,
                                  num_q_heads, scale, scratch, max_len, num_threads);
}

/* The cache as bytes with its region size; fp8 selects e4m3 values, else int8. */
int paged_decode_attention_q8(const float *q, int64_t q_row_stride, const uint8_t *cache, const int32_t *block_tables,
                              int64_t table_stride, const int32_t *seq_lens, float *out, int64_t batch,
                              int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              int64_t region_bytes, int fp8, float scale, float *scratch, int64_t max_len,
                              int64_t num_threads) {
    const paged_kv kv = {cache, fp8 ? KV_FP8 : KV_INT8, num_kv_heads, head_dim, block_size, region_bytes};
    return paged_decode_attention(&kv, q, q_row_stride, block_tables, table_stride, seq_lens, out, batch,
                                  num_q_heads, scale, scratch, max_len, num_threads);
}
