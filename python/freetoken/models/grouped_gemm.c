/* Grouped GEMM for a step's experts: y[rows of group g] = x[rows of g] @ W[expert of g]^T + b.
 *
 * Every output element is one fused multiply-add chain over k = 0..K-1 from zero, then the bias
 * added: the same operations in the same order whatever the group's row count, the tile the
 * row lands in, or the thread that runs it. So a row's bits never depend on its batch, with no
 * padding rows (compare models/linear.py, where a library kernel's rule has to be probed).
 *
 * Weights are packed once at load into strips of 16 output columns, [E][N/16][K][16], so that a
 * strip is read front to back: a decode step's few rows per expert are bound by reading the
 * weights, and a sequential stream is what the memory system serves fastest. Work items are
 * (group, strip) pairs spread over torch's OpenMP threads (the process shares torch's libgomp,
 * so this reuses its thread team).
 *
 * Built at first use by models/grouped_gemm.py; x86-64 with AVX2 and FMA, else unsupported.
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

__attribute__((target("avx2,fma"), always_inline)) static inline void
tile(const float *x, int64_t ldx, const int rows, const float *w, int64_t K, float *y,
     int64_t ldy, int cols, const float *bias) {
    __m256 lo[MAX_ROWS], hi[MAX_ROWS];
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++) {
        lo[r] = _mm256_setzero_ps();
        hi[r] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < K; k++) {
        __m256 w_lo = _mm256_loadu_ps(w + k * STRIP), w_hi = _mm256_loadu_ps(w + k * STRIP + 8);
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            __m256 xk = _mm256_broadcast_ss(x + r * ldx + k);
            lo[r] = _mm256_fmadd_ps(xk, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xk, w_hi, hi[r]);
        }
    }
    __m256 b_lo = _mm256_setzero_ps(), b_hi = _mm256_setzero_ps();
    if (bias) {
        b_lo = _mm256_loadu_ps(bias);
        b_hi = _mm256_loadu_ps(bias + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++) {
        float out[STRIP];
        _mm256_storeu_ps(out, bias ? _mm256_add_ps(lo[r], b_lo) : lo[r]);
        _mm256_storeu_ps(out + 8, bias ? _mm256_add_ps(hi[r], b_hi) : hi[r]);
        for (int c = 0; c < cols; c++) y[r * ldy + c] = out[c];
    }
}

/* x [*, K] (row stride ldx); w packed [E][strips][K][16]; bias packed [E][strips * 16] or NULL;
 * y [*, N] (row stride ldy); groups [G][3]: expert, first row, row count. */
__attribute__((target("avx2,fma"))) void
grouped_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                 int64_t ldy, const int64_t *groups, int64_t G, int64_t K, int64_t N) {
    const int64_t strips = (N + STRIP - 1) / STRIP;
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t item = 0; item < G * strips; item++) {
        const int64_t g = item / strips, s = item % strips;
        const int64_t e = groups[3 * g], first = groups[3 * g + 1], count = groups[3 * g + 2];
        const float *ws = w + (e * strips + s) * K * STRIP;
        const float *bs = bias ? bias + (e * strips + s) * STRIP : 0;
        const int cols = N - s * STRIP < STRIP ? (int)(N - s * STRIP) : STRIP;
        for (int64_t r = 0; r < count; r += MAX_ROWS) {
            const float *xr = x + (first + r) * ldx;
            float *yr = y + (first + r) * ldy + s * STRIP;
            switch (count - r < MAX_ROWS ? count - r : MAX_ROWS) {
            case 1: tile(xr, ldx, 1, ws, K, yr, ldy, cols, bs); break;
            case 2: tile(xr, ldx, 2, ws, K, yr, ldy, cols, bs); break;
            case 3: tile(xr, ldx, 3, ws, K, yr, ldy, cols, bs); break;
            case 4: tile(xr, ldx, 4, ws, K, yr, ldy, cols, bs); break;
            case 5: tile(xr, ldx, 5, ws, K, yr, ldy, cols, bs); break;
            default: tile(xr, ldx, 6, ws, K, yr, ldy, cols, bs); break;
            }
        }
    }
}

#else

int grouped_gemm_supported(void) { return 0; }

void grouped_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                      int64_t ldy, const int64_t *groups, int64_t G, int64_t K, int64_t N) {}

#endif
