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
 * pool_attention_*_latent reads a multi-head latent attention cache (one row a slot, the key, whose
 * first Dv elements are the value) by the same operations.
 *
 * Built at first use by kernels/build.py for pool_attention.py; x86-64 with AVX2 and FMA, else
 * unsupported. Signatures and the bfloat16 helpers: kernels.h.
 */
#include <stdlib.h>

#include "kernels.h"

/* Keys x heads x head width below which a call runs on the calling thread: a few microseconds of
 * work (a decode step at batch 1 and a short context), less than waking the team costs. */
#define PARALLEL_WORK (1 << 18)

#if defined(__x86_64__)
/* Set by pool_attention_set_isa (the Python side, once: the CPU's best unless capped). */
static int use_avx512;

int pool_attention_supported(void) { return has_avx2_fma(); }

/* 2: AVX-512 where the CPU has it, 1: AVX2; returns the path set. */
int pool_attention_set_isa(int isa) {
    __builtin_cpu_init();
    use_avx512 = isa >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return use_avx512 ? 2 : 1;
}

static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Lane u of the result: the sum of a[u]'s lanes, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
 * for every u, so a key's score does not depend on its place among the eight. */
AVX2_INLINE __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* t0: [a0 lo, a1 lo, a2 lo, a3 lo | a0 hi, a1 hi, a2 hi, a3 hi]; t1 likewise for a4..a7. */
    const __m256 lo = _mm256_permute2f128_ps(t0, t1, 0x20), hi = _mm256_permute2f128_ps(t0, t1, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* e^x for x <= 0 (scores minus their max), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial in r, times 2^n; within 2 ulp, and 0 below -87. */
AVX2_INLINE __m256 exp8(__m256 x) {
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
    /* The max in 8 lanes: the same value whatever the order (scores are not NaN), in a fraction of
     * a serial chain's time. */
    __m256 lanes = _mm256_set1_ps(sink ? *sink : s[0]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + i));
    float part[8], max = s[0];
    _mm256_storeu_ps(part, lanes);
    for (int u = 0; u < 8; u++)
        max = part[u] > max ? part[u] : max;
    for (; i < n; i++)
        max = s[i] > max ? s[i] : max;
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

/* A thread's score buffer, kept between calls (a call's rows may have thousands of keys). */
static float *thread_scores(int64_t n) {
    static __thread float *buffer;
    static __thread int64_t capacity;
    if (n > capacity) {
        free(buffer);
        capacity = n > 4096 ? n : 4096;
        buffer = malloc(sizeof(float) * capacity);
    }
    return buffer;
}

/* Scores of q against eight keys (fewer: m), scaled, into s: each one FMA chain of 8 lanes
 * along D, then hsum8x8's tree. */
#define DEFINE_SCORES8(NAME, T, LOAD)                                                                \
    AVX2_INLINE void NAME(                                                                       \
        const float *qh, const T *const *kp, int m, int64_t D, float scale, float *s) {              \
        __m256 acc[8];                                                                               \
        _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();            \
        if (m == 8) {                                                                                \
            for (int64_t d = 0; d < D; d += 8) {                                                     \
                const __m256 qd = _mm256_loadu_ps(qh + d);                                           \
                _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++)                                  \
                    acc[u] = _mm256_fmadd_ps(qd, LOAD(kp[u] + d), acc[u]);                           \
            }                                                                                        \
        } else {                                                                                     \
            for (int64_t d = 0; d < D; d += 8) {                                                     \
                const __m256 qd = _mm256_loadu_ps(qh + d);                                           \
                for (int u = 0; u < m; u++)                                                          \
                    acc[u] = _mm256_fmadd_ps(qd, LOAD(kp[u] + d), acc[u]);                           \
            }                                                                                        \
        }                                                                                            \
        const __m256 scores = _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale));                    \
        if (m == 8) {                                                                                \
            _mm256_storeu_ps(s, scores);                                                             \
            return;                                                                                  \
        }                                                                                            \
        float sums[8]; /* (a store loop GCC makes a memcpy call: at m == 8, one store instead) */    \
        _mm256_storeu_ps(sums, scores);                                                              \
        for (int u = 0; u < m; u++)                                                                  \
            s[u] = sums[u];                                                                          \
    }

/* out = sum_j p_j v_j in key order (one FMA chain per lane), times inv, over D in 64-wide parts of
 * 64 / LANES registers: eight lanes (AVX2), or sixteen (AVX-512, D % 16 == 0: a kv head's odd
 * query head in a group of 3), the same chains either way. */
#define DEFINE_WEIGHTED_VALUES_W(NAME, T, LOAD, ATTRS, V, LANES, SET1, FMADD, ZERO, STORE, MUL)         \
    ATTRS static void NAME(const float *s, const int64_t *keys, int64_t n, const T *v_head, int64_t ld_slot, \
                           int64_t D, float inv_sum, float *o) {                                     \
        for (int64_t c = 0; c < D; c += 64) {                                                        \
            const int w = D - c < 64 ? (int)(D - c) : 64;                                            \
            V acc[64 / LANES];                                                                       \
            _Pragma("GCC unroll 8") for (int u = 0; u < 64 / LANES; u++) acc[u] = ZERO();           \
            if (w == 64) {                                                                           \
                for (int64_t j = 0; j < n; j++) {                                                    \
                    const T *v = v_head + keys[j] * ld_slot + c;                                     \
                    const V p = SET1(s[j]);                                                          \
                    _Pragma("GCC unroll 8") for (int u = 0; u < 64 / LANES; u++)                     \
                        acc[u] = FMADD(p, LOAD(v + LANES * u), acc[u]);                              \
                }                                                                                    \
            } else {                                                                                 \
                for (int64_t j = 0; j < n; j++) {                                                    \
                    const T *v = v_head + keys[j] * ld_slot + c;                                     \
                    const V p = SET1(s[j]);                                                          \
                    for (int u = 0; u < w / LANES; u++)                                              \
                        acc[u] = FMADD(p, LOAD(v + LANES * u), acc[u]);                              \
                }                                                                                    \
            }                                                                                        \
            for (int u = 0; u < w / LANES; u++)                                                      \
                STORE(o + c + LANES * u, MUL(acc[u], SET1(inv_sum)));                                \
        }                                                                                            \
    }
#define DEFINE_WEIGHTED_VALUES(NAME, T, LOAD)                                                        \
    DEFINE_WEIGHTED_VALUES_W(NAME, T, LOAD, __attribute__((target("avx2,fma"), always_inline)) inline, __m256, 8, \
                             _mm256_set1_ps, _mm256_fmadd_ps, _mm256_setzero_ps, _mm256_storeu_ps, _mm256_mul_ps)

/* AVX-512: each output lane's chain is the same FMAs in the same order as on AVX2 (lanes are
 * independent along D), so both paths give the same bits; sixteen lanes and two query heads of a
 * kv head at once (one load of a value row for both) keep eight chains in flight. */
#define AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma"), always_inline)) static inline

AVX512 __m512 broadcast8_f32(const float *p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }
AVX512 __m512 broadcast8_bf16(const uint16_t *p) {
    return _mm512_broadcast_f32x8(load8_bf16(p));
}

/* As SCORES8, for two query heads over the same keys: a key's eight lanes of D meet head 0's in
 * the low half of a register and head 1's in the high half, each lane the FMA chain SCORES8
 * runs; then hsum8x8's tree on each half. */
#define DEFINE_SCORES8X2_512(NAME, T, BROADCAST)                                                     \
    __attribute__((target("avx512f,avx512dq,avx2,fma"))) static void NAME(                          \
        const float *q0, const float *q1, const T *const *kp, int m, int64_t D, float scale,         \
        float *s0, float *s1) {                                                                      \
        __m512 acc[8];                                                                               \
        _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) acc[u] = _mm512_setzero_ps();            \
        for (int64_t d = 0; d < D; d += 8) {                                                         \
            const __m512 qd = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q0 + d)),    \
                                                 _mm256_loadu_ps(q1 + d), 1);                        \
            if (m == 8) {                                                                            \
                _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++)                                  \
                    acc[u] = _mm512_fmadd_ps(qd, BROADCAST(kp[u] + d), acc[u]);                      \
            } else {                                                                                 \
                for (int u = 0; u < m; u++)                                                          \
                    acc[u] = _mm512_fmadd_ps(qd, BROADCAST(kp[u] + d), acc[u]);                      \
            }                                                                                        \
        }                                                                                            \
        __m256 lo[8], hi[8];                                                                         \
        _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) {                                        \
            lo[u] = _mm512_castps512_ps256(acc[u]);                                                  \
            hi[u] = _mm512_extractf32x8_ps(acc[u], 1);                                               \
        }                                                                                            \
        const __m256 scores0 = _mm256_mul_ps(hsum8x8(lo), _mm256_set1_ps(scale));                    \
        const __m256 scores1 = _mm256_mul_ps(hsum8x8(hi), _mm256_set1_ps(scale));                    \
        if (m == 8) { /* (as scores8) */                                                             \
            _mm256_storeu_ps(s0, scores0);                                                           \
            _mm256_storeu_ps(s1, scores1);                                                           \
            return;                                                                                  \
        }                                                                                            \
        float sums[16];                                                                              \
        _mm256_storeu_ps(sums, scores0);                                                             \
        _mm256_storeu_ps(sums + 8, scores1);                                                         \
        for (int u = 0; u < m; u++) {                                                                \
            s0[u] = sums[u];                                                                         \
            s1[u] = sums[8 + u];                                                                     \
        }                                                                                            \
    }

/* As WEIGHTED_VALUES, for two heads' weights s0 and s1 over the same values, D % 16 == 0. */
#define DEFINE_WEIGHTED_VALUES2_512(NAME, T, LOAD)                                                   \
    __attribute__((target("avx512f,avx512dq,avx2,fma"))) static void NAME(const float *s0, const float *s1, const int64_t *keys, int64_t n,               \
                     const T *v_head, int64_t ld_slot, int64_t D, float inv0, float inv1,            \
                     float *o0, float *o1) {                                                         \
        for (int64_t c = 0; c < D; c += 64) {                                                        \
            const int w = D - c < 64 ? (int)(D - c) : 64;                                            \
            __m512 a0[4], a1[4];                                                                     \
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) a0[u] = a1[u] = _mm512_setzero_ps(); \
            if (w == 64) {                                                                           \
                for (int64_t j = 0; j < n; j++) {                                                    \
                    const T *v = v_head + keys[j] * ld_slot + c;                                     \
                    const __m512 p0 = _mm512_set1_ps(s0[j]), p1 = _mm512_set1_ps(s1[j]);            \
                    _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {                            \
                        const __m512 x = LOAD(v + 16 * u);                                           \
                        a0[u] = _mm512_fmadd_ps(p0, x, a0[u]);                                       \
                        a1[u] = _mm512_fmadd_ps(p1, x, a1[u]);                                       \
                    }                                                                                \
                }                                                                                    \
            } else {                                                                                 \
                for (int64_t j = 0; j < n; j++) {                                                    \
                    const T *v = v_head + keys[j] * ld_slot + c;                                     \
                    const __m512 p0 = _mm512_set1_ps(s0[j]), p1 = _mm512_set1_ps(s1[j]);            \
                    for (int u = 0; u < w / 16; u++) {                                               \
                        const __m512 x = LOAD(v + 16 * u);                                           \
                        a0[u] = _mm512_fmadd_ps(p0, x, a0[u]);                                       \
                        a1[u] = _mm512_fmadd_ps(p1, x, a1[u]);                                       \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            for (int u = 0; u < w / 16; u++) {                                                       \
                _mm512_storeu_ps(o0 + c + 16 * u, _mm512_mul_ps(a0[u], _mm512_set1_ps(inv0)));       \
                _mm512_storeu_ps(o1 + c + 16 * u, _mm512_mul_ps(a1[u], _mm512_set1_ps(inv1)));       \
            }                                                                                        \
        }                                                                                            \
    }

#define DEFINE_WEIGHTED_VALUES_512(NAME, T, LOAD)                                                    \
    DEFINE_WEIGHTED_VALUES_W(NAME, T, LOAD, __attribute__((target("avx512f,avx512dq,avx2,fma"))), __m512, 16, \
                             _mm512_set1_ps, _mm512_fmadd_ps, _mm512_setzero_ps, _mm512_storeu_ps, _mm512_mul_ps)

/* Work items are (row, kv head): its query heads' scores first (keys read from memory once, from
 * L1 by the other heads), then their outputs, two heads at a time where AVX-512 runs.
 * A slot is ld_slot elements; kv head h's key is D of them from h * D, its value Dv from
 * v_off + h * Dv (keys then values, or a latent layout: NAME_latent). */
#define DEFINE_POOL_ATTENTION(NAME, T, SCORES8, SCORES8X2_512, WEIGHTED_VALUES, WEIGHTED_VALUES2_512, WEIGHTED_VALUES_512) \
    __attribute__((target("avx2,fma"))) static void NAME##_core(                                     \
        const float *q, const T *cache, const int64_t *slots, const int64_t *ranges,                 \
        const float *sinks, float *out, int64_t rows, int64_t heads, int64_t kv_heads,               \
        int64_t D, float scale, int64_t ld_slot, int64_t v_off, int64_t Dv) {                        \
        const int64_t group = heads / kv_heads;                                                      \
        const int wide = use_avx512 && Dv % 16 == 0;                                                 \
        int64_t keys_total = 0;                                                                      \
        for (int64_t r = 0; r < rows; r++)                                                           \
            keys_total += ranges[3 * r + 2] - ranges[3 * r + 1];                                     \
        /* Items handed out eight at a time once there are hundreds (a scoring step's prompt rows: \
         * one at a time, taking the next item was 10-20 % of the call), one at a time while few  \
         * (a decode step's rows, whose items are long). */                                       \
        const int64_t items = rows * kv_heads, chunk = items < 256 ? 1 : 8;                          \
        _Pragma("omp parallel for schedule(dynamic, chunk) if (keys_total * heads * D >= PARALLEL_WORK)") \
        for (int64_t item = 0; item < items; item++) {                                               \
            const int64_t r = item / kv_heads, kvh = item % kv_heads;                                \
            const int64_t *keys = slots + ranges[3 * r] + ranges[3 * r + 1];                         \
            const int64_t n = ranges[3 * r + 2] - ranges[3 * r + 1], stride = n > 0 ? n : 1;         \
            const T *k_head = cache + kvh * D, *v_head = cache + v_off + kvh * Dv;                   \
            float *s = thread_scores(group * stride), inv[group];                                    \
            for (int64_t g = 0; g < group;) {                                                        \
                const int64_t h = kvh * group + g, pair = wide && g + 2 <= group;                    \
                const float *qh = q + (r * heads + h) * D;                                           \
                for (int64_t j = 0; j < n; j += 8) {                                                 \
                    const int m = n - j < 8 ? (int)(n - j) : 8;                                      \
                    const T *kp[8];                                                                  \
                    for (int u = 0; u < m; u++)                                                      \
                        kp[u] = k_head + keys[j + u] * ld_slot;                                      \
                    for (int64_t u = j + 8; g == 0 && u < j + 16 && u < n; u++)                      \
                        prefetch_row(k_head + keys[u] * ld_slot, D * sizeof(T));                     \
                    if (pair)                                                                        \
                        SCORES8X2_512(qh, qh + D, kp, m, D, scale, s + g * stride + j,               \
                                      s + (g + 1) * stride + j);                                     \
                    else                                                                             \
                        SCORES8(qh, kp, m, D, scale, s + g * stride + j);                            \
                }                                                                                    \
                for (int64_t e = g + 1 + pair; g < e; g++)                                           \
                    inv[g] = n > 0 ? softmax_weights(s + g * stride, n, sinks ? sinks + kvh * group + g : 0) : 0.0f; \
            }                                                                                        \
            float *o = out + (r * heads + kvh * group) * Dv;                                         \
            int64_t g = 0;                                                                           \
            for (; wide && g + 2 <= group; g += 2)                                                   \
                WEIGHTED_VALUES2_512(s + g * stride, s + (g + 1) * stride, keys, n, v_head, ld_slot, \
                                     Dv, inv[g], inv[g + 1], o + g * Dv, o + (g + 1) * Dv);          \
            for (; wide && g < group; g++)                                                           \
                WEIGHTED_VALUES_512(s + g * stride, keys, n, v_head, ld_slot, Dv, inv[g], o + g * Dv); \
            for (; g < group; g++)                                                                   \
                WEIGHTED_VALUES(s + g * stride, keys, n, v_head, ld_slot, Dv, inv[g], o + g * Dv);   \
        }                                                                                            \
    }                                                                                                \
    /* The cache [slots, 2 * kv_heads, D]: keys then values. */                                     \
    __attribute__((target("avx2,fma"))) void NAME(                                                   \
        const float *q, const void *cache, const int64_t *slots, const int64_t *ranges,              \
        const float *sinks, float *out, int64_t rows, int64_t heads, int64_t kv_heads,               \
        int64_t D, float scale) {                                                                    \
        NAME##_core(q, cache, slots, ranges, sinks, out, rows, heads, kv_heads, D, scale,            \
                    2 * kv_heads * D, kv_heads * D, D);                                              \
    }                                                                                                \
    /* Multi-head latent attention (layers/mla.py): the cache [slots, D], one kv head whose \
     * key is the whole row and whose value its first Dv elements (the latent); out [R, heads, Dv]. */ \
    __attribute__((target("avx2,fma"))) void NAME##_latent(                                          \
        const float *q, const void *cache, const int64_t *slots, const int64_t *ranges, float *out,  \
        int64_t rows, int64_t heads, int64_t D, int64_t Dv, float scale) {                           \
        NAME##_core(q, cache, slots, ranges, 0, out, rows, heads, 1, D, scale, D, 0, Dv);            \
    }

DEFINE_SCORES8(scores8_f32, float, load8_f32)
DEFINE_SCORES8(scores8_bf16, uint16_t, load8_bf16)
DEFINE_WEIGHTED_VALUES(weighted_values_f32, float, load8_f32)
DEFINE_WEIGHTED_VALUES(weighted_values_bf16, uint16_t, load8_bf16)
DEFINE_WEIGHTED_VALUES2_512(weighted_values2_512_f32, float, load16_f32)
DEFINE_WEIGHTED_VALUES2_512(weighted_values2_512_bf16, uint16_t, load16_bf16)
DEFINE_WEIGHTED_VALUES_512(weighted_values_512_f32, float, load16_f32)
DEFINE_WEIGHTED_VALUES_512(weighted_values_512_bf16, uint16_t, load16_bf16)
DEFINE_SCORES8X2_512(scores8x2_512_f32, float, broadcast8_f32)
DEFINE_SCORES8X2_512(scores8x2_512_bf16, uint16_t, broadcast8_bf16)

DEFINE_POOL_ATTENTION(pool_attention_f32, float, scores8_f32, scores8x2_512_f32, weighted_values_f32,
                      weighted_values2_512_f32, weighted_values_512_f32)
DEFINE_POOL_ATTENTION(pool_attention_bf16, uint16_t, scores8_bf16, scores8x2_512_bf16, weighted_values_bf16,
                      weighted_values2_512_bf16, weighted_values_512_bf16)

#else

int pool_attention_supported(void) { return 0; }
int pool_attention_set_isa(int isa) { return 0; }

#endif
