/* Grouped GEMM for a step's experts: y[rows of group g] = x[rows of g] @ W[expert of g]^T + b,
 * x and y float32, W float32 or bfloat16 (widened to float32 as it is read).
 *
 * Every output element is one fused multiply-add chain over k = 0..K-1 from zero, then the bias
 * added: the same operations in the same order whatever the group's row count, the tile the
 * row lands in, or the thread that runs it. So a row's bits never depend on its batch, with no
 * padding rows (compare models/layers/linear.py, where a library kernel's rule has to be probed).
 *
 * Weights are packed once at load into strips of 16 output columns, [E][N/16][K][16], so that a
 * strip is read front to back: a decode step's few rows per expert are bound by reading the
 * weights, and a sequential stream is what the memory system serves fastest. Work items are
 * (group, strip) pairs spread over torch's OpenMP threads (the process shares torch's libgomp,
 * so this reuses its thread team).
 *
 * Built at first use by models/kernels/grouped_gemm.py; x86-64 with AVX2 and FMA, else unsupported.
 * The file also holds amx_linear_bf16 (below), a bfloat16 linear layer on AMX tiles.
 */
#include <stdint.h>

#define STRIP 16
#define MAX_ROWS 6

#if defined(__x86_64__)
#include <immintrin.h>

int grouped_gemm_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* Eight weights of a strip row as floats: float32 as stored, bfloat16 widened (exact). */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 load_f32(const float *w) {
    return _mm256_loadu_ps(w);
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 load_bf16(const uint16_t *w) {
    __m128i half = _mm_loadu_si128((const __m128i *)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* One tile: `rows` (<= MAX_ROWS) rows of x times one strip, `cols` (<= 16) columns stored. */
#define DEFINE_TILE(NAME, WTYPE, LOAD)                                                           \
    __attribute__((target("avx2,fma"), always_inline)) static inline void NAME(                  \
        const float *x, int64_t ldx, const int rows, const WTYPE *w, int64_t K, float *y,        \
        int64_t ldy, int cols, const float *bias) {                                              \
        __m256 lo[MAX_ROWS], hi[MAX_ROWS];                                                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {                                 \
            lo[r] = _mm256_setzero_ps();                                                         \
            hi[r] = _mm256_setzero_ps();                                                         \
        }                                                                                        \
        for (int64_t k = 0; k < K; k++) {                                                        \
            __m256 w_lo = LOAD(w + k * STRIP), w_hi = LOAD(w + k * STRIP + 8);                   \
            _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {                             \
                __m256 xk = _mm256_broadcast_ss(x + r * ldx + k);                                \
                lo[r] = _mm256_fmadd_ps(xk, w_lo, lo[r]);                                        \
                hi[r] = _mm256_fmadd_ps(xk, w_hi, hi[r]);                                        \
            }                                                                                    \
        }                                                                                        \
        __m256 b_lo = _mm256_setzero_ps(), b_hi = _mm256_setzero_ps();                           \
        if (bias) {                                                                              \
            b_lo = _mm256_loadu_ps(bias);                                                        \
            b_hi = _mm256_loadu_ps(bias + 8);                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {                                 \
            float out[STRIP];                                                                    \
            _mm256_storeu_ps(out, bias ? _mm256_add_ps(lo[r], b_lo) : lo[r]);                    \
            _mm256_storeu_ps(out + 8, bias ? _mm256_add_ps(hi[r], b_hi) : hi[r]);                \
            for (int c = 0; c < cols; c++) y[r * ldy + c] = out[c];                              \
        }                                                                                        \
    }

/* x [*, K] float32 (row stride ldx); w packed [E][strips][K][16]; bias packed [E][strips * 16]
 * float32 or NULL; y [*, N] float32 (row stride ldy); groups [G][3]: expert, first row, rows. */
#define DEFINE_KERNEL(NAME, TILE, WTYPE)                                                         \
    __attribute__((target("avx2,fma"))) void NAME(                                               \
        const float *x, int64_t ldx, const WTYPE *w, const float *bias, float *y, int64_t ldy,   \
        const int64_t *groups, int64_t G, int64_t K, int64_t N) {                                \
        const int64_t strips = (N + STRIP - 1) / STRIP;                                          \
        _Pragma("omp parallel for schedule(dynamic, 4)")                                        \
        for (int64_t item = 0; item < G * strips; item++) {                                      \
            const int64_t g = item / strips, s = item % strips;                                  \
            const int64_t e = groups[3 * g], first = groups[3 * g + 1], count = groups[3 * g + 2]; \
            const WTYPE *ws = w + (e * strips + s) * K * STRIP;                                  \
            const float *bs = bias ? bias + (e * strips + s) * STRIP : 0;                        \
            const int cols = N - s * STRIP < STRIP ? (int)(N - s * STRIP) : STRIP;               \
            for (int64_t r = 0; r < count; r += MAX_ROWS) {                                      \
                const float *xr = x + (first + r) * ldx;                                         \
                float *yr = y + (first + r) * ldy + s * STRIP;                                   \
                switch (count - r < MAX_ROWS ? count - r : MAX_ROWS) {                           \
                case 1: TILE(xr, ldx, 1, ws, K, yr, ldy, cols, bs); break;                       \
                case 2: TILE(xr, ldx, 2, ws, K, yr, ldy, cols, bs); break;                       \
                case 3: TILE(xr, ldx, 3, ws, K, yr, ldy, cols, bs); break;                       \
                case 4: TILE(xr, ldx, 4, ws, K, yr, ldy, cols, bs); break;                       \
                case 5: TILE(xr, ldx, 5, ws, K, yr, ldy, cols, bs); break;                       \
                default: TILE(xr, ldx, 6, ws, K, yr, ldy, cols, bs); break;                      \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_TILE(tile_f32, float, load_f32)
DEFINE_TILE(tile_bf16, uint16_t, load_bf16)
DEFINE_KERNEL(grouped_gemm_f32, tile_f32, float)
DEFINE_KERNEL(grouped_gemm_bf16, tile_bf16, uint16_t)


#if defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11) /* AMX intrinsics, arch_prctl */
/* A bfloat16 linear layer on AMX: y[M, N] = x[M, K] @ W^T + b, x and y bfloat16, W packed at load
 * into tiles, sums in float32 (rounded to bfloat16 once, nearest-even, as torch rounds).
 *
 * Each output element is the hardware's tile dot products over k = 0, 32, 64, ... in that order:
 * what a row gets depends on its own inputs only, not on the rows beside it in a tile, the
 * number of rows, or the thread (oneDNN's AMX kernel, by contrast, blocks K by the row count, so
 * rows 33-512 get other bits than 1-32 here). Work items are 32-row by 32-column blocks; the
 * last block, if of other than 16 or 32 rows, is copied once into a zero-padded one.
 *
 * W packed [N/32][K/32][2][16][16][2]: for each 32-column strip and 32-wide k step, two B tiles
 * (columns 0-15, 16-31) of 16 rows of k pairs (the VNNI layout tdpbf16ps reads). K % 32 == 0.
 */
#include <string.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int amx_bf16_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0; /* AMX-BF16, AMX-TILE */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_linear_bf16(
    const uint16_t *x, int64_t ldx, const uint16_t *w, const float *bias, uint16_t *y, int64_t ldy,
    int64_t M, int64_t K, int64_t N) {
    const int64_t steps = K / 32, strips = (N + 31) / 32, blocks = (M + 31) / 32;
    /* The last block, if not of 16 or 32 rows, copied once into a zero-padded one. */
    const int64_t tail = M - (blocks - 1) * 32;
    uint16_t *padded = 0;
    if (tail != 16 && tail != 32) {
        padded = calloc(32 * K, 2);
        for (int64_t r = 0; r < tail; r++) memcpy(padded + r * K, x + ((blocks - 1) * 32 + r) * ldx, K * 2);
    }
    _Pragma("omp parallel")
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        float out[32 * 32];
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t item = 0; item < blocks * strips; item++) {
            /* Strip-major: a thread's next item reuses the weight strip it just read. */
            const int64_t strip = item / blocks, blk = item % blocks;
            const int64_t m0 = blk * 32, rows = M - m0 < 32 ? M - m0 : 32;
            const int64_t cols = N - strip * 32 < 32 ? N - strip * 32 : 32;
            const int last = blk == blocks - 1 && padded;
            const uint16_t *a = last ? padded : x + m0 * ldx;
            const int64_t lda = last ? K : ldx;
            const int two = rows > 16;
            const uint16_t *b = w + strip * steps * 1024;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t s = 0; s < steps; s++) {
                _tile_loadd(4, a + s * 32, lda * 2);
                _tile_loadd(6, b + s * 1024, 64);
                _tile_loadd(7, b + s * 1024 + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, a + 16 * lda + s * 32, lda * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, out, 128);
            _tile_stored(1, out + 16, 128);
            if (two) {
                _tile_stored(2, out + 16 * 32, 128);
                _tile_stored(3, out + 16 * 32 + 16, 128);
            }
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++)
                    y[(m0 + r) * ldy + strip * 32 + c] =
                        to_bf16(out[r * 32 + c] + (bias ? bias[strip * 32 + c] : 0.0f));
        }
        _tile_release();
    }
    free(padded);
}


#else

int amx_bf16_supported(void) { return 0; }
void amx_linear_bf16(void) {}

#endif

#else

int grouped_gemm_supported(void) { return 0; }

void grouped_gemm_f32(void) {}
void grouped_gemm_bf16(void) {}
int amx_bf16_supported(void) { return 0; }
void amx_linear_bf16(void) {}

#endif
