/* AMX matrix products: TDPBF16PS (bf16 pairs, float32 sums) and TDPBSSD/TDPBSUD (int8, int32 sums).
 *
 * gemm_bf16_amx: y[M][N] = x[M][K] . W[N][K]^T (+ bias[N]) for bf16 x and W, y rounded to bf16
 * once. W is never repacked: 16 of its rows by 32 values, as they lie in memory (stride K), are
 * the left tile of TDPBF16PS, and the inputs, packed once per call as the right tile (pairs of K
 * values side by side, 16 inputs to a tile row), are what the weight rows multiply; each sum tile
 * holds y^T for 16 weight rows by 16 inputs. So the weights stream from memory once for up to 32
 * inputs, with no copy: batched decode and prompt chunks alike.
 *
 * gemm_i8_amx: int8 weights read in place the same way against 16-bit inputs as two byte
 * planes (below): the VNNI GEMM's W8A16 numbers, the weights streamed once per 16 inputs.
 *
 * gemm_w8_amx: y[M][N] = (x[M][K] . W[N][K]^T) * scale[N] (+ bias[N]) on AMX: 8-bit weights (int8 or
 * float8_e4m3fn) times float32 inputs rounded to bf16, float32 sums (TDPBF16PS), float32 out.
 *
 * What quantized.scaled_linear_bf16 computes through torch's bf16 GEMM, in one call: the inputs
 * are rounded to bf16 once into a padded buffer; each thread takes 32-column blocks of W, widens a
 * block's 8-bit values exactly to bf16 into the tile layout TDPBF16PS reads (pairs of K values
 * side by side, 16 columns to a tile row) in a buffer that stays in L2, runs every 32-row block
 * of inputs against it (2 x 2 tiles of 16 x 16 float32 sums, K in steps of 32), and writes the
 * sums scaled per column. No widened copy of the weight goes to memory and no bf16 product is
 * rounded: unlike the torch route, the sums reach the scale in float32.
 *
 * Built with AMX off (native_build.py); the bodies turn it (and AVX-512) on for themselves in a
 * target region, and every public entry, outside it, first checks amx_usable() (cpu_isa.c): where
 * the CPU or the kernel does not allow the tiles, the GEMMs return -2 and the pieces do nothing. */
#include "cpu_kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int64_t amx_usable(void);

#define KSTEP 32 /* bf16 values of K per tile row */
#define KSTEP8 64 /* int8 values of K per tile row */
#define NB 32    /* columns per block: two B tiles */
#define MB 32    /* rows per block: two A tiles */
#define GROUP 4  /* column blocks at most per group */

/* Where one thread's scratch for the GEMMs in pieces (cpu_decode_step.c) keeps what, for up to
 * m_max inputs of up to k_max values: the packed inputs from byte 0 (int8: both planes), then the
 * int8 inputs' scales, the 1024 sums and the edge rows (2 K-steps' KiB), each 64-byte aligned. */
typedef struct {
    int64_t scales, sums, edge, bytes;
} scratch_layout;

static scratch_layout layout_of(int int8, int64_t m_max, int64_t k_max) {
    const int64_t ksteps = int8 ? (k_max + KSTEP8 - 1) / KSTEP8 : (k_max + KSTEP - 1) / KSTEP, mblocks = (m_max + 15) / 16;
    scratch_layout s;
    s.scales = (int8 ? 2 : 1) * mblocks * ksteps * 1024;
    s.sums = s.scales + (int8 ? (mblocks * 16 * 4 + 63) / 64 * 64 : 0);
    s.edge = s.sums + 4096;
    s.bytes = s.edge + 2 * ksteps * 1024;
    return s;
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && !defined(DISAGG_NO_AMX)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>
#define HAVE_AMX_BUILD 1

static inline bf16 round_bf16(float f) {
    union { float f; uint32_t i; } u = {.f = f};
    return (bf16)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

static inline bf16 exact_bf16(float f) { /* a value with at most 8 significant bits */
    union { float f; uint32_t i; } u = {.f = f};
    return (bf16)(u.i >> 16);
}

/* r[i][j] <- r[j][i] for 16 vectors of 16 dwords. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* 16 bf16 values (the low halves of v's dwords: bits as stored) widened to float32 lanes. */
static inline __m512 widen_bf16x16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* bf16_narrow of 16 floats, in the low halves of the dwords: round to nearest even, a NaN kept
 * quiet, subnormals as they are (VCVTNEPS2BF16 would flush them). */
static inline __m512i narrow_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* The first min(n, 16) lanes (n > 0). */
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* One 32-column block of W widened into tile layout: panel[ks][t][r][c][2] = W[n0 + 16 t + c][32 ks
 * + 2 r + {0, 1}] as bf16, zeros past N and K. */
static void pack_block(const void *w, int fp8, int64_t n, int64_t k, int64_t n0, int64_t ksteps, bf16 *panel) {
    memset(panel, 0, (size_t)ksteps * NB * KSTEP * sizeof(bf16));
    if (!fp8) { /* int8: 16 columns x 32 values widened in registers, transposed as 16 x 16 pairs */
        const int64_t whole = k / KSTEP;
        for (int t = 0; t < 2; t++) {
            const int64_t c0 = n0 + 16 * t;
            if (c0 >= n) break;
            const int cols = n - c0 < 16 ? (int)(n - c0) : 16;
            for (int64_t ks = 0; ks < whole; ks++) {
                __m512i r[16];
                for (int c = 0; c < 16; c++) {
                    if (c >= cols) {
                        r[c] = _mm512_setzero_si512();
                        continue;
                    }
                    const int8_t *src = (const int8_t *)w + (c0 + c) * k + ks * KSTEP;
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
                    const __m512 hi =
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
                    r[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* exact: |v| <= 128 */
                }
                transpose16(r);
                bf16 *tile = panel + (ks * 2 + t) * 16 * 32;
                for (int row = 0; row < 16; row++) _mm512_storeu_si512(tile + row * 32, r[row]);
            }
        }
        for (int64_t col = 0; col < NB && n0 + col < n; col++) { /* the K tail */
            const int8_t *src = (const int8_t *)w + (n0 + col) * k;
            const int t = (int)(col / 16), c = (int)(col % 16);
            for (int64_t j = whole * KSTEP; j < k; j++) {
                const int64_t r = (j % KSTEP) / 2, half = j % 2;
                panel[(((whole * 2 + t) * 16 + r) * 16 + c) * 2 + half] = exact_bf16((float)src[j]);
            }
        }
        return;
    }
    for (int64_t col = 0; col < NB && n0 + col < n; col++) {
        const int t = (int)(col / 16), c = (int)(col % 16);
        for (int64_t j = 0; j < k; j++) {
            const int64_t ks = j / KSTEP, r = (j % KSTEP) / 2, half = j % 2;
            const float v = fp8 ? fp8_e4m3_value(((const uint8_t *)w)[(n0 + col) * k + j])
                                : (float)((const int8_t *)w)[(n0 + col) * k + j];
            panel[(((ks * 2 + t) * 16 + r) * 16 + c) * 2 + half] = exact_bf16(v);
        }
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every kernel here: eight tiles of 16 rows x 64 bytes. */
static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    /* GCC does not see LDTILECFG read the struct and may drop the stores above: make them happen */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* A left tile's source for W's rows [r0, r0 + 16), rows of row_bytes: W itself (tile ks at
 * w + 64 ks, rows row_bytes apart) where the 16 rows exist and row_bytes is a multiple of 64, else
 * a zero-padded copy in `edge` (tile ks at edge + 1024 ks, rows 64 bytes apart). */
typedef struct {
    const uint8_t *base;
    int64_t stride, step;
} left_tiles;

static left_tiles left_rows(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t r0, int64_t ksteps, uint8_t *edge) {
    if (row_bytes % 64 == 0 && r0 + 16 <= n) return (left_tiles){w + r0 * row_bytes, row_bytes, 64};
    memset(edge, 0, (size_t)ksteps * 1024);
    for (int64_t row = 0; row < 16 && r0 + row < n; row++)
        for (int64_t j = 0; j < row_bytes; j++) edge[(j / 64) * 1024 + row * 64 + j % 64] = w[(r0 + row) * row_bytes + j];
    return (left_tiles){edge, 64, 1024};
}

/* A driver thread's own sums (1024 values) and edge rows (2 ksteps KiB), and its tiles configured;
 * 1 when there was no memory for them (then no tiles either). */
typedef struct {
    void *sums;
    uint8_t *edge;
} thread_tiles;

static int thread_tiles_begin(thread_tiles *t, int64_t ksteps) {
    t->sums = aligned_alloc(64, 4096);
    t->edge = aligned_alloc(64, (size_t)2 * ksteps * 1024);
    if (!t->sums || !t->edge) return 1;
    configure_tiles();
    return 0;
}

static void thread_tiles_end(thread_tiles *t) {
    if (t->sums && t->edge) _tile_release();
    free(t->sums);
    free(t->edge);
}

static int w8_tiles(const void *w, int fp8, const float *scale, const float *bias, const float *x, float *y, int64_t m,
                int64_t n, int64_t k, int64_t num_threads) {
    const int64_t ksteps = (k + KSTEP - 1) / KSTEP, kp = ksteps * KSTEP, mp = (m + MB - 1) / MB * MB;
    const int64_t nblocks = (n + NB - 1) / NB;
    /* column blocks packed together, so that each 32-row block of inputs is read once per group */
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    const int64_t rounds = (nblocks + threads * GROUP - 1) / (threads * GROUP);
    const int64_t group = (nblocks + threads * rounds - 1) / (threads * rounds); /* even over threads */
    const int64_t ngroups = (nblocks + group - 1) / group;
    bf16 *xb = aligned_alloc(64, (size_t)(mp * kp * sizeof(bf16) + 63) / 64 * 64);
    if (!xb) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mp; i++) { /* row i's step ks: tile (i / 16, ks), its row i % 16 */
            bf16 *row = xb + (i / 16) * ksteps * 512 + (i % 16) * KSTEP;
            if (i < m) {
                int64_t ks = 0;
                for (; (ks + 1) * KSTEP <= k; ks++) /* round to nearest even, as round_bf16 */
                    _mm512_storeu_si512(row + ks * 512,
                                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i * k + ks * KSTEP + 16),
                                                                     _mm512_loadu_ps(x + i * k + ks * KSTEP)));
                for (; ks < ksteps; ks++)
                    for (int64_t j = 0; j < KSTEP; j++)
                        row[ks * 512 + j] = ks * KSTEP + j < k ? round_bf16(x[i * k + ks * KSTEP + j]) : 0;
            } else {
                for (int64_t ks = 0; ks < ksteps; ks++) memset(row + ks * 512, 0, KSTEP * sizeof(bf16));
            }
        }
        bf16 *panel = aligned_alloc(64, (size_t)GROUP * ksteps * NB * KSTEP * sizeof(bf16));
        float *c = aligned_alloc(64, MB * NB * sizeof(float));
        if (!panel || !c) failed = 1;
        if (!failed) configure_tiles();
        const int64_t panel_size = ksteps * NB * KSTEP;
#pragma omp for schedule(static)
        for (int64_t grp = 0; grp < ngroups; grp++) {
            if (failed) continue;
            const int64_t b0 = grp * group, b1 = b0 + group < nblocks ? b0 + group : nblocks;
            for (int64_t b = b0; b < b1; b++) pack_block(w, fp8, n, k, b * NB, ksteps, panel + (b - b0) * panel_size);
            for (int64_t m0 = 0; m0 < mp; m0 += MB) {
                const bf16 *a0 = xb + (m0 / 16) * ksteps * 512, *a1 = a0 + ksteps * 512;
                for (int64_t b = b0; b < b1; b++) { /* the 32 input rows stay in cache over the group */
                    const bf16 *pb = panel + (b - b0) * panel_size;
                    const int64_t n0 = b * NB;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t ks = 0; ks < ksteps; ks++) {
                        _tile_loadd(4, a0 + ks * 512, 64);
                        _tile_loadd(5, a1 + ks * 512, 64);
                        _tile_loadd(6, pb + (ks * 2 + 0) * 16 * 32, 64);
                        _tile_loadd(7, pb + (ks * 2 + 1) * 16 * 32, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c, NB * sizeof(float));
                    _tile_stored(1, c + 16, NB * sizeof(float));
                    _tile_stored(2, c + 16 * NB, NB * sizeof(float));
                    _tile_stored(3, c + 16 * NB + 16, NB * sizeof(float));
                    const int64_t rows = m - m0 < MB ? m - m0 : MB, cols = n - n0 < NB ? n - n0 : NB;
                    for (int64_t i = 0; i < rows; i++) {
                        float *out = y + (m0 + i) * n + n0;
                        const float *sums = c + i * NB;
                        if (bias)
                            for (int64_t j = 0; j < cols; j++) out[j] = sums[j] * scale[n0 + j] + bias[n0 + j];
                        else
                            for (int64_t j = 0; j < cols; j++) out[j] = sums[j] * scale[n0 + j];
                    }
                }
            }
        }
        if (panel && c) _tile_release();
        free(panel);
        free(c);
    }
    free(xb);
    return failed ? -1 : 0;
}

/* The right tiles of 16 inputs: b[ks][r][i][2] = x[i][32 ks + 2 r + {0, 1}], zeros past m and k. */
static void pack_inputs(const bf16 *x, int64_t m, int64_t k, int64_t ksteps, bf16 *b) {
    for (int64_t ks = 0; ks < ksteps; ks++) {
        __m512i r[16];
        const int64_t j = ks * KSTEP, left = k - j < KSTEP ? k - j : KSTEP;
        const __mmask32 mask = left == KSTEP ? (__mmask32)~0u : (__mmask32)((1u << left) - 1u);
        for (int i = 0; i < 16; i++)
            r[i] = i < m ? _mm512_maskz_loadu_epi16(mask, x + i * k + j) : _mm512_setzero_si512();
        transpose16(r);
        for (int row = 0; row < 16; row++) _mm512_storeu_si512(b + ks * 512 + row * 32, r[row]);
    }
}

/* Weight rows [n0, min(n0 + 32, r_end)) of y = x . W^T (+ bias) for the m inputs `xb` packed by
 * pack_inputs (blocks of 16), into y[i * y_stride + r - n0] rounded to bf16 once, or (y_f32) into
 * y_f32 at the same place as that rounded value widened. W has n rows of k values; the caller has
 * configured the tiles. c: 1024 floats; edge: 2 ksteps KiB. */
static void rows_bf16(const bf16 *w, const bf16 *bias, int64_t n, int64_t k, int64_t ksteps, const bf16 *xb,
                      int64_t m, int64_t n0, int64_t r_end, bf16 *y, float *y_f32, int64_t y_stride, float *c,
                      uint8_t *edge) {
    const int64_t mblocks = (m + 15) / 16;
    const left_tiles a0 = left_rows((const uint8_t *)w, n, k * 2, n0, ksteps, edge),
                     a1 = left_rows((const uint8_t *)w, n, k * 2, n0 + 16, ksteps, edge + ksteps * 1024);
    for (int64_t mb = 0; mb < mblocks; mb += 2) {
        const bf16 *b0 = xb + mb * ksteps * 512, *b1 = b0 + ksteps * 512;
        const int two = mb + 1 < mblocks;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < ksteps; ks++) {
            _tile_loadd(4, a0.base + ks * a0.step, a0.stride);
            _tile_loadd(5, a1.base + ks * a1.step, a1.stride);
            _tile_loadd(6, b0 + ks * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                _tile_loadd(7, b1 + ks * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        /* c[t][j][i]: weight row n0 + 16 (t / 2) + j, input 16 (mb + t % 2) + i */
        _tile_stored(0, c, 64);
        _tile_stored(2, c + 512, 64);
        if (two) {
            _tile_stored(1, c + 256, 64);
            _tile_stored(3, c + 768, 64);
        }
        for (int t = 0; t < 4; t++) { /* 16 x 16 sums turned to input-major, each input a vector over rows */
            if (t % 2 && !two) continue;
            const int64_t r0 = n0 + 16 * (t / 2), i0 = 16 * (mb + t % 2);
            if (r0 >= r_end) continue;
            const __mmask16 keep = first_lanes(r_end - r0);
            const __m512 add = bias ? widen_bf16x16(_mm256_maskz_loadu_epi16(keep, bias + r0)) : _mm512_setzero_ps();
            const float *sums = c + 256 * (t % 2) + 512 * (t / 2);
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_load_si512(sums + 16 * j);
            transpose16(r);
            for (int64_t i = 0; i < 16 && i0 + i < m; i++) {
                const __m512i v = narrow_bf16x16(_mm512_add_ps(_mm512_castsi512_ps(r[i]), add));
                const int64_t at = (i0 + i) * y_stride + r0 - n0;
                if (y_f32)
                    _mm512_mask_storeu_ps(y_f32 + at, keep, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
                else
                    _mm256_mask_storeu_epi16(y + at, keep, _mm512_cvtepi32_epi16(v));
            }
        }
    }
}

static int bf16_tiles(const bf16 *w, const bf16 *bias, const bf16 *x, bf16 *y, int64_t m, int64_t n, int64_t k,
                      int64_t num_threads) {
    const int64_t ksteps = (k + KSTEP - 1) / KSTEP, mblocks = (m + 15) / 16, nblocks = (n + NB - 1) / NB;
    bf16 *xb = aligned_alloc(64, (size_t)mblocks * ksteps * 512 * sizeof(bf16));
    if (!xb) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t mb = 0; mb < mblocks; mb++) pack_inputs(x + mb * 16 * k, m - mb * 16, k, ksteps, xb + mb * ksteps * 512);
        thread_tiles tt;
        failed |= thread_tiles_begin(&tt, ksteps);
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++)
            if (!failed) rows_bf16(w, bias, n, k, ksteps, xb, m, nb * NB, n, y + nb * NB, 0, n, tt.sums, tt.edge);
        thread_tiles_end(&tt);
    }
    free(xb);
    return failed ? -1 : 0;
}

/* ---- the bf16 GEMM's pieces for a caller's own parallel region (cpu_decode_step.c) ---------
 * Each thread of the region calls amx_tiles_begin once (0, or -2 where AMX is not usable), packs
 * the inputs it multiplies into its own scratch (amx_pack_bf16), computes its share of rows
 * (amx_rows_bf16, any rows: blocks of 32 from r0) and calls amx_tiles_end before the region ends.
 * The same tiles and arithmetic as gemm_bf16_amx, so the same numbers. */
static void tiles_end(void) { _tile_release(); }

static void pack_bf16_part(const bf16 *x, int64_t m, int64_t k, void *scratch) {
    const int64_t ksteps = (k + KSTEP - 1) / KSTEP;
    for (int64_t mb = 0; mb < (m + 15) / 16; mb++)
        pack_inputs(x + mb * 16 * k, m - mb * 16, k, ksteps, (bf16 *)scratch + mb * ksteps * 512);
}

/* y = x . W^T (+ bias) for W's rows [r0, r1) and the m inputs amx_pack_bf16 packed (k values each)
 * into `scratch`, sized by amx_scratch_bytes(0, m_max, k_max): y[i * y_stride + r - r0] in bf16, or
 * (y_f32) the bf16-rounded value widened. */
static void rows_bf16_part(const bf16 *w, const bf16 *bias, int64_t n, int64_t k, int64_t m, int64_t r0, int64_t r1,
                           bf16 *y, float *y_f32, int64_t y_stride, void *scratch, int64_t m_max, int64_t k_max) {
    const int64_t ksteps = (k + KSTEP - 1) / KSTEP;
    const scratch_layout at = layout_of(0, m_max, k_max);
    uint8_t *base = scratch;
    for (int64_t n0 = r0; n0 < r1; n0 += NB)
        rows_bf16(w, bias, n, k, ksteps, (const bf16 *)base, m, n0, r1, y ? y + (n0 - r0) : 0,
                  y_f32 ? y_f32 + (n0 - r0) : 0, y_stride, (float *)(base + at.sums), base + at.edge);
}

/* ---- int8 weights, 16-bit inputs (W8A16) on AMX-INT8 ------------------------------------------
 * As gemm_i8 with input_bits=16 (cpu_gemm_int8.c), with the same integers: each input row
 * rounded to q = round(x / s), s = max|x| / 32767, split as q = 256 hi + lo (hi = q >> 8 signed,
 * lo = q & 255 unsigned); the weight's rows, read in place as left tiles (16 rows x 64 bytes),
 * multiply the packed planes (TDPBSSD for hi, TDPBSUD for lo: int32 sums), and
 * y = (256 hi_sum + lo_sum) * (s * scale[n]) (+ bias[n]), as there. */
/* Input rows [0, 16) of x (m of them) rounded to 16 bits, as the right tiles of their two planes:
 * planes[p][ks][r][i][4] = plane p of x[i][64 ks + 4 r + {0..3}], zeros past m and k; s[i] their scales. */
static void pack_planes(const float *x, int64_t m, int64_t k, int64_t ksteps, uint8_t *hi, uint8_t *lo, float *s) {
    uint8_t rows[2][16][KSTEP8] __attribute__((aligned(64)));
    float inv[16];
    for (int i = 0; i < 16 && i < m; i++) {
        __m512 amax = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= k; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i * k + j)));
        float a = _mm512_reduce_max_ps(amax);
        for (; j < k; j++) a = fmaxf(a, fabsf(x[i * k + j]));
        s[i] = a > 0.0f ? a / 32767.0f : 1.0f;
        inv[i] = 1.0f / s[i];
    }
    for (int64_t ks = 0; ks < ksteps; ks++) {
        const int64_t j0 = ks * KSTEP8, left = k - j0 < KSTEP8 ? k - j0 : KSTEP8;
        for (int i = 0; i < 16; i++)
            for (int v = 0; v < 4; v++) {
                const int64_t have = left - 16 * v;
                __m512i q = _mm512_setzero_si512();
                if (i < m && have > 0) { /* nearest, ties even: rintf under the default rounding */
                    const __m512 f = _mm512_maskz_loadu_ps(first_lanes(have), x + i * k + j0 + 16 * v);
                    q = _mm512_cvtps_epi32(_mm512_mul_ps(f, _mm512_set1_ps(inv[i])));
                }
                _mm_storeu_si128((__m128i *)(rows[0][i] + 16 * v), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 8)));
                _mm_storeu_si128((__m128i *)(rows[1][i] + 16 * v),
                                 _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
            }
        for (int p = 0; p < 2; p++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(rows[p][i]);
            transpose16(r);
            uint8_t *dst = (p ? lo : hi) + ks * 1024;
            for (int row = 0; row < 16; row++) _mm512_storeu_si512(dst + row * 64, r[row]);
        }
    }
}

/* Weight rows [n0, min(n0 + 32, r_end)) of the W8A16 product for the m inputs packed by pack_planes
 * (blocks of 16: the hi plane, then the lo plane, `plane` bytes each; sx their scales), into
 * y[i * y_stride + r - n0]. The caller has configured the tiles. c: 1024 int32; edge: 2 ksteps KiB. */
static void rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t n, int64_t k, int64_t ksteps,
                    const uint8_t *xb, size_t plane, const float *sx, int64_t m, int64_t n0, int64_t r_end, float *y,
                    int64_t y_stride, int32_t *c, uint8_t *edge) {
    const left_tiles a0 = left_rows((const uint8_t *)w, n, k, n0, ksteps, edge),
                     a1 = left_rows((const uint8_t *)w, n, k, n0 + 16, ksteps, edge + ksteps * 1024);
    for (int64_t mb = 0; mb < (m + 15) / 16; mb++) {
        const uint8_t *bh = xb + 2 * plane * mb, *bl = bh + plane;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < ksteps; ks++) {
            _tile_loadd(4, a0.base + ks * a0.step, a0.stride);
            _tile_loadd(5, a1.base + ks * a1.step, a1.stride);
            _tile_loadd(6, bh + ks * 1024, 64);
            _tile_loadd(7, bl + ks * 1024, 64);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
        }
        /* c[t]: t / 2 = the plane (hi, lo), t % 2 = the 16 weight rows; [row][input] */
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 512, 64);
        _tile_stored(2, c + 256, 64);
        _tile_stored(3, c + 768, 64);
        for (int t = 0; t < 2; t++) { /* the sums turned to input-major, as in rows_bf16 */
            const int64_t r0 = n0 + 16 * t, i0 = 16 * mb;
            if (r0 >= r_end) continue;
            const __mmask16 keep = first_lanes(r_end - r0);
            const __m512 sc = _mm512_maskz_loadu_ps(keep, scale + r0);
            const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + r0) : _mm512_setzero_ps();
            __m512i his[16], los[16];
            for (int j = 0; j < 16; j++) {
                his[j] = _mm512_load_si512(c + 256 * t + 16 * j);
                los[j] = _mm512_load_si512(c + 512 + 256 * t + 16 * j);
            }
            transpose16(his);
            transpose16(los);
            for (int64_t i = 0; i < 16 && i0 + i < m; i++) {
                /* the barriers keep gemm_i8's order under -ffast-math: dot * (s * scale), then the bias */
                __m512 dot = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(his[i]), _mm512_set1_ps(256.0f)),
                                           _mm512_cvtepi32_ps(los[i]));
                __m512 both = _mm512_mul_ps(_mm512_set1_ps(sx[i0 + i]), sc);
                __asm__("" : "+v"(dot), "+v"(both));
                __m512 v = _mm512_mul_ps(dot, both);
                __asm__("" : "+v"(v));
                if (bias) v = _mm512_add_ps(v, add);
                _mm512_mask_storeu_ps(y + (i0 + i) * y_stride + r0 - n0, keep, v);
            }
        }
    }
}

static int i8_tiles(const int8_t *w, const float *scale, const float *bias, const float *x, float *y, int64_t m,
                    int64_t n, int64_t k, int64_t num_threads) {
    const int64_t ksteps = (k + KSTEP8 - 1) / KSTEP8, mblocks = (m + 15) / 16, nblocks = (n + NB - 1) / NB;
    const size_t plane = (size_t)ksteps * 1024; /* one 16-input block's plane */
    uint8_t *xb = aligned_alloc(64, 2 * plane * mblocks + 64 * ((mblocks * 16 * sizeof(float) + 63) / 64));
    if (!xb) return -1;
    float *sx = (float *)(xb + 2 * plane * mblocks);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t mb = 0; mb < mblocks; mb++)
            pack_planes(x + mb * 16 * k, m - mb * 16, k, ksteps, xb + 2 * plane * mb, xb + 2 * plane * mb + plane,
                        sx + mb * 16);
        thread_tiles tt;
        failed |= thread_tiles_begin(&tt, ksteps);
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++)
            if (!failed)
                rows_i8(w, scale, bias, n, k, ksteps, xb, plane, sx, m, nb * NB, n, y + nb * NB, n, tt.sums, tt.edge);
        thread_tiles_end(&tt);
    }
    free(xb);
    return failed ? -1 : 0;
}

/* The int8 GEMM in pieces, as the bf16 one's above, in a scratch of amx_scratch_bytes(1, m_max, k_max). */
static void pack_i8_part(const float *x, int64_t m, int64_t k, void *scratch, int64_t m_max, int64_t k_max) {
    const int64_t ksteps = (k + KSTEP8 - 1) / KSTEP8, plane = ksteps * 1024;
    uint8_t *xb = scratch;
    float *sx = (float *)(xb + layout_of(1, m_max, k_max).scales);
    for (int64_t mb = 0; mb < (m + 15) / 16; mb++)
        pack_planes(x + mb * 16 * k, m - mb * 16, k, ksteps, xb + 2 * plane * mb, xb + 2 * plane * mb + plane,
                    sx + mb * 16);
}

static void rows_i8_part(const int8_t *w, const float *scale, const float *bias, int64_t n, int64_t k, int64_t m,
                         int64_t r0, int64_t r1, float *y, int64_t y_stride, void *scratch, int64_t m_max,
                         int64_t k_max) {
    const int64_t ksteps = (k + KSTEP8 - 1) / KSTEP8;
    const scratch_layout at = layout_of(1, m_max, k_max);
    uint8_t *xb = scratch;
    for (int64_t n0 = r0; n0 < r1; n0 += NB)
        rows_i8(w, scale, bias, n, k, ksteps, xb, (size_t)ksteps * 1024, (const float *)(xb + at.scales), m, n0, r1,
                y + (n0 - r0), y_stride, (int32_t *)(xb + at.sums), xb + at.edge);
}

#pragma GCC pop_options
#endif

/* ---- the entry points: plain code, built for the baseline of the rest of the library ----------
 * The bodies above may execute AVX-512 and AMX instructions from their first one (a prologue
 * that spills to a ZMM register), so the check that the CPU and kernel allow them runs here,
 * outside the target region, before any of them is called. */
int64_t amx_scratch_bytes(int64_t int8, int64_t m, int64_t k) { return layout_of(int8 != 0, m, k).bytes; }

int gemm_w8_amx(const void *w, int fp8, const float *scale, const float *bias, const float *x, float *y, int64_t m,
                int64_t n, int64_t k, int64_t num_threads) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) return w8_tiles(w, fp8, scale, bias, x, y, m, n, k, num_threads);
#endif
    (void)w, (void)fp8, (void)scale, (void)bias, (void)x, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return -2;
}

int gemm_bf16_amx(const bf16 *w, const bf16 *bias, const bf16 *x, bf16 *y, int64_t m, int64_t n, int64_t k,
                  int64_t num_threads) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) return bf16_tiles(w, bias, x, y, m, n, k, num_threads);
#endif
    (void)w, (void)bias, (void)x, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return -2;
}

int gemm_i8_amx(const int8_t *w, const float *scale, const float *bias, const float *x, float *y, int64_t m,
                int64_t n, int64_t k, int64_t num_threads) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) return i8_tiles(w, scale, bias, x, y, m, n, k, num_threads);
#endif
    (void)w, (void)scale, (void)bias, (void)x, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return -2;
}

/* The pieces for a caller's own parallel region (cpu_decode_step.c): amx_tiles_begin is -2 where
 * AMX is not usable, and the other pieces then do nothing. */
int64_t amx_tiles_begin(void) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) {
        configure_tiles();
        return 0;
    }
#endif
    return -2;
}

void amx_tiles_end(void) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) tiles_end();
#endif
}

void amx_pack_bf16(const bf16 *x, int64_t m, int64_t k, void *scratch) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) pack_bf16_part(x, m, k, scratch);
#endif
    (void)x, (void)m, (void)k, (void)scratch;
}

void amx_rows_bf16(const bf16 *w, const bf16 *bias, int64_t n, int64_t k, int64_t m, int64_t r0, int64_t r1,
                   bf16 *y, float *y_f32, int64_t y_stride, void *scratch, int64_t m_max, int64_t k_max) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) rows_bf16_part(w, bias, n, k, m, r0, r1, y, y_f32, y_stride, scratch, m_max, k_max);
#endif
    (void)w, (void)bias, (void)n, (void)k, (void)m, (void)r0, (void)r1, (void)y, (void)y_f32, (void)y_stride;
    (void)scratch, (void)m_max, (void)k_max;
}

void amx_pack_i8(const float *x, int64_t m, int64_t k, void *scratch, int64_t m_max, int64_t k_max) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) pack_i8_part(x, m, k, scratch, m_max, k_max);
#endif
    (void)x, (void)m, (void)k, (void)scratch, (void)m_max, (void)k_max;
}

void amx_rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t n, int64_t k, int64_t m, int64_t r0,
                 int64_t r1, float *y, int64_t y_stride, void *scratch, int64_t m_max, int64_t k_max) {
#ifdef HAVE_AMX_BUILD
    if (amx_usable() == 1) rows_i8_part(w, scale, bias, n, k, m, r0, r1, y, y_stride, scratch, m_max, k_max);
#endif
    (void)w, (void)scale, (void)bias, (void)n, (void)k, (void)m, (void)r0, (void)r1, (void)y, (void)y_stride;
    (void)scratch, (void)m_max, (void)k_max;
}
