/* Grouped GEMM for a step's experts: y[rows of group g] = x[rows of g] @ W[expert of g]^T + b,
 * x and y float32, W float32 or bfloat16 (widened to float32 as it is read).
 *
 * Every output element is one fused multiply-add chain over k = 0..K-1 from zero, then the bias
 * added: the same operations in the same order whatever the group's row count, the tile the
 * row lands in, or the thread that runs it. So a row's bits never depend on its batch, with no
 * padding rows (compare layers/linear.py, where a library kernel's rule has to be probed).
 *
 * Weights are packed once at load into strips of 16 output columns, [E][N/16][K][16], so that a
 * strip is read front to back: a decode step's few rows per expert are bound by reading the
 * weights, and a sequential stream is what the memory system serves fastest. Work items are
 * (group, strip) pairs spread over torch's OpenMP threads (the process shares torch's libgomp,
 * so this reuses its thread team).
 *
 * Built at first use by kernels/build.py for grouped_gemm.py; x86-64 with AVX2 and FMA, else
 * unsupported. Signatures and the bfloat16 helpers: kernels.h.
 * The file also holds rms_norm_* (RMSNorm in one pass per row), rotate_* (the rotary embedding in
 * one pass), add_rms_norm_*, norm_rotate_* and silu_mul_* (a layer's residual add and norm, its
 * q/k norms and rotation, its SwiGLU, each in one call) and round_to_bf16 (float32 rounded as torch
 * rounds to bfloat16). bfloat16 linears on the CPU's bfloat16 units are in bf16_linear.c.
 */
#include "kernels.h"

#define STRIP 16
#define MAX_ROWS 6

#if defined(__x86_64__)
int grouped_gemm_supported(void) { return has_avx2_fma(); }

/* One tile: `rows` (<= MAX_ROWS) rows of x times one strip, `cols` (<= 16) columns stored. */
#define DEFINE_TILE(NAME, WTYPE, LOAD)                                                           \
    AVX2_INLINE void NAME(                                                                   \
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
        const float *x, int64_t ldx, const void *weights, const float *bias, float *y, int64_t ldy, \
        const int64_t *groups, int64_t G, int64_t K, int64_t N) {                                \
        const WTYPE *w = weights;                                                                \
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

DEFINE_TILE(tile_f32, float, load8_f32)
DEFINE_TILE(tile_bf16, uint16_t, load8_bf16)
DEFINE_KERNEL(grouped_gemm_f32, tile_f32, float)
DEFINE_KERNEL(grouped_gemm_bf16, tile_bf16, uint16_t)


/* RMSNorm of rows x [M, D] (D % 8 == 0) by w [D]: y = w * (x / sqrt(mean(x^2) + eps)), each row on
 * its own in a fixed order (so its bits never depend on the rows beside it or the thread), as
 * transformers computes it per dtype: float32 rows as (x * r) * w; bfloat16 rows normalised in
 * float32, rounded to bfloat16, then multiplied by w and rounded again. One pass over a row where
 * torch's rms_norm makes six (pow, sum, div, add, rsqrt, mul) and the bfloat16 casts three more. */
AVX2_INLINE void store8_f32(
    float *y, __m256 x, __m256 scale, __m256 w) {
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_mul_ps(x, scale), w));
}

AVX2_INLINE void store8_bf16(
    uint16_t *y, __m256 x, __m256 scale, __m256 w) {
    const __m256 normed = widen_bf16(round_bf16(_mm256_mul_ps(x, scale)));
    pack_bf16(y, round_bf16(_mm256_mul_ps(w, normed)));
}

/* 1 / sqrt(mean + eps) of a row of D whose squares `acc` summed in eight lanes (k % 8 each). */
AVX2_INLINE float rms_scale(__m256 acc, int64_t D, float eps) {
    const float mean = hsum8(acc) / (float)D;
    const float root = _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean + eps)));
    return 1.0f / root;
}

/* One row x [D] normalised into y [D]. */
#define DEFINE_RMS_ROW(NAME, T, LOAD, STORE)                                                     \
    AVX2_INLINE void NAME(                                                                   \
        const T *xr, const T *w, T *y, int64_t D, float eps) {                                   \
        __m256 acc = _mm256_setzero_ps();                                                        \
        for (int64_t k = 0; k < D; k += 8) {                                                     \
            const __m256 v = LOAD(xr + k);                                                       \
            acc = _mm256_fmadd_ps(v, v, acc);                                                    \
        }                                                                                        \
        const __m256 scale = _mm256_set1_ps(rms_scale(acc, D, eps));                             \
        for (int64_t k = 0; k < D; k += 8) STORE(y + k, LOAD(xr + k), scale, LOAD(w + k));      \
    }

DEFINE_RMS_ROW(rms_row_f32, float, load8_f32, store8_f32)
DEFINE_RMS_ROW(rms_row_bf16, uint16_t, load8_bf16, store8_bf16)

#define DEFINE_RMS_NORM(NAME, T, ROW)                                                            \
    __attribute__((target("avx2,fma"))) void NAME(const void *xv, int64_t ldx, const void *wv,   \
                                                  void *yv, int64_t M, int64_t D, float eps) {   \
        const T *x = xv, *w = wv;                                                                \
        T *y = yv;                                                                               \
        _Pragma("omp parallel for if (M >= 64)")                                                 \
        for (int64_t r = 0; r < M; r++) ROW(x + r * ldx, w, y + r * D, D, eps);                  \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, rms_row_f32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, rms_row_bf16)

/* Rotary embedding of x [T, H, D] (rows ldt apart, heads ldh apart, D % 16 == 0) by cos and sin
 * [T, D] into y [T, H, D] contiguous: y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
 * for halves x1, x2, with the roundings torch makes for each of the three operations in the
 * tensors' dtype (built with -ffp-contract=off: no multiply-add fused), so the bits are torch's. */
AVX2_INLINE void rot8_f32(
    float *y, __m256 x, __m256 c, __m256 other, __m256 s) {
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_mul_ps(x, c), _mm256_mul_ps(other, s)));
}

AVX2_INLINE void rot8_bf16(
    uint16_t *y, __m256 x, __m256 c, __m256 other, __m256 s) {
    const __m256 a = widen_bf16(round_bf16(_mm256_mul_ps(x, c)));
    const __m256 b = widen_bf16(round_bf16(_mm256_mul_ps(other, s)));
    pack_bf16(y, round_bf16(_mm256_add_ps(a, b)));
}

/* One head's row x [D] turned into y [D] (y may be x: each step reads both halves first). */
#define DEFINE_ROTATE_ROW(NAME, T, LOAD, ROT)                                                    \
    AVX2_INLINE void NAME(                                                                   \
        const T *xr, const T *c, const T *s, T *yr, int64_t D) {                                 \
        const int64_t half = D / 2;                                                              \
        const __m256 sign = _mm256_set1_ps(-0.0f);                                               \
        for (int64_t k = 0; k < half; k += 8) {                                                  \
            const __m256 x1 = LOAD(xr + k), x2 = LOAD(xr + half + k);                            \
            ROT(yr + k, x1, LOAD(c + k), _mm256_xor_ps(x2, sign), LOAD(s + k));                  \
            ROT(yr + half + k, x2, LOAD(c + half + k), x1, LOAD(s + half + k));                  \
        }                                                                                        \
    }

DEFINE_ROTATE_ROW(rotate_row_f32, float, load8_f32, rot8_f32)
DEFINE_ROTATE_ROW(rotate_row_bf16, uint16_t, load8_bf16, rot8_bf16)

#define DEFINE_ROTATE(NAME, T, ROW)                                                              \
    __attribute__((target("avx2,fma"))) void NAME(const void *xv, int64_t ldt, int64_t ldh,      \
                                                  const void *cosv, const void *sinv, void *yv,  \
                                                  int64_t tokens, int64_t heads, int64_t D) {   \
        const T *x = xv, *cos = cosv, *sin = sinv;                                               \
        T *y = yv;                                                                               \
        _Pragma("omp parallel for if (tokens * heads >= 512)")                                   \
        for (int64_t i = 0; i < tokens * heads; i++) {                                           \
            const int64_t t = i / heads, h = i % heads;                                          \
            ROW(x + t * ldt + h * ldh, cos + t * D, sin + t * D, y + i * D, D);                  \
        }                                                                                        \
    }

DEFINE_ROTATE(rotate_f32, float, rotate_row_f32)
DEFINE_ROTATE(rotate_bf16, uint16_t, rotate_row_bf16)

/* Eight sums x + d stored at x: float32 as is, bfloat16 rounded (torch adds two bfloat16 tensors
 * in float32 and rounds the sum). */
AVX2_INLINE void add8_f32(float *x, const float *d) {
    _mm256_storeu_ps(x, _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(d)));
}

AVX2_INLINE void add8_bf16(uint16_t *x, const uint16_t *d) {
    pack_bf16(x, round_bf16(_mm256_add_ps(load8_bf16(x), load8_bf16(d))));
}

/* e^d as torch's vectorised exp computes it on x86 (SLEEF's expf_u10, FMA variant): the same
 * bits for every float32 input (checked against torch's SiLU over all 2^32). Written once for
 * both vector widths (P: the intrinsics' prefix, W: the width); the range fix-ups, which differ
 * by width (a blend, a mask), follow in each. */
#define EXP_CORE(P, W, d, u)                                                                         \
    do {                                                                                             \
        const __m##W##i q = P##_cvtps_epi32(P##_mul_ps(d, P##_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f))); \
        const __m##W qf = P##_cvtepi32_ps(q);                                                        \
        __m##W s = P##_fmadd_ps(qf, P##_set1_ps(-0.693145751953125f), d);                            \
        s = P##_fmadd_ps(qf, P##_set1_ps(-1.428606765330187045e-06f), s);                            \
        u = P##_set1_ps(0.000198527617612853646278381f);                                             \
        u = P##_fmadd_ps(u, s, P##_set1_ps(0.00139304355252534151077271f));                          \
        u = P##_fmadd_ps(u, s, P##_set1_ps(0.00833336077630519866943359f));                          \
        u = P##_fmadd_ps(u, s, P##_set1_ps(0.0416664853692054748535156f));                           \
        u = P##_fmadd_ps(u, s, P##_set1_ps(0.166666671633720397949219f));                            \
        u = P##_fmadd_ps(u, s, P##_set1_ps(0.5f));                                                   \
        u = P##_add_ps(P##_set1_ps(1.0f), P##_fmadd_ps(P##_mul_ps(s, s), u, s));                     \
        const __m##W##i h = P##_srai_epi32(q, 1), rest = P##_sub_epi32(q, h);                        \
        const __m##W##i bias = P##_set1_epi32(0x7f);                                                 \
        u = P##_mul_ps(P##_mul_ps(u, P##_castsi##W##_ps(P##_slli_epi32(P##_add_epi32(h, bias), 23))), \
                       P##_castsi##W##_ps(P##_slli_epi32(P##_add_epi32(rest, bias), 23)));          \
    } while (0)

AVX2_INLINE __m256 exp8(__m256 d) {
    __m256 u;
    EXP_CORE(_mm256, 256, d, u);
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    return _mm256_blendv_ps(u, _mm256_set1_ps(__builtin_inff()),
                            _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

/* torch's vectorised SiLU, x / (1 + e^-x), in float32. */
AVX2_INLINE __m256 silu8(__m256 x) {
    const __m256 e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* silu(gate) * up into y, eight at a time: float32 as is; bfloat16 as torch runs the two ops
 * (SiLU in float32 rounded, the product in float32 rounded). */
AVX2_INLINE void silu_mul8_f32(
    float *y, const float *gate, const float *up) {
    _mm256_storeu_ps(y, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate)), _mm256_loadu_ps(up)));
}

AVX2_INLINE void silu_mul8_bf16(
    uint16_t *y, const uint16_t *gate, const uint16_t *up) {
    const __m256 s = widen_bf16(round_bf16(silu8(load8_bf16(gate))));
    pack_bf16(y, round_bf16(_mm256_mul_ps(s, load8_bf16(up))));
}

/* The same, sixteen lanes at a time on AVX-512: each lane the operations above in the same order
 * (a compare's mask in place of a blend's), so the same bits. */

AVX512_INLINE __m512 exp16(__m512 d) {
    __m512 u;
    EXP_CORE(_mm512, 512, d, u);
    u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), u, _mm512_setzero_ps());
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ), u,
                                _mm512_set1_ps(__builtin_inff()));
}

AVX512_INLINE __m512 silu16(__m512 x) {
    const __m512 e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000))));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

AVX512_INLINE void silu_mul16_f32(float *y, const float *gate, const float *up) {
    _mm512_storeu_ps(y, _mm512_mul_ps(silu16(_mm512_loadu_ps(gate)), _mm512_loadu_ps(up)));
}

AVX512_INLINE void silu_mul16_bf16(uint16_t *y, const uint16_t *gate, const uint16_t *up) {
    const __m512 s = widen16_bf16(round16_bf16(silu16(load16_bf16(gate))));
    pack16_bf16(y, round16_bf16(_mm512_mul_ps(s, load16_bf16(up))));
}

/* Elements below which a call stays on 8 lanes: a decode step's few rows took longer on 16 (the
 * wide units' start-up after the Python between calls). */
#define WIDE_WORK 16384

/* SwiGLU of a fused gate/up projection x [M, 2 * half] (rows ldx apart, half % 8 == 0) into
 * y [M, half] contiguous: every element on the vector formula, whatever its row's place or the
 * width of the vectors that ran it. */
#define DEFINE_SILU_MUL(NAME, T, SILU_MUL, SILU_MUL16)                                           \
    __attribute__((target("avx512f,avx2,fma"))) static void NAME##_512(                          \
        const T *x, int64_t ldx, T *y, int64_t r, int64_t half) {                                \
        int64_t k = 0;                                                                           \
        for (; k + 16 <= half; k += 16)                                                          \
            SILU_MUL16(y + r * half + k, x + r * ldx + k, x + r * ldx + half + k);               \
        for (; k < half; k += 8)                                                                 \
            SILU_MUL(y + r * half + k, x + r * ldx + k, x + r * ldx + half + k);                 \
    }                                                                                            \
    __attribute__((target("avx2,fma"))) void NAME(const void *xv, int64_t ldx, void *yv,         \
                                                  int64_t M, int64_t half) {                     \
        const T *x = xv;                                                                         \
        T *y = yv;                                                                               \
        const int wide = M * half >= WIDE_WORK && __builtin_cpu_supports("avx512f");             \
        _Pragma("omp parallel for if (M * half >= 32768)")                                       \
        for (int64_t r = 0; r < M; r++) {                                                        \
            if (wide) {                                                                          \
                NAME##_512(x, ldx, y, r, half);                                                  \
                continue;                                                                        \
            }                                                                                    \
            for (int64_t k = 0; k < half; k += 8)                                                \
                SILU_MUL(y + r * half + k, x + r * ldx + k, x + r * ldx + half + k);             \
        }                                                                                        \
    }

DEFINE_SILU_MUL(silu_mul_f32, float, silu_mul8_f32, silu_mul16_f32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, silu_mul8_bf16, silu_mul16_bf16)

/* The rows of the norms and the rotation above on sixteen lanes: each element the operations of
 * its 8-lane twin in the same order (the squares still summed in eight lanes, k % 8 each, the
 * upper eight of sixteen after the lower), so the same bits at either width. */
AVX512_INLINE void add16_f32(float *x, const float *d) {
    _mm512_storeu_ps(x, _mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(d)));
}

AVX512_INLINE void add16_bf16(uint16_t *x, const uint16_t *d) {
    pack16_bf16(x, round16_bf16(_mm512_add_ps(load16_bf16(x), load16_bf16(d))));
}

AVX512_INLINE void store16_f32(float *y, __m512 x, __m512 scale, __m512 w) {
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_mul_ps(x, scale), w));
}

AVX512_INLINE void store16_bf16(uint16_t *y, __m512 x, __m512 scale, __m512 w) {
    const __m512 normed = widen16_bf16(round16_bf16(_mm512_mul_ps(x, scale)));
    pack16_bf16(y, round16_bf16(_mm512_mul_ps(w, normed)));
}

AVX512_INLINE void rot16_f32(float *y, __m512 x, __m512 c, __m512 other, __m512 s) {
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(x, c), _mm512_mul_ps(other, s)));
}

AVX512_INLINE void rot16_bf16(uint16_t *y, __m512 x, __m512 c, __m512 other, __m512 s) {
    const __m512 a = widen16_bf16(round16_bf16(_mm512_mul_ps(x, c)));
    const __m512 b = widen16_bf16(round16_bf16(_mm512_mul_ps(other, s)));
    pack16_bf16(y, round16_bf16(_mm512_add_ps(a, b)));
}

/* rms_row_* and rotate_row_* on sixteen lanes (D % 16 == 0; rotating, D % 32 == 0). */
#define DEFINE_ROWS16(RMS, ROTATE, T, LOAD, STORE, ROT)                                          \
    AVX512_INLINE void RMS(const T *xr, const T *w, T *y, int64_t D, float eps) {                \
        __m256 acc = _mm256_setzero_ps();                                                        \
        for (int64_t k = 0; k < D; k += 16) {                                                    \
            const __m512 v = LOAD(xr + k);                                                       \
            const __m256 lo = _mm512_castps512_ps256(v);                                         \
            const __m256 hi = _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1)); \
            acc = _mm256_fmadd_ps(hi, hi, _mm256_fmadd_ps(lo, lo, acc));                         \
        }                                                                                        \
        const __m512 scale = _mm512_set1_ps(rms_scale(acc, D, eps));                             \
        for (int64_t k = 0; k < D; k += 16) STORE(y + k, LOAD(xr + k), scale, LOAD(w + k));     \
    }                                                                                            \
    AVX512_INLINE void ROTATE(const T *xr, const T *c, const T *s, T *yr, int64_t D) {          \
        const int64_t half = D / 2;                                                              \
        const __m512i sign = _mm512_set1_epi32((int)0x80000000);                                 \
        for (int64_t k = 0; k < half; k += 16) {                                                 \
            const __m512 x1 = LOAD(xr + k), x2 = LOAD(xr + half + k);                            \
            const __m512 minus = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), sign)); \
            ROT(yr + k, x1, LOAD(c + k), minus, LOAD(s + k));                                    \
            ROT(yr + half + k, x2, LOAD(c + half + k), x1, LOAD(s + half + k));                  \
        }                                                                                        \
    }

DEFINE_ROWS16(rms_row16_f32, rotate_row16_f32, float, load16_f32, store16_f32, rot16_f32)
DEFINE_ROWS16(rms_row16_bf16, rotate_row16_bf16, uint16_t, load16_bf16, store16_bf16, rot16_bf16)

/* Fused per-layer passes (layers/norm.py, rotary.py): the rows above, several in one call,
 * with the bits of the separate calls and torch ops they replace; on sixteen lanes where the
 * call is large enough (WIDE_WORK) and the rows' widths allow. */

/* The residual stream x [M, D] (rows ldx apart) plus d [M, D] (rows ldd apart) in place, then
 * y [M, D] contiguous = RMSNorm of the new x by w: a layer's `x = x + delta; h = norm(x)`. */
#define DEFINE_ADD_RMS_NORM(NAME, T, ADD, ROW, ADD16, ROW16)                                     \
    __attribute__((target("avx512f,avx2,fma"))) static void NAME##_512(                          \
        T *xr, const T *dr, const T *w, T *y, int64_t D, float eps) {                            \
        for (int64_t k = 0; k < D; k += 16) ADD16(xr + k, dr + k);                               \
        ROW16(xr, w, y, D, eps);                                                                 \
    }                                                                                            \
    __attribute__((target("avx2,fma"))) void NAME(void *xv, int64_t ldx, const void *dv,         \
                                                  int64_t ldd, const void *wv, void *yv,         \
                                                  int64_t M, int64_t D, float eps) {             \
        T *x = xv, *y = yv;                                                                      \
        const T *d = dv, *w = wv;                                                                \
        const int wide = D % 16 == 0 && M * D >= WIDE_WORK && __builtin_cpu_supports("avx512f"); \
        _Pragma("omp parallel for if (M >= 64)")                                                 \
        for (int64_t r = 0; r < M; r++) {                                                        \
            T *xr = x + r * ldx;                                                                 \
            if (wide) {                                                                          \
                NAME##_512(xr, d + r * ldd, w, y + r * D, D, eps);                               \
                continue;                                                                        \
            }                                                                                    \
            for (int64_t k = 0; k < D; k += 8) ADD(xr + k, d + r * ldd + k);                     \
            ROW(xr, w, y + r * D, D, eps);                                                       \
        }                                                                                        \
    }

DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, add8_f32, rms_row_f32, add16_f32, rms_row16_f32)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, add8_bf16, rms_row_bf16, add16_bf16, rms_row16_bf16)

/* q and k heads x [T, H, D] (rows ldt apart, heads ldh apart, D % 16 == 0) in place: each head
 * RMS-normed by wq (heads before `split`) or wk, rounded to the dtype, then rotated by cos and sin
 * [T, D]; wq NULL: rotated only. Attention's `cat(q_norm(q), k_norm(k))` then `rotate`. */
#define DEFINE_NORM_ROTATE(NAME, T, NORM_ROW, ROTATE_ROW, NORM_ROW16, ROTATE_ROW16)              \
    __attribute__((target("avx512f,avx2,fma"))) static void NAME##_512(                          \
        T *row, const T *w, float eps, const T *c, const T *s, int64_t D) {                      \
        if (w) {                                                                                 \
            T normed[D];                                                                         \
            NORM_ROW16(row, w, normed, D, eps);                                                  \
            ROTATE_ROW16(normed, c, s, row, D);                                                  \
        } else {                                                                                 \
            ROTATE_ROW16(row, c, s, row, D);                                                     \
        }                                                                                        \
    }                                                                                            \
    __attribute__((target("avx2,fma"))) void NAME(void *xv, int64_t ldt, int64_t ldh,            \
                                                  int64_t tokens, int64_t heads, int64_t split,  \
                                                  const void *wqv, const void *wkv, float eps,   \
                                                  const void *cosv, const void *sinv, int64_t D) { \
        T *x = xv;                                                                               \
        const T *wq = wqv, *wk = wkv, *cos = cosv, *sin = sinv;                                  \
        const int wide = D % 32 == 0 && tokens * heads * D >= WIDE_WORK                          \
                         && __builtin_cpu_supports("avx512f");                                   \
        _Pragma("omp parallel for if (tokens * heads >= 512)")                                   \
        for (int64_t i = 0; i < tokens * heads; i++) {                                           \
            const int64_t t = i / heads, h = i % heads;                                          \
            T *row = x + t * ldt + h * ldh;                                                      \
            if (wide) {                                                                          \
                NAME##_512(row, wq ? (h < split ? wq : wk) : 0, eps, cos + t * D, sin + t * D, D); \
                continue;                                                                        \
            }                                                                                    \
            if (wq) {                                                                            \
                T normed[D];                                                                     \
                NORM_ROW(row, h < split ? wq : wk, normed, D, eps);                              \
                ROTATE_ROW(normed, cos + t * D, sin + t * D, row, D);                            \
            } else {                                                                             \
                ROTATE_ROW(row, cos + t * D, sin + t * D, row, D);                               \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_NORM_ROTATE(norm_rotate_f32, float, rms_row_f32, rotate_row_f32, rms_row16_f32, rotate_row16_f32)
DEFINE_NORM_ROTATE(norm_rotate_bf16, uint16_t, rms_row_bf16, rotate_row_bf16, rms_row16_bf16,
                   rotate_row16_bf16)

/* x [n] float32 (n % 8 == 0) rounded into y [n] bfloat16: torch's `.to(torch.bfloat16)`. */
__attribute__((target("avx2,fma"))) void round_to_bf16(const float *x, uint16_t *y, int64_t n) {
#pragma omp parallel for if (n >= 65536)
    for (int64_t k = 0; k < n; k += 8) pack_bf16(y + k, round_bf16(_mm256_loadu_ps(x + k)));
}

/* Each token's k weighted expert outputs (layers/moe.py's Experts) summed: out[t] = the float32 sum
 * from zero, slot by slot in order, of down[r] * scale[r] (r = slots[t * k + s], or t * k + s
 * where slots is NULL), each product rounded to float32 first (no fused multiply-add): torch's
 * `down.mul_(scale)` then one `add_` a slot, in one pass over a token's rows. */
__attribute__((target("avx2,fma"))) void moe_sum_f32(const float *down, int64_t ldd, const float *scale,
                                                     const int64_t *slots, int64_t T, int64_t k, int64_t H,
                                                     float *out) {
#pragma omp parallel for if (T * k * H >= 262144)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            const int64_t r = slots ? slots[t * k + s] : t * k + s;
            const float w = scale[r], *d = down + r * ldd;
            for (int64_t h = 0; h < H; h++) o[h] += d[h] * w;
        }
    }
}

/* e^x of n values into e (n padded to whole lanes with e^-inf = 0): torch's exp. */
__attribute__((target("avx2,fma"))) static void exp_row(const float *x, int64_t n, float *e) {
    for (int64_t i = 0; i < n; i += 8) {
        float lane[8];
        for (int j = 0; j < 8; j++) lane[j] = i + j < n ? x[i + j] : -__builtin_inff();
        _mm256_storeu_ps(e + i, exp8(_mm256_loadu_ps(lane)));
    }
}

/* The k largest of v [n] (not taken before), in descending order, a tie to the lower index. */
static void top_k(const float *v, int64_t n, int64_t k, char *taken, int64_t *ids) {
    memset(taken, 0, n);
    for (int64_t s = 0; s < k; s++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || v[e] > v[best])) best = e;
        taken[best] = 1, ids[s] = best;
    }
}

/* A MoE route of T rows of router logits [T, E] (ldl apart) into weights [T, k] and expert ids
 * [T, k] (descending), each row on its own logits:
 *   ROUTE_SOFTMAX_TOPK (Qwen-MoE, layers/moe.py's softmax_topk): a softmax over the E experts
 *     (torch's exp, the sum in expert order), the k largest probabilities;
 *   ROUTE_SOFTMAX_TOPK_NORM: the same, divided by their sum (in that order), `norm_topk_prob`;
 *   ROUTE_TOPK_SOFTMAX (gpt-oss): the k largest logits, weighted by a softmax over them.
 * A tie goes to the lower id. */
__attribute__((target("avx2,fma"))) void moe_route_f32(const float *logits, int64_t ldl, int64_t T, int64_t E,
                                                       int64_t k, int64_t mode, float *weights, int64_t *ids) {
#pragma omp parallel for if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * ldl;
        float p[E + 8], *w = weights + t * k, top = l[0], sum = 0.0f;
        int64_t *id = ids + t * k;
        char taken[E];
        if (mode == ROUTE_TOPK_SOFTMAX) {
            float chosen[k], e[k + 8];
            top_k(l, E, k, taken, id);
            for (int64_t s = 0; s < k; s++) chosen[s] = l[id[s]] - l[id[0]];
            exp_row(chosen, k, e);
            for (int64_t s = 0; s < k; s++) sum += e[s];
            for (int64_t s = 0; s < k; s++) w[s] = e[s] / sum;
            continue;
        }
        for (int64_t e = 1; e < E; e++)
            if (l[e] > top) top = l[e];
        float shifted[E];
        for (int64_t e = 0; e < E; e++) shifted[e] = l[e] - top;
        exp_row(shifted, E, p);
        for (int64_t e = 0; e < E; e++) sum += p[e];
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        top_k(p, E, k, taken, id);
        float total = 0.0f;
        for (int64_t s = 0; s < k; s++) w[s] = p[id[s]], total += w[s];
        if (mode == ROUTE_SOFTMAX_TOPK_NORM)
            for (int64_t s = 0; s < k; s++) w[s] /= total;
    }
}

/* gpt-oss's SwiGLU of x [M, 2 * half] ([gate | up], rows ldx apart, half % 8 == 0) into y [M, half]
 * contiguous: the gate clamped above at `limit`, up to [-limit, limit] (a NaN kept, as torch's
 * clamp keeps it), then (up + 1) * (gate * sigmoid(alpha * gate)), sigmoid(z) = 1 / (1 + e^-z) on
 * torch's exp: each element on its own. */
__attribute__((target("avx2,fma"))) void clamped_swiglu_f32(const float *x, int64_t ldx, float *y, int64_t M,
                                                            int64_t half, float alpha, float limit) {
    const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
    const __m256 a = _mm256_set1_ps(alpha), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for if (M * half >= 32768)
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < half; i += 8) {
            const __m256 gate = _mm256_min_ps(hi, _mm256_loadu_ps(x + r * ldx + i)); /* NaN: the second */
            const __m256 up = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(x + r * ldx + half + i)));
            const __m256 e = exp8(_mm256_xor_ps(_mm256_mul_ps(gate, a), sign));
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
            _mm256_storeu_ps(y + r * half + i, _mm256_mul_ps(_mm256_add_ps(up, one), _mm256_mul_ps(gate, sig)));
        }
}

#else

int grouped_gemm_supported(void) { return 0; }

#endif
