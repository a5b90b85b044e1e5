/* The vector units' peak rates, for scripts/bench_quant.py's heading: nothing but multiply-adds
 * into twelve independent accumulators (more than an FMA's latency times its issue rate on the
 * x86 CPUs we met), on every OpenMP thread at once (torch's thread count). The most an exact
 * float32 kernel can reach, and what a bfloat16 one could: the ceilings docs/performance.md
 * ("The open targets against the units' peaks") holds the speed targets against. Built by kernels/grouped_gemm.py's build.
 */
#include <immintrin.h>
#include <omp.h>

/* Twelve accumulators a0-a11 as named variables (an array of them GCC kept in memory, storing
 * each every round: a third of the rate). */
#define STEP12(OP)                                                                               \
    a0 = OP(a0, x, y), a1 = OP(a1, x, y), a2 = OP(a2, x, y), a3 = OP(a3, x, y), a4 = OP(a4, x, y), \
    a5 = OP(a5, x, y), a6 = OP(a6, x, y), a7 = OP(a7, x, y), a8 = OP(a8, x, y), a9 = OP(a9, x, y), \
    a10 = OP(a10, x, y), a11 = OP(a11, x, y)
#define SUM12(SUM)                                                                               \
    (SUM(a0) + SUM(a1) + SUM(a2) + SUM(a3) + SUM(a4) + SUM(a5) + SUM(a6) + SUM(a7) + SUM(a8) +   \
     SUM(a9) + SUM(a10) + SUM(a11))

/* NAME(rounds): each round one OP(a, x, y) on each accumulator, all of them then through an empty
 * asm (kept in registers, never folded away). */
#define DEFINE_LOOP(NAME, TARGET, VEC, IN, X, Y, OP, SUM)                                        \
    __attribute__((target(TARGET))) static float NAME(long rounds) {                             \
        const IN x = X, y = Y;                                                                   \
        VEC a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0}, a8 = {0}, \
            a9 = {0}, a10 = {0}, a11 = {0};                                                      \
        for (long t = 0; t < rounds; t++) {                                                      \
            STEP12(OP);                                                                          \
            __asm__("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),   \
                    "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));                         \
        }                                                                                        \
        return SUM12(SUM);                                                                       \
    }

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
