/* The vector units' peak rates, for scripts/bench_quant.py's heading: nothing but multiply-adds
 * into twelve independent accumulators (more than an FMA's latency times its issue rate on the
 * x86 CPUs we met), on every OpenMP thread at once (torch's thread count). The most an exact
 * float32 kernel can reach, what a bfloat16 one could, and the int8 products of
 * `--quantized-arithmetic int8` (kernels/csrc/int8_gemm.c): the ceilings docs/performance.md
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

/* int8 products, unsigned by signed bytes: AVX2's maddubs (pairs summed into int16) with the add
 * it needs to accumulate, as int8_gemm.c's AVX2 path runs them; AVX-VNNI's and AVX512-VNNI's dpbusd
 * (quads summed into int32, accumulated in the one instruction). Values overflow freely: only the
 * rate counts. */
/* maddubs reads the accumulator itself: on the constants alone the compiler hoists it out of the loop. */
#define MADDUBS_ADD(a, x, y) _mm256_add_epi16(a, _mm256_maddubs_epi16(a, y))
#define HSUM_I16(a) ((float)_mm256_extract_epi16(a, 0))
#define HSUM_I32(a) ((float)_mm256_extract_epi32(a, 0))
DEFINE_LOOP(int8_avx2, "avx2", __m256i, __m256i, _mm256_set1_epi8(3), _mm256_set1_epi8(-2), MADDUBS_ADD, HSUM_I16)
DEFINE_LOOP(int8_avxvnni, "avx2,avxvnni", __m256i, __m256i, _mm256_set1_epi8(3), _mm256_set1_epi8(-2),
            _mm256_dpbusd_avx_epi32, HSUM_I32)
DEFINE_LOOP(int8_avx512vnni, "avx512f,avx512vnni", __m512i, __m512i, _mm512_set1_epi8(3), _mm512_set1_epi8(-2),
            _mm512_dpbusd_epi32, (float)_mm512_reduce_add_epi32)

/* 1: the CPU has the unit `kind` runs on, else 0. 0 float32 FMA (512-bit where there is AVX-512,
 * else 256-bit); 1 AVX512-BF16's dot product; 2 AVX2's int8 maddubs; 3 AVX-VNNI's dpbusd; 4
 * AVX512-VNNI's. (AMX's tiles are left out: using them needs the kernel's leave first.) */
int unit_supported(int kind) {
    __builtin_cpu_init();
    switch (kind) {
    case 0: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 1: return __builtin_cpu_supports("avx512bf16") != 0;
    case 2: return __builtin_cpu_supports("avx2") != 0;
    case 3: return __builtin_cpu_supports("avxvnni") != 0;
    case 4: return __builtin_cpu_supports("avx512vnni") != 0;
    }
    return 0;
}

static float run(int kind, int wide, long rounds) {
    switch (kind) {
    case 1: return dot_bf16(rounds);
    case 2: return int8_avx2(rounds);
    case 3: return int8_avxvnni(rounds);
    case 4: return int8_avx512vnni(rounds);
    }
    return wide ? fma512(rounds) : fma256(rounds);
}

/* Multiply-adds a second (all threads together) of unit `kind` over `rounds` rounds a thread (an
 * int8 one: byte products). */
double unit_peak(int kind, long rounds) {
    const int wide = __builtin_cpu_supports("avx512f");
    /* multiply-adds per instruction */
    const double lanes = kind == 4 ? 64 : kind >= 1 ? 32 : wide ? 16 : 8;
    volatile float sink = 0;
    int threads = 1;
    const double t0 = omp_get_wtime();
#pragma omp parallel
    {
        const float s = run(kind, wide, rounds);
#pragma omp critical
        sink += s;
#pragma omp single
        threads = omp_get_num_threads();
    }
    return 12.0 * lanes * (double)rounds * threads / (omp_get_wtime() - t0);
}
