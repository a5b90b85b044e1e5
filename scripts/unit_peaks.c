/* The vector units' peak rates, for scripts/bench_quant.py's heading: nothing but multiply-adds
 * into twelve independent accumulators (more than an FMA's latency times its issue rate on the
 * x86 CPUs we met), on every OpenMP thread at once (torch's thread count). The most an exact
 * float32 kernel can reach, and what a bfloat16 one could: the ceilings docs/performance.md
 * holds the speed targets against. Built by models/kernels/grouped_gemm.py's build.
 */
#include <immintrin.h>
#include <omp.h>

#define TWELVE(STEP) STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) STEP(9) STEP(10) STEP(11)

/* NAME(rounds): twelve accumulators of VEC, each through an empty asm every round (kept in a
 * register, never folded away), each round one OP(a, x, y) on each. */
#define DEFINE_LOOP(NAME, TARGET, VEC, IN, X, Y, OP, SUM)                                           \
    __attribute__((target(TARGET))) static float NAME(long rounds) {                             \
        const IN x = X, y = Y;                                                                   \
        VEC a[12];                                                                               \
        for (int i = 0; i < 12; i++) a[i] = (VEC){0};                                            \
        for (long t = 0; t < rounds; t++) {                                                      \
            _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = OP(a[i], x, y);         \
            TWELVE(KEEP)                                                                         \
        }                                                                                        \
        float sum = 0;                                                                           \
        for (int i = 0; i < 12; i++) sum += SUM(a[i]);                                           \
        return sum;                                                                              \
    }
#define KEEP(i) __asm__("" : "+v"(a[i]));

DEFINE_LOOP(fma512, "avx512f,fma", __m512, __m512, _mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f), _mm512_fmadd_ps,
            _mm512_reduce_add_ps)
DEFINE_LOOP(fma256, "avx2,fma", __m256, __m256, _mm256_set1_ps(0.999f), _mm256_set1_ps(1e-3f), _mm256_fmadd_ps,
            _mm256_cvtss_f32)
DEFINE_LOOP(dot_bf16, "avx512f,avx512bf16", __m512, __m512bh, (__m512bh)_mm512_set1_epi16(0x3f80),
            (__m512bh)_mm512_set1_epi16(0x3a80), _mm512_dpbf16_ps, _mm512_reduce_add_ps)

/* 1: the CPU has the unit `kind` runs on (0 float32 FMA, 512-bit where there is AVX-512, else
 * 256-bit; 1 AVX512-BF16's dot product), else 0. */
int unit_supported(int kind) {
    __builtin_cpu_init();
    if (kind == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return __builtin_cpu_supports("avx512bf16") != 0;
}

/* Multiply-adds a second (all threads together) of unit `kind` over `rounds` rounds a thread. */
double unit_peak(int kind, long rounds) {
    const int wide = __builtin_cpu_supports("avx512f");
    const double lanes = kind == 1 ? 32 : wide ? 16 : 8; /* multiply-adds per instruction */
    volatile float sink = 0;
    int threads = 1;
    const double t0 = omp_get_wtime();
#pragma omp parallel
    {
        const float s = kind == 1 ? dot_bf16(rounds) : wide ? fma512(rounds) : fma256(rounds);
#pragma omp critical
        sink += s;
#pragma omp single
        threads = omp_get_num_threads();
    }
    return 12.0 * lanes * (double)rounds * threads / (omp_get_wtime() - t0);
}
