/* y[M][N] = (x[M][K] . W[N][K]^T) * scale[N] (+ bias[N]) on AMX: 8-bit weights (int8 or
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
 * Built with AMX off (cpu_native.py); these functions turn it on for themselves. Callers must
 * have checked amx_usable() (cpu_isa.c), which asks the kernel for the tile state: without it
 * the first tile instruction is an illegal instruction. gemm_w8_amx refuses (returns -2) when it
 * has not been granted. */
#include "cpu_kernels.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int64_t amx_usable(void);

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")
#include <immintrin.h>
#define HAVE_AMX_BUILD 1

#define KSTEP 32 /* bf16 values of K per tile row */
#define NB 32    /* columns per block: two B tiles */
#define MB 32    /* rows per block: two A tiles */
#define GROUP 4  /* column blocks at most per group */

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

int gemm_w8_amx(const void *w, int fp8, const float *scale, const float *bias, const float *x, float *y, int64_t m,
                int64_t n, int64_t k, int64_t num_threads) {
    if (amx_usable() != 1) return -2;
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
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        if (!failed) _tile_loadconfig(&cfg);
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
#pragma GCC pop_options
#else
int gemm_w8_amx(const void *w, int fp8, const float *scale, const float *bias, const float *x, float *y, int64_t m,
                int64_t n, int64_t k, int64_t num_threads) {
    (void)w, (void)fp8, (void)scale, (void)bias, (void)x, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return -2;
}
#endif
