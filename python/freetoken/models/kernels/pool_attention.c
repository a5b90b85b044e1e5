/* Attention over the engine's KV pool, read in place by slot: out[r, h] = softmax(q[r, h] . K) V
 * over the keys of row r, for query rows that each name their own keys.
 *
 * The layer's cache is [slots, 2 * kv_heads, D], keys then values, float32 or bfloat16 (widened
 * exactly as read). Row r's keys are slots[first_r + j] for j in [lo_r, hi_r) (`ranges`, [R, 3]
 * int64: first, lo, hi): a decoding request's padded slot list and its valid (or windowed) part.
 * q and out are float32 [R, heads, D], D % 8 == 0;
 * query head h reads kv head h / (heads / kv_heads).
 *
 * Every output row is computed alone, by the same operations in the same order whatever the
 * other rows, their count, the thread or the group: per (row, query head), each score is one FMA
 * chain of 8 lanes along D then a fixed tree (eight keys' trees at once, the same for each),
 * times the scale; the softmax is exp(s - max) over
 * the keys in slot-list order (8-lane sums, then a fixed tree, then the tail), plus a sink's
 * term where given; the output is one FMA chain over the keys in order per lane, times
 * 1 / the sum. So a row's bits never depend on its batch, by construction.
 *
 * `sinks` (float32 [heads], or NULL): a per-head logit the normaliser counts, with no value
 * (gpt-oss). Work items are (row, query head) pairs over torch's OpenMP threads: a batch-1 step
 * has as many as the model has heads.
 *
 * Built at first use by models/kernels/pool_attention.py; x86-64 with AVX2 and FMA, else
 * unsupported.
 */
#include <stdint.h>
#include <stdlib.h>

/* Keys x heads x head width below which a call runs on the calling thread: a few microseconds of
 * work (a decode step at batch 1 and a short context), less than waking the team costs. */
#define PARALLEL_WORK (1 << 18)

#if defined(__x86_64__)
#include <immintrin.h>

int pool_attention_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 load8_f32(const float *p) {
    return _mm256_loadu_ps(p);
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i half = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

__attribute__((target("avx2,fma"), always_inline)) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Lane u of the result: the sum of a[u]'s lanes, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
 * for every u, so a key's score does not depend on its place among the eight. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* t0: [a0 lo, a1 lo, a2 lo, a3 lo | a0 hi, a1 hi, a2 hi, a3 hi]; t1 likewise for a4..a7. */
    const __m256 lo = _mm256_permute2f128_ps(t0, t1, 0x20), hi = _mm256_permute2f128_ps(t0, t1, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* e^x for x <= 0 (scores minus their max), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial in r, times 2^n; within 2 ulp, and 0 below -87. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Softmax weights of n scores in place (exp(s - max), the max over scores and the sink); returns
 * 1 / their sum (the sink's term included). */
__attribute__((target("avx2,fma"))) static float softmax_weights(float *s, int64_t n, const float *sink) {
    float max = sink ? *sink : s[0];
    for (int64_t j = 0; j < n; j++)
        max = s[j] > max ? s[j] : max;
    const __m256 m = _mm256_set1_ps(max);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, p);
        acc = _mm256_add_ps(acc, p);
    }
    float sum = hsum8(acc);
    if (j < n) {
        float tail[8] = {0};
        for (int64_t t = j; t < n; t++)
            tail[t - j] = s[t] - max;
        const __m256 p = exp8(_mm256_loadu_ps(tail));
        _mm256_storeu_ps(tail, p);
        for (int64_t t = j; t < n; t++) {
            s[t] = tail[t - j];
            sum += s[t];
        }
    }
    if (sink) {
        float one[8] = {*sink - max};
        _mm256_storeu_ps(one, exp8(_mm256_loadu_ps(one)));
        sum += one[0];
    }
    return 1.0f / sum;
}

#define DEFINE_POOL_ATTENTION(NAME, T, LOAD)                                                         \
    __attribute__((target("avx2,fma"))) void NAME(                                                   \
        const float *q, const T *cache, const int64_t *slots, const int64_t *ranges,                 \
        const float *sinks, float *out, int64_t rows, int64_t heads, int64_t kv_heads,               \
        int64_t D, float scale) {                                                                    \
        const int64_t group = heads / kv_heads, ld_slot = 2 * kv_heads * D;                          \
        int64_t keys_total = 0;                                                                      \
        for (int64_t r = 0; r < rows; r++)                                                           \
            keys_total += ranges[3 * r + 2] - ranges[3 * r + 1];                                     \
        _Pragma("omp parallel for schedule(dynamic) if (keys_total * heads * D >= PARALLEL_WORK)")   \
        for (int64_t item = 0; item < rows * heads; item++) {                                        \
            const int64_t r = item / heads, h = item % heads;                                        \
            const int64_t *keys = slots + ranges[3 * r] + ranges[3 * r + 1];                         \
            const int64_t n = ranges[3 * r + 2] - ranges[3 * r + 1];                                 \
            const T *k_head = cache + (h / group) * D, *v_head = cache + (kv_heads + h / group) * D; \
            const float *qh = q + item * D;                                                          \
            float *o = out + item * D, *s = malloc(sizeof(float) * (n > 0 ? n : 1));                 \
            for (int64_t j = 0; j < n; j += 8) {                                                     \
                const int m = n - j < 8 ? (int)(n - j) : 8;                                          \
                __m256 acc[8];                                                                       \
                _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();    \
                for (int64_t u = j + 8; u < j + 16 && u < n; u++)                                    \
                    prefetch_row(k_head + keys[u] * ld_slot, D * sizeof(T));                         \
                for (int64_t d = 0; d < D; d += 8) {                                                 \
                    const __m256 qd = _mm256_loadu_ps(qh + d);                                       \
                    if (m == 8) {                                                                    \
                        _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++)                          \
                            acc[u] = _mm256_fmadd_ps(qd, LOAD(k_head + keys[j + u] * ld_slot + d), acc[u]); \
                    } else {                                                                         \
                        for (int u = 0; u < m; u++)                                                  \
                            acc[u] = _mm256_fmadd_ps(qd, LOAD(k_head + keys[j + u] * ld_slot + d), acc[u]); \
                    }                                                                                \
                }                                                                                    \
                float sums[8];                                                                       \
                _mm256_storeu_ps(sums, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));          \
                for (int u = 0; u < m; u++)                                                          \
                    s[j + u] = sums[u];                                                              \
            }                                                                                        \
            const __m256 inv = _mm256_set1_ps(n > 0 ? softmax_weights(s, n, sinks ? sinks + h : 0) : 0.0f); \
            for (int64_t c = 0; c < D; c += 64) {                                                    \
                const int w = D - c < 64 ? (int)(D - c) : 64;                                        \
                __m256 acc[8];                                                                       \
                _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();    \
                for (int64_t j = 0; j < n; j++) {                                                    \
                    const T *v = v_head + keys[j] * ld_slot + c;                                     \
                    const __m256 p = _mm256_set1_ps(s[j]);                                           \
                    if (j + 4 < n)                                                                   \
                        prefetch_row(v_head + keys[j + 4] * ld_slot + c, w * sizeof(T));             \
                    if (w == 64) {                                                                   \
                        _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++)                          \
                            acc[u] = _mm256_fmadd_ps(p, LOAD(v + 8 * u), acc[u]);                    \
                    } else {                                                                         \
                        for (int u = 0; u < w / 8; u++)                                              \
                            acc[u] = _mm256_fmadd_ps(p, LOAD(v + 8 * u), acc[u]);                    \
                    }                                                                                \
                }                                                                                    \
                for (int u = 0; u < w / 8; u++)                                                      \
                    _mm256_storeu_ps(o + c + 8 * u, _mm256_mul_ps(acc[u], inv));                     \
            }                                                                                        \
            free(s);                                                                                 \
        }                                                                                            \
    }

DEFINE_POOL_ATTENTION(pool_attention_f32, float, load8_f32)
DEFINE_POOL_ATTENTION(pool_attention_bf16, uint16_t, load8_bf16)

#else

int pool_attention_supported(void) { return 0; }
void pool_attention_f32(void) {}
void pool_attention_bf16(void) {}

#endif
