/* bfloat16 linear layers on the CPU's bfloat16 units: y[M, N] = x[M, K] @ W^T + b, x and y
 * bfloat16, W packed once at load, sums in float32 rounded to bfloat16 once (nearest-even, as torch
 * rounds). Built at first use by kernels/build.py for bf16_linear.py; signatures: kernels.h.
 *
 * Both kernels read one packing, [N/32][K/32][2][16][16][2]: per 32-column strip and 32-wide k
 * step, two blocks (columns 0-15, 16-31) of 16 k pairs by 16 columns. That is an AMX B tile for
 * tdpbf16ps, and for AVX512-BF16's vdpbf16ps 16 registers, each one k pair of 16 columns.
 *   amx_linear_bf16: AMX tiles (Intel Sapphire Rapids on).
 *   dot_linear_bf16: AVX512-BF16 dot products (AMD Zen 4, Intel Cooper Lake on).
 * In both, each output element is one chain of the unit's pair dot products over k in one order
 * from zero, then its bias: a row's bits depend on its own inputs only, not on the rows beside
 * it, their number or the thread, so a call takes any number of rows. Both units treat denormal
 * inputs and results as zero, whatever MXCSR says (torch's own bfloat16 GEMMs run on them too).
 */
#include "kernels.h"

#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11)
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>
#include <omp.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* amx_linear_bf16: each output element is the tile unit's dot products over k = 0, 32, 64, ... in
 * that order (oneDNN's AMX kernel, by contrast, blocks K by the row count, so rows 33-512 get
 * other bits than 1-32 on a Sapphire Rapids).
 *
 * Each thread takes a contiguous run of the 32-column strips: its share of the weights, read
 * front to back (what a decode step's few rows are bound by), the next strip prefetched while
 * the tile unit works on this one. It passes them over the rows in chunks of about
 * CHUNK_BYTES of x, which stays in the core's L2 meanwhile; per strip, each 32-row block of
 * the chunk runs on a 2x2 block of tiles (four float32 accumulators over all of K, each A and B
 * tile loaded once per k step and used twice); a last block of fewer rows runs on tiles
 * configured to its row count. */
int amx_bf16_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0; /* AMX-BF16, AMX-TILE */
    if (!((b >> 16) & 1)) return 0;                         /* AVX512F, for the rounding */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* A row's 16 sums plus their bias, rounded to bfloat16 as torch rounds (nearest-even, a NaN kept
 * quiet), the first `n` (<= 16) stored. */
__attribute__((target("avx512f"), always_inline)) static inline void store_bf16(
    const float *sums, const float *bias, uint16_t *y, int n) {
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums),
                                   bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps());
    const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    rounded = _mm512_mask_or_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), high,
                                   _mm512_set1_epi32(0x40));
    _mm512_mask_cvtepi32_storeu_epi16(y, keep, rounded);
}

/* Bytes of x a chunk of rows holds: the chunk stays in the core's L2 (2 MiB on Sapphire Rapids)
 * while every strip passes over it. 128-row chunks read the weights again for every 128 rows,
 * from L3 or memory: a 540-row step of the default model ran its linears 1.25x slower so. */
#define CHUNK_BYTES (1 << 20)

/* A block's float32 sums (rows of 32) still to be rounded into y. */
typedef struct {
    const float *sums, *bias;
    uint16_t *y;
    int64_t ldy, rows, cols;
} bf16_block;

__attribute__((target("avx512f"), always_inline)) static inline void store_block(const bf16_block *p) {
    for (int64_t r = 0; r < p->rows; r++)
        for (int64_t c = 0; c < p->cols; c += 16)
            store_bf16(p->sums + r * 32 + c, p->bias ? p->bias + c : 0, p->y + r * p->ldy + c,
                       p->cols - c < 16 ? (int)(p->cols - c) : 16);
}

/* Tiles for a block of `rows` (1-32) rows: accumulators 0, 1 and A tile 4 take its first 16, 2, 3
 * and 5 the rest (unused at 16 or fewer); B tiles 6 and 7 hold 16 k pairs by 16 columns. A row's
 * sums do not depend on how many rows its tiles hold. */
__attribute__((target("amx-tile"), always_inline)) static inline void amx_configure(int64_t rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int top = rows < 16 ? (int)rows : 16, bottom = rows > 16 ? (int)rows - 16 : 0;
    const int tile_rows[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)tile_rows[t];
        cfg.colsb[t] = tile_rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* 1-16 or 17-32 rows of A (rows lda apart) times one 32-column strip of B over all K steps, into `out`
 * [32][32] float32: the 2x2 tile block, each A and B tile loaded once per step. The previous
 * block is rounded and stored after this one's tile products are issued, so that the vector
 * units do it while the tile unit works through them; `ahead_lines` cache lines from `ahead`
 * are prefetched over the steps. */
__attribute__((target("amx-tile,amx-bf16,avx512f"), always_inline)) static inline void amx_block(
    const uint16_t *a, int64_t lda, const int two, const uint16_t *b, int64_t steps,
    const bf16_block *previous, float *out, const char *ahead, int64_t ahead_lines) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const int64_t per_step = (ahead_lines + steps - 1) / steps;
    for (int64_t s = 0; s < steps; s++) {
        for (int64_t l = s * per_step; l < (s + 1) * per_step && l < ahead_lines; l++)
            _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
        _tile_loadd(6, b + s * 1024, 64);
        _tile_loadd(4, a + s * 32, lda * 2);
        _tile_loadd(7, b + s * 1024 + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a + 16 * lda + s * 32, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    store_block(previous);
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
    if (two) {
        _tile_stored(2, out + 16 * 32, 128);
        _tile_stored(3, out + 16 * 32 + 16, 128);
    }
}

__attribute__((target("amx-tile,amx-bf16,avx512f"))) void amx_linear_bf16(
    const void *xv, int64_t ldx, const void *wv, const float *bias, void *yv, int64_t ldy, int64_t M, int64_t K,
    int64_t N) {
    const uint16_t *x = xv, *w = wv;
    uint16_t *y = yv;
    const int64_t steps = K / 32, strips = (N + 31) / 32, tail = M % 32;
    _Pragma("omp parallel")
    {
        amx_configure(M < 32 ? M : 32);
        float out[2][32 * 32] __attribute__((aligned(64)));
        bf16_block pending = {0};
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = strips * thread / threads, end = strips * (thread + 1) / threads;
        const int64_t fit = CHUNK_BYTES / (K * 2) / 32 * 32, chunk = fit > 32 ? fit : 32;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t m_end = M - m0 < chunk ? M : m0 + chunk;
            for (int64_t strip = first; strip < end; strip++) {
                const uint16_t *b = w + strip * steps * 1024;
                const int64_t cols = N - strip * 32 < 32 ? N - strip * 32 : 32;
                for (int64_t m = m0; m < m_end; m += 32) {
                    const int64_t rows = M - m < 32 ? M - m : 32;
                    /* The tail block after 32-row ones: its tiles shrunk for it, then restored. */
                    const int switched = rows < 32 && M > 32;
                    if (switched) amx_configure(tail);
                    float *sums = out[pending.sums == out[0]];
                    /* This block's share of the thread's next strip, prefetched into L2 while
                     * the tile unit works: the hardware's prefetchers left the first block of
                     * each strip waiting on L3 or memory. */
                    const int64_t blocks = (m_end - m0 + 31) / 32, j = (m - m0) / 32;
                    const int64_t lines = strip + 1 < end ? steps * 32 : 0;
                    const char *ahead = (const char *)(b + steps * 1024) + lines * j / blocks * 64;
                    const int64_t ahead_lines = lines * (j + 1) / blocks - lines * j / blocks;
                    if (rows > 16)
                        amx_block(x + m * ldx, ldx, 1, b, steps, &pending, sums, ahead, ahead_lines);
                    else
                        amx_block(x + m * ldx, ldx, 0, b, steps, &pending, sums, ahead, ahead_lines);
                    if (switched) amx_configure(32);
                    pending = (bf16_block){sums, bias ? bias + strip * 32 : 0, y + m * ldy + strip * 32,
                                            ldy, rows, cols};
                }
            }
        }
        store_block(&pending);
        _tile_release();
    }
}


/* Rows a dot block holds: 12 rows by 32 columns of float32 sums are 24 of the 32 registers. */
#define DOT_ROWS 12

int dot_bf16_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((b >> 16) & 1)) return 0; /* AVX512F */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0;  /* AVX512-BF16 */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0;           /* OSXSAVE */
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xe6) == 0xe6; /* the OS saves the zmm and mask registers */
}

/* `rows` (1-DOT_ROWS, a constant where inlined) rows of x times one 32-column strip over all K
 * steps into `out` [rows][32] float32: per k pair, two weight registers and one broadcast of each
 * row's pair. `ahead_lines` cache lines from `ahead` (the next strip) are prefetched over the steps:
 * a decode step's single block per strip would otherwise wait on memory at each strip's start. */
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void dot_block(
    const uint16_t *x, int64_t ldx, int rows, const uint16_t *b, int64_t steps, float *out,
    const char *ahead, int64_t ahead_lines) {
    __m512 acc[DOT_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t per_step = (ahead_lines + steps - 1) / steps;
    for (int64_t s = 0; s < steps; s++) {
        for (int64_t l = s * per_step; l < (s + 1) * per_step && l < ahead_lines; l++)
            _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
        const uint16_t *step = b + s * 1024;
        for (int p = 0; p < 16; p++) {
            const __m512bh left = (__m512bh)_mm512_loadu_si512(step + p * 32);
            const __m512bh right = (__m512bh)_mm512_loadu_si512(step + 512 + p * 32);
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, x + r * ldx + s * 32 + 2 * p, sizeof pair);
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, left);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, right);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_store_ps(out + r * 32, acc[r][0]);
        _mm512_store_ps(out + r * 32 + 16, acc[r][1]);
    }
}

#define DOT_CASE(R) \
    case R: dot_block(x + m * ldx, ldx, R, b, steps, out, ahead, ahead_lines); break;

/* The AMX kernel's loop (threads on contiguous strips, rows in chunks that stay in L2), in blocks
 * of DOT_ROWS rows. */
__attribute__((target("avx512f,avx512bf16"))) void dot_linear_bf16(
    const void *xv, int64_t ldx, const void *wv, const float *bias, void *yv, int64_t ldy, int64_t M, int64_t K,
    int64_t N) {
    const uint16_t *x = xv, *w = wv;
    uint16_t *y = yv;
    const int64_t steps = K / 32, strips = (N + 31) / 32;
    const int64_t fit = CHUNK_BYTES / (K * 2) / DOT_ROWS * DOT_ROWS, chunk = fit > DOT_ROWS ? fit : DOT_ROWS;
    _Pragma("omp parallel")
    {
        float out[DOT_ROWS * 32] __attribute__((aligned(64)));
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = strips * thread / threads, end = strips * (thread + 1) / threads;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t m_end = M - m0 < chunk ? M : m0 + chunk;
            const int64_t blocks = (m_end - m0 + DOT_ROWS - 1) / DOT_ROWS;
            for (int64_t strip = first; strip < end; strip++) {
                const uint16_t *b = w + strip * steps * 1024;
                const int64_t cols = N - strip * 32 < 32 ? N - strip * 32 : 32;
                const int64_t lines = strip + 1 < end ? steps * 32 : 0;
                for (int64_t m = m0; m < m_end; m += DOT_ROWS) {
                    const int64_t j = (m - m0) / DOT_ROWS;
                    const char *ahead = (const char *)(b + steps * 1024) + lines * j / blocks * 64;
                    const int64_t ahead_lines = lines * (j + 1) / blocks - lines * j / blocks;
                    const int rows = m_end - m < DOT_ROWS ? (int)(m_end - m) : DOT_ROWS;
                    switch (rows) {
                        DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6)
                        DOT_CASE(7) DOT_CASE(8) DOT_CASE(9) DOT_CASE(10) DOT_CASE(11) DOT_CASE(12)
                    }
                    store_block(&(bf16_block){out, bias ? bias + strip * 32 : 0, y + m * ldy + strip * 32,
                                              ldy, rows, cols});
                }
            }
        }
    }
}

int bf16_linear_supported(void) { return amx_bf16_supported() || dot_bf16_supported(); }

#else

int bf16_linear_supported(void) { return 0; }
int amx_bf16_supported(void) { return 0; }
int dot_bf16_supported(void) { return 0; }

#endif
