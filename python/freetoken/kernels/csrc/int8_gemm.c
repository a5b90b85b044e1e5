/* The int8-activation arithmetic (`--quantized-arithmetic int8`): y[R, N] = x[R, K] @ W[N, K]^T
 * (+ bias) on GGUF blocks read in place (Q8_0, Q4_K, Q5_K, Q6_K), x quantized per row to int8 and
 * multiplied on integer dot products, as llama.cpp's vec_dot kernels do, in an order that makes a
 * row's bits independent of its batch, its thread and the instruction set.
 *
 * THE ARITHMETIC. Each row of x is cut into blocks of 32 values along K; block j gets the scale
 * dx_j = amax_j / 127 (amax the largest |x| in it), its values q = rint(x * (1 / dx_j)) (nearest,
 * ties to even; zero where amax is 0) in [-127, 127], and B_j = sum q (float32, exact). Every
 * format's weight block j (32 values along K) is read as 32 integer codes c, two int16 scales
 * (a for values 0-15, b for 16-31), a float scale s and a float minimum m:
 *   Q8_0  c the int8 quants, a = b = 1, s = d, m = 0
 *   Q4_K  c the 4-bit codes of sub-block j, a = b = its 6-bit scale, s = d, m = -(dmin * its min)
 *   Q5_K  likewise with 5-bit codes
 *   Q6_K  c the 6-bit codes minus 32, a and b its two sub-blocks' int8 scales, s = d, m = 0
 * so that the block's weights are s * a * c (or b) + m, exactly gguf's values. Its int32 sum
 * I_j = a * sum_(v<16) c_v q_v + b * sum_(v>=16) c_v q_v is exact (integer, no overflow), and
 *   acc = 0; for j = 0, 1, ...: acc = acc + dx_j * (s_j * (float)I_j + m_j * B_j); y = acc + bias
 * with each operation rounded to float32 on its own (no fused multiply-add), in block order. The
 * AVX2 path computes eight output columns' accs in a vector's eight lanes, each lane this very
 * sequence, and the scalar path one column at a time: the same bits. A K cut into parts (the
 * tensor-parallel emulation, distributed/parts.py) sums each part from zero and adds the parts in
 * order, the bias in the first, as quant_gemm.c's item_parts.
 *
 * THE DOT PRODUCTS (AVX2). Per block and column, maddubs (unsigned codes times signed quants,
 * pairs summed in int16) then madd by [a x8 | b x8] (quads summed in int32); signed codes use the
 * sign trick (|c| times q with c's sign), and no pair sum reaches int16's bound (|c| <= 128,
 * |q| <= 127). Eight columns' eight-lane vectors are summed across lanes by a tree of hadds, which
 * leaves the eight columns' I_j in one vector for the float part.
 *
 * How it runs: the rows are quantized once a call; work items are (a block of up to 64 rows, of
 * one MoE group in int8_gemm_grouped, and eight output columns), in parallel over torch's OpenMP
 * threads; an item unpacks its columns' weights eight blocks at a time into a tile in L1 (the
 * scalar path in plain C, the AVX2 one in vector registers: the same integers) and runs its rows
 * over the tile, two rows sharing each load (AVX2). No VNNI, AVX512-VNNI or AMX path yet.
 *
 * Built at first use by kernels/build.py for int8.py. Signatures: kernels.h.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

enum { Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define NT 8      /* output columns per item */
#define UNIT 8    /* blocks of 32 per unpacked tile (a K-quant's super-block) */
#define ROWS 64   /* most rows per item */
#define INLINE static inline __attribute__((always_inline))

/* One tile: UNIT blocks of NT columns. */
typedef struct {
    int8_t c[UNIT][NT][32];
    int16_t ab[UNIT][NT][16]; /* a x8, b x8 */
    float s[UNIT][NT], m[UNIT][NT];
} tile_t;

INLINE float half(const uint8_t *p) { /* float16 as float32, exactly */
    const uint32_t h = p[0] | (uint32_t)p[1] << 8, sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, man = h & 1023;
    if (e == 0) {
        const float f = (float)man * 0x1p-24f; /* subnormal: exact */
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (e == 31 ? 0x7F800000u : (e + 112) << 23) | man << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static int block_bytes(int type) {
    return type == Q8_0 ? 34 : type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
}

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j (gguf's get_scale_min). */
INLINE void k_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63, *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | (q[j - 4] >> 6) << 4;
        *mn = (q[j + 4] >> 4) | (q[j] >> 6) << 4;
    }
}

INLINE void set_ab(tile_t *t, int u, int n, int a, int b) {
    for (int v = 0; v < 8; v++) t->ab[u][n][v] = (int16_t)a, t->ab[u][n][8 + v] = (int16_t)b;
}

/* Blocks [j0, j0 + count) (of 32 values, count <= UNIT, whole super-blocks for K-quants) of the
 * weight row w into column n of the tile. */
INLINE void unpack(int type, const uint8_t *w, int64_t j0, int count, tile_t *t, int n) {
    if (type == Q8_0) {
        for (int u = 0; u < count; u++) {
            const uint8_t *b = w + (j0 + u) * 34;
            memcpy(t->c[u][n], b + 2, 32);
            set_ab(t, u, n, 1, 1);
            t->s[u][n] = half(b), t->m[u][n] = 0.0f;
        }
        return;
    }
    const uint8_t *b = w + j0 / 8 * block_bytes(type);
    if (type == Q6_K) {
        const float d = half(b + 208);
        for (int u = 0; u < 8; u++) {
            const int h = u / 4, g = u % 4; /* half, and 32-value group within it */
            const uint8_t *ql = b + 64 * h + 32 * (g & 1), *qh = b + 128 + 32 * h;
            for (int v = 0; v < 32; v++)
                t->c[u][n][v] = (int8_t)((((ql[v] >> 4 * (g >> 1)) & 15) | ((qh[v] >> 2 * g) & 3) << 4) - 32);
            set_ab(t, u, n, (int8_t)b[192 + 2 * u], (int8_t)b[193 + 2 * u]);
            t->s[u][n] = d, t->m[u][n] = 0.0f;
        }
        return;
    }
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *qs = b + (type == Q4_K ? 16 : 48), *qh = b + 16;
    for (int u = 0; u < 8; u++) {
        int sc, mn;
        k_scale_min(b + 4, u, &sc, &mn);
        for (int v = 0; v < 32; v++) {
            int c = (qs[32 * (u / 2) + v] >> 4 * (u & 1)) & 15;
            if (type == Q5_K) c |= ((qh[v] >> u) & 1) << 4;
            t->c[u][n][v] = (int8_t)c;
        }
        set_ab(t, u, n, sc, sc);
        t->s[u][n] = d, t->m[u][n] = -(dmin * (float)mn);
    }
}

/* Columns [n0, n0 + cols) of the tile from weight rows w + n * ldw; columns past cols zero. */
INLINE void unpack_tile(int type, const uint8_t *w, int64_t ldw, int cols, int64_t j0, int count, tile_t *t) {
    for (int n = 0; n < cols; n++) unpack(type, w + n * ldw, j0, count, t, n);
    for (int n = cols; n < NT; n++)
        for (int u = 0; u < count; u++) {
            memset(t->c[u][n], 0, 32);
            set_ab(t, u, n, 0, 0);
            t->s[u][n] = t->m[u][n] = 0.0f;
        }
}

/* Row x (K values) to q (int8), dx and B per block of 32. */
INLINE void quantize_row(const float *x, int64_t K, int8_t *q, float *dx, float *bs) {
    for (int64_t j = 0; j < K / 32; j++) {
        const float *v = x + 32 * j;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            const int c = (int)rintf(v[i] * id);
            q[32 * j + i] = (int8_t)c;
            sum += c;
        }
        dx[j] = d, bs[j] = (float)sum;
    }
}

/* The scalar path: tile blocks [0, count) into the rows' accs (acc[r][n]). */
static void rows_scalar(const tile_t *t, int count, int64_t j0, const int8_t *q, const float *dx,
                        const float *bs, int64_t K, int64_t rows, float (*acc)[NT]) {
    for (int64_t r = 0; r < rows; r++)
        for (int n = 0; n < NT; n++) {
            float a = acc[r][n];
            for (int u = 0; u < count; u++) {
                const int64_t j = j0 + u;
                const int8_t *x = q + r * K + 32 * j;
                int lo = 0, hi = 0;
                for (int v = 0; v < 16; v++) lo += t->c[u][n][v] * x[v], hi += t->c[u][n][16 + v] * x[16 + v];
                const int I = t->ab[u][n][0] * lo + t->ab[u][n][8] * hi;
                a = a + dx[r * (K / 32) + j] * (t->s[u][n] * (float)I + t->m[u][n] * bs[r * (K / 32) + j]);
            }
            acc[r][n] = a;
        }
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2")))

AVX2 INLINE __m256i dot(__m256i c, __m256i x, __m256i ab, int sign) {
    const __m256i p = sign ? _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c))
                           : _mm256_maddubs_epi16(c, x);
    return _mm256_madd_epi16(p, ab);
}

/* Lane n: the sum of column n's eight lanes, from h[i] = hadd(column 2i's, column 2i + 1's). */
AVX2 INLINE __m256i lane_sums(const __m256i h[NT / 2]) {
    const __m256i s0 = _mm256_hadd_epi32(h[0], h[1]), s1 = _mm256_hadd_epi32(h[2], h[3]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

/* Rows r to r + NR - 1 (NR 1 or 2: two rows share each load of the tile) over tile blocks [0, count). */
AVX2 INLINE void rows_at(const tile_t *t, int count, int64_t j0, const int8_t *q, const float *dx, const float *bs,
                         int64_t K, int64_t r, int NR, int sign, float (*acc)[NT]) {
    __m256 a[2];
    for (int i = 0; i < NR; i++) a[i] = _mm256_loadu_ps(acc[r + i]);
    for (int u = 0; u < count; u++) {
        const int64_t j = j0 + u;
        __m256i x[2], h[2][NT / 2];
        for (int i = 0; i < NR; i++) x[i] = _mm256_loadu_si256((const __m256i *)(q + (r + i) * K + 32 * j));
        for (int n = 0; n < NT; n += 2) {
            const __m256i c0 = _mm256_loadu_si256((const __m256i *)t->c[u][n]);
            const __m256i c1 = _mm256_loadu_si256((const __m256i *)t->c[u][n + 1]);
            const __m256i ab0 = _mm256_loadu_si256((const __m256i *)t->ab[u][n]);
            const __m256i ab1 = _mm256_loadu_si256((const __m256i *)t->ab[u][n + 1]);
            for (int i = 0; i < NR; i++)
                h[i][n / 2] = _mm256_hadd_epi32(dot(c0, x[i], ab0, sign), dot(c1, x[i], ab1, sign));
        }
        const __m256 s = _mm256_loadu_ps(t->s[u]), m = _mm256_loadu_ps(t->m[u]);
        for (int i = 0; i < NR; i++) {
            const int64_t at = (r + i) * (K / 32) + j;
            const __m256 w = _mm256_add_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(lane_sums(h[i]))),
                                           _mm256_mul_ps(m, _mm256_set1_ps(bs[at])));
            a[i] = _mm256_add_ps(a[i], _mm256_mul_ps(_mm256_set1_ps(dx[at]), w));
        }
    }
    for (int i = 0; i < NR; i++) _mm256_storeu_ps(acc[r + i], a[i]);
}

/* The AVX2 path: rows_scalar's sums, eight columns in a vector's lanes. */
#define ROWS_AVX2(SIGN)                                                                                  \
    AVX2 static void rows_avx2_##SIGN(const tile_t *t, int count, int64_t j0, const int8_t *q,          \
                                      const float *dx, const float *bs, int64_t K, int64_t rows,        \
                                      float (*acc)[NT]) {                                               \
        int64_t r = 0;                                                                                  \
        for (; r + 1 < rows; r += 2) rows_at(t, count, j0, q, dx, bs, K, r, 2, SIGN, acc);              \
        if (r < rows) rows_at(t, count, j0, q, dx, bs, K, r, 1, SIGN, acc);                              \
    }
ROWS_AVX2(0)
ROWS_AVX2(1)

/* unpack's super-block formats in vector registers (the same integers; a decode step's rows
 * are too few to amortise the plain loops). */
AVX2 static void unpack_k_avx2(int type, const uint8_t *b, tile_t *t, int n) {
    const __m256i four = _mm256_set1_epi8(15);
    if (type == Q6_K) {
        const float d = half(b + 208);
        /* The 16 int8 scales widened, scales 0-7 in both halves of one vector and 8-15 of the
         * other: block u's [a x8 | b x8] is one byte shuffle of the first (u < 4) or second. */
        const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m256i first = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc));
        const __m256i second = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc, 8)));
        for (int u = 0; u < 8; u++) {
            const int h = u / 4, g = u % 4;
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (g & 1)));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i low = g >> 1 ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), four) : _mm256_and_si256(ql, four);
            const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), _mm256_set1_epi8(3)), 4);
            _mm256_storeu_si256((__m256i *)t->c[u][n], _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32)));
            const int at = 4 * (u % 4); /* byte offset of int16 2(u % 4) */
            _mm256_storeu_si256((__m256i *)t->ab[u][n],
                                _mm256_shuffle_epi8(u < 4 ? first : second,
                                                    _mm256_setr_m128i(_mm_set1_epi16((short)((at + 1) << 8 | at)),
                                                                      _mm_set1_epi16((short)((at + 3) << 8 | (at + 2))))));
            t->s[u][n] = d, t->m[u][n] = 0.0f;
        }
        return;
    }
    const float d = half(b);
    const uint8_t *qs = b + (type == Q4_K ? 16 : 48);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
    /* k_scale_min's eight scales and mins at once: the 12 bytes shuffled to [0-3 | 8-11 | 4-7 |
     * 8-11], each group masked to its part (scale_0-3's 6 bits, scale_4-7's low nibbles, min_0-3's
     * 6 bits, min_4-7's high nibbles shifted down), bytes 0-3's and 4-7's top two bits shifted
     * under groups 1 and 3: [scale_0-7 | min_0-7]. */
    const __m128i q12 = _mm_loadu_si128((const __m128i *)(b + 4)); /* (its last 4 bytes: codes, unused) */
    const __m128i low = _mm_shuffle_epi8(q12, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(q12, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i six = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m128i bytes = _mm_or_si128(
        _mm_or_si128(_mm_and_si128(low, six), _mm_and_si128(_mm_srli_epi16(low, 4), _mm_setr_epi32(0, 0, 0, 0x0F0F0F0F))),
        _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(bytes));
    float m[8];
    _mm256_storeu_ps(m, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half(b + 2)),
                                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))),
                                      _mm256_set1_ps(-0.0f)));
    for (int u = 0; u < 8; u++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (u / 2)));
        __m256i c = u & 1 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), four) : _mm256_and_si256(q, four);
        if (type == Q5_K)
            c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, u), _mm256_set1_epi8(1)), 4));
        _mm256_storeu_si256((__m256i *)t->c[u][n], c);
        _mm256_storeu_si256((__m256i *)t->ab[u][n], _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((2 * u + 1) << 8 | 2 * u))));
        t->s[u][n] = d, t->m[u][n] = m[u];
    }
}

AVX2 static void unpack_tile_avx2(int type, const uint8_t *w, int64_t ldw, int cols, int64_t j0, int count,
                                  tile_t *t) {
    if (cols < NT) {
        unpack_tile(type, w, ldw, cols, j0, count, t);
    } else if (type == Q8_0) {
        for (int n = 0; n < NT; n++)
            for (int u = 0; u < count; u++) {
                const uint8_t *b = w + n * ldw + (j0 + u) * 34;
                _mm256_storeu_si256((__m256i *)t->c[u][n], _mm256_loadu_si256((const __m256i *)(b + 2)));
                _mm256_storeu_si256((__m256i *)t->ab[u][n], _mm256_set1_epi16(1));
                t->s[u][n] = half(b), t->m[u][n] = 0.0f;
            }
    } else {
        for (int n = 0; n < NT; n++) unpack_k_avx2(type, w + n * ldw + j0 / 8 * block_bytes(type), t, n);
    }
}

AVX2 static void quantize_avx2(const float *x, int64_t K, int8_t *q, float *dx, float *bs) {
    quantize_row(x, K, q, dx, bs);
}

/* 1: AVX2, 0: the scalar path only. */
int int8_path(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}
#else
int int8_path(void) { return 0; }
#endif

int int8_supported(void) { return 1; }

static void quantize(int path, const float *x, int64_t K, int8_t *q, float *dx, float *bs) {
#if defined(__x86_64__)
    if (path) {
        quantize_avx2(x, K, q, dx, bs);
        return;
    }
#endif
    quantize_row(x, K, q, dx, bs);
}

/* One item: rows [0, rows) (their q, dx, B) against columns [0, cols) of w, y as item_parts. */
static void item(int path, int type, const uint8_t *w, int64_t ldw, int cols, const float *bias, const int8_t *q,
                 const float *dx, const float *bs, int64_t K, int64_t rows, int64_t S, const int64_t *cuts,
                 float *y, int64_t ldy) {
    tile_t t __attribute__((aligned(64)));
    float acc[ROWS][NT];
    const int sign = type == Q8_0 || type == Q6_K;
    for (int64_t s = 0; s < S; s++) {
        memset(acc, 0, sizeof acc);
        for (int64_t j0 = cuts[s] / 32; j0 < cuts[s + 1] / 32; j0 += UNIT) {
            const int count = cuts[s + 1] / 32 - j0 < UNIT ? (int)(cuts[s + 1] / 32 - j0) : UNIT;
#if defined(__x86_64__)
            if (path) {
                unpack_tile_avx2(type, w, ldw, cols, j0, count, &t);
                (sign ? rows_avx2_1 : rows_avx2_0)(&t, count, j0, q, dx, bs, K, rows, acc);
                continue;
            }
#endif
            (void)sign;
            unpack_tile(type, w, ldw, cols, j0, count, &t);
            rows_scalar(&t, count, j0, q, dx, bs, K, rows, acc);
        }
        for (int64_t r = 0; r < rows; r++)
            for (int n = 0; n < cols; n++) {
                float *at = y + r * ldy + n;
                *at = s ? *at + acc[r][n] : bias ? acc[r][n] + bias[n] : acc[r][n];
            }
    }
}

/* quant_gemm_parts's arguments (a projection of P parts in formats types[p], bias[p] or NULL,
 * K in S parts at cuts, NULL: whole), on the int8 arithmetic. path: 1 AVX2, 0 scalar. */
void int8_gemm_parts(int path, int64_t P, const int *types, const uint8_t *const *w, const int64_t *ldw,
                     const int64_t *n, const float *const *bias, int64_t S, const int64_t *cuts, const float *x,
                     int64_t ldx, float *y, int64_t ldy, int64_t R, int64_t K) {
    const int64_t whole[2] = {0, K}, nb = K / 32;
    if (!cuts) S = 1, cuts = whole;
    int8_t *q = malloc(R * K + 64);
    float *dx = malloc((R * nb + 1) * sizeof(float)), *bs = malloc((R * nb + 1) * sizeof(float));
    _Pragma("omp parallel for schedule(static) if (R > 1)")
    for (int64_t r = 0; r < R; r++) quantize(path, x + r * ldx, K, q + r * K, dx + r * nb, bs + r * nb);
    int64_t start[P + 1], col[P + 1]; /* each part's first item and first column */
    part_items(P, n, (R + ROWS - 1) / ROWS, NT, start, col);
    _Pragma("omp parallel for schedule(guided) if (start[P] > 1)")
    for (int64_t it = 0; it < start[P]; it++) {
        const int64_t p = owner(start, P, it), tiles = (n[p] + NT - 1) / NT, local = it - start[p];
        const int64_t c0 = local % tiles * NT, r0 = local / tiles * ROWS;
        const int cols = n[p] - c0 < NT ? (int)(n[p] - c0) : NT;
        item(path, types[p], w[p] + c0 * ldw[p], ldw[p], cols, bias[p] ? bias[p] + c0 : 0, q + r0 * K,
             dx + r0 * nb, bs + r0 * nb, K, R - r0 < ROWS ? R - r0 : ROWS, S, cuts, y + r0 * ldy + col[p] + c0,
             ldy);
    }
    free(q), free(dx), free(bs);
}

/* Experts' rows (quant_gemm's arguments: x [*, K] float32, w uint8 [E][N][K's blocks] at strides
 * lde and ldw bytes, y [*, N], groups [G][3]: expert, first row, rows, covering rows [0, R)) on
 * the int8 arithmetic, each row as int8_gemm_parts computes it alone. */
void int8_gemm_grouped(int path, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t lde, int64_t ldw,
                       float *y, int64_t ldy, const int64_t *groups, int64_t G, int64_t R, int64_t K, int64_t N) {
    const int64_t whole[2] = {0, K}, nb = K / 32, tiles = (N + NT - 1) / NT;
    int8_t *q = malloc(R * K + 64);
    float *dx = malloc((R * nb + 1) * sizeof(float)), *bs = malloc((R * nb + 1) * sizeof(float));
    int64_t *start = malloc((G + 1) * sizeof(int64_t)); /* each group's first item */
    _Pragma("omp parallel for schedule(static) if (R > 1)")
    for (int64_t r = 0; r < R; r++) quantize(path, x + r * ldx, K, q + r * K, dx + r * nb, bs + r * nb);
    start[0] = 0;
    for (int64_t g = 0; g < G; g++) start[g + 1] = start[g] + (groups[3 * g + 2] + ROWS - 1) / ROWS * tiles;
    _Pragma("omp parallel for schedule(guided) if (start[G] > 1)")
    for (int64_t it = 0; it < start[G]; it++) {
        const int64_t g = owner(start, G, it), local = it - start[g], c0 = local % tiles * NT;
        const int64_t r0 = groups[3 * g + 1] + local / tiles * ROWS, left = groups[3 * g + 1] + groups[3 * g + 2] - r0;
        item(path, type, w + groups[3 * g] * lde + c0 * ldw, ldw, N - c0 < NT ? (int)(N - c0) : NT, 0, q + r0 * K,
             dx + r0 * nb, bs + r0 * nb, K, left < ROWS ? left : ROWS, 1, whole, y + r0 * ldy + c0, ldy);
    }
    free(q), free(dx), free(bs), free(start);
}
