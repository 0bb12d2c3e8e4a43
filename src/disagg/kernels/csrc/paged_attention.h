/* Paged decode attention (cpu_paged_attention.c), shared by its per-op entries and the whole decode
 * step (cpu_decode_step.c). */
#ifndef DISAGG_PAGED_ATTENTION_H
#define DISAGG_PAGED_ATTENTION_H

#include <stdint.h>

/* What the cached K/V values are. */
typedef enum { KV_F32, KV_BF16, KV_INT8, KV_FP8 } kv_kind;

/* One layer of a paged KV cache.
 *   KV_F32, KV_BF16: data[num_blocks][2][block_size][Hkv][D], K at index 0 of dim 1.
 *   KV_INT8, KV_FP8 (e4m3): regions of region_bytes per block, each the 8-bit values
 *   [2][block_size][Hkv][D] (K first), then float32 scales [2][block_size][Hkv]; value = stored * scale. */
typedef struct {
    const void *data;
    kv_kind kind;
    int64_t num_kv_heads, head_dim, block_size;
    int64_t region_bytes; /* the 8-bit kinds only */
} paged_kv;

/* The largest head dim of the 8-bit kinds: each cached row is widened into a buffer of this many floats. */
#define KV_8BIT_MAX_HEAD_DIM 512

/* Decode attention of `batch` sequences over kv, one query row each: for every (sequence, KV head),
 * the group of Hq / Hkv query heads sharing that KV head against the sequence's cached rows, found
 * through its block table. q: rows of Hq * D values, q_row_stride elements apart (bf16 over a bf16
 * cache, else float32); out: the same, out_row_stride apart. block_tables: [batch][table_stride].
 * Every seq_lens[b] must be in [1, max_len] (the caller checks) and scratch must hold
 * group * (max_len + 2 D) floats (bf16: the scores, the group's queries widened and its float32
 * outputs; otherwise the scores alone, group * max_len).
 * Every thread of a parallel region calls it, each with its own scratch: the (sequence, KV head)
 * items are shared out among them (omp for, dynamic), and they meet at its end. */
void paged_attention_rows(const paged_kv *kv, const void *q, int64_t q_row_stride, void *out,
                          int64_t out_row_stride, const int32_t *block_tables, int64_t table_stride,
                          const int32_t *seq_lens, int64_t batch, int64_t num_q_heads, float scale,
                          float *scratch);

#endif
