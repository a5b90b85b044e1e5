/* The int8-activation arithmetic (`--quantized-arithmetic int8`): y[R, N] = x[R, K] @ W[N, K]^T
 * (+ bias) on GGUF blocks read in place (Q8_0, Q4_K, Q5_K, Q6_K, MXFP4), x quantized per row to
 * int8 and multiplied on integer dot products, as llama.cpp's vec_dot kernels do, in an order that makes a
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
 *   MXFP4 c its e2m1 values doubled (gguf's kvalues: 0, 1, 2, 3, 4, 6, 8, 12 and their
 *         negatives), a = b = 1, s = half its E8M0 scale's power of two (gguf's
 *         e8m0_to_fp32_half: a power of two, subnormal at e = 0 and 1), m = 0
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
 * pairs summed in int16) then madd by ones (quads summed in int32); Q8_0's signed codes use the
 * sign trick (|c| times q with c's sign), Q6_K's are read plus 32 (unsigned), 32 times the
 * quants' sums coming off later, and MXFP4's plus 12 likewise (its nibbles looked up in a table of
 * the values plus 12 by one shuffle); no pair sum reaches int16's bound (|c| <= 128, |q| <= 127).
 * Eight columns' eight-lane vectors are added across lanes by unpacks (a hadd costs four times as much
 * on Zen 3) down to each column's two half sums, which are multiplied by a and b and added: the
 * eight columns' I_j in one vector for the float part, the integers the scalar path sums.
 *
 * How it runs: the rows are quantized once a call; work items are (a block of up to 64 rows, of
 * one MoE group in int8_gemm_grouped, and eight output columns), in parallel over torch's OpenMP
 * threads, which take runs of consecutive items. An item walks K a unit (eight blocks: a K-quant's
 * super-block) at a time. The scalar path unpacks the unit's codes and scales into a tile in plain
 * C and runs its rows over it. The AVX2 path reads the unit's scales for its eight columns at once
 * (their float16s converted together, their scales and mins transposed to a vector a block,
 * MXFP4's E8M0 bytes gathered a block at a time); then an item of FEW rows or fewer (a decode
 * step's, most MoE experts' 1-2) makes each block's codes in registers and multiplies them at
 * once, two rows sharing each code vector, while fetching its share of item it + 1's weight (the
 * thread's own next item but at the end of its run; another part's or expert's after a switch),
 * whose NT rows its units sweep front to back as one run: at one row, storing the codes to a tile
 * and loading them back cost as much as the multiplies. More rows share codes made once a unit
 * into a tile in L1: pack_by_group's below, but Q8_0's (whose codes reach 128: times quants plus
 * 128, maddubs's int16 pairs would overflow), which keeps a tile of each column's 32 codes.
 *
 * THE VNNI PATHS (AVX-VNNI, AVX512-VNNI; the same instruction, vpdpbusd, in its two encodings): at
 * FEW_VNNI rows or fewer, the AVX2 path with each maddubs-and-madd pair one vpdpbusd (dot4). At
 * more, and on AVX2 with dot4's three instructions, a tile of another layout (pack_by_group):
 * block u's codes by group of four values, the eight columns' four bytes of group g in one
 * vector, so that one vpdpbusd of a row's four quants (broadcast, plus 128: unsigned) adds into
 * eight columns' lanes at once and no sum crosses lanes (each lane starts at -128 times its codes'
 * sum); two chains a row, up to four rows sharing each code vector. AVX512-VNNI runs both on 512-bit vectors, two blocks of a column (few
 * rows) or of a group (the tile) in one. The same integers I_j, and each acc takes its blocks'
 * terms in order: the same bits as every other path. No AMX path yet.
 *
 * Built at first use by kernels/build.py for int8.py; the AVX2 path needs F16C too (which every
 * AVX2 CPU has). Signatures: kernels.h.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

enum { Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };

#define NT 8      /* output columns per item */
#define UNIT 8    /* blocks of 32 an item takes at a time (a K-quant's super-block) */
#define ROWS 64   /* most rows per item */
#define FEW 4     /* most rows per item that skip the tile (AVX2) */
#define FEW_VNNI 2 /* the same on the VNNI paths, whose tile costs less a row */
#define INLINE static inline __attribute__((always_inline))
enum { VEX = 1, EVEX = 2 }; /* vpdpbusd's encodings (dot4) */

/* The scalar path's tile: a unit of NT columns. */
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
    return type == Q8_0 ? 34 : type == MXFP4 ? 17 : type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
}

/* Formats of 32-value blocks (a unit: up to UNIT of them one after another), not super-blocks. */
#define SMALL(type) ((type) == Q8_0 || (type) == MXFP4)
/* The format whose block's halves have scales of their own (a != b). */
#define HALVES(type) ((type) == Q6_K)
/* Does a tile of more than FEW rows take pack_by_group's layout? On VNNI, yes; on AVX2, where each
 * vpdpbusd is a maddubs, a madd and an add, for every format whose codes are within +-32 (the quants
 * plus 128, up to 255, times them in pairs stays within int16: not Q8_0's up to 128). */
#define BY_GROUP(type, vnni) ((vnni) || (type) != Q8_0)

/* A weight row's UNIT blocks from j0 on (a K-quant's super-block, or Q8_0's or MXFP4's blocks
 * one after another). */
INLINE const uint8_t *unit_at(int type, const uint8_t *w, int64_t j0) {
    return w + (SMALL(type) ? j0 * block_bytes(type) : j0 / 8 * block_bytes(type));
}

/* MXFP4's e2m1 values doubled (gguf's kvalues), and its E8M0 byte as half its power of two
 * (gguf's e8m0_to_fp32_half; e = 0 and 1 subnormal, 255 2^127): s * c is exactly gguf's value. */
static const int8_t E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* E2M1 plus 12 (unsigned, 0-24): the vector paths' codes, one shuffle of the nibbles */
static const int8_t E2M1_PLUS12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
INLINE float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
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
    const uint8_t *b = unit_at(type, w, j0);
    if (type == Q8_0) {
        for (int u = 0; u < count; u++) {
            memcpy(t->c[u][n], b + 34 * u + 2, 32);
            set_ab(t, u, n, 1, 1);
            t->s[u][n] = half(b + 34 * u), t->m[u][n] = 0.0f;
        }
        return;
    }
    if (type == MXFP4) { /* value v: byte 1 + v % 16's low nibble (v < 16) or high (v >= 16) */
        for (int u = 0; u < count; u++) {
            for (int v = 0; v < 32; v++) t->c[u][n][v] = E2M1[(b[17 * u + 1 + v % 16] >> 4 * (v / 16)) & 15];
            set_ab(t, u, n, 1, 1);
            t->s[u][n] = e8m0_half(b[17 * u]), t->m[u][n] = 0.0f;
        }
        return;
    }
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
#define AVX2 __attribute__((target("avx2,f16c")))

/* The eight columns' float16s at col[n] + at as float32 lanes (F16C: exactly half()'s values). */
AVX2 INLINE __m256 float16s(const uint8_t *const *col, int at) {
    uint16_t h[NT];
    for (int n = 0; n < NT; n++) memcpy(&h[n], col[n] + at, 2);
    return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

/* k_scale_min's eight scales and mins of two columns at once, one in each 128-bit lane: the 12
 * bytes q (bytes 4-15 of the super-block) shuffled to [0-3 | 8-11 | 4-7 | 8-11], each group masked
 * to its part (scale_0-3's 6 bits, scale_4-7's low nibbles, min_0-3's 6 bits, min_4-7's high
 * nibbles shifted down), bytes 0-3's and 4-7's top two bits shifted under groups 1 and 3:
 * [scale_0-7 | min_0-7]. */
AVX2 INLINE __m256i k_scales_mins(__m256i q) {
#define LANES(...) _mm256_setr_epi8(__VA_ARGS__, __VA_ARGS__)
    const __m256i low = _mm256_shuffle_epi8(q, LANES(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m256i top = _mm256_shuffle_epi8(q, LANES(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m256i six = LANES(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m256i nibbles = LANES(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
#undef LANES
    const __m256i parts = _mm256_or_si256(_mm256_and_si256(low, six), _mm256_and_si256(_mm256_srli_epi16(low, 4), nibbles));
    return _mm256_or_si256(parts, _mm256_and_si256(_mm256_srli_epi16(top, 2), _mm256_set1_epi8(0x30)));
}

/* Words by column to words by index, in each 128-bit lane: word n of out[k] is word k of y[n]. */
AVX2 INLINE void transpose_words(const __m256i y[NT], __m256i out[NT]) {
    __m256i two[NT], four[NT];
    for (int i = 0; i < 4; i++) { /* words 0-3, 4-7 of y[2i], y[2i + 1] interleaved */
        two[2 * i] = _mm256_unpacklo_epi16(y[2 * i], y[2 * i + 1]);
        two[2 * i + 1] = _mm256_unpackhi_epi16(y[2 * i], y[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) /* four[4i + k]: words 2k, 2k + 1 of columns 4i to 4i + 3 */
        for (int k = 0; k < 2; k++) {
            four[4 * i + 2 * k] = _mm256_unpacklo_epi32(two[4 * i + k], two[4 * i + 2 + k]);
            four[4 * i + 2 * k + 1] = _mm256_unpackhi_epi32(two[4 * i + k], two[4 * i + 2 + k]);
        }
    for (int k = 0; k < 4; k++) {
        out[2 * k] = _mm256_unpacklo_epi64(four[k], four[4 + k]);
        out[2 * k + 1] = _mm256_unpackhi_epi64(four[k], four[4 + k]);
    }
}

/* What the AVX2 path reads of a unit of eight columns besides the codes: per block u, the
 * columns' s and m in lanes, and (K-quants) the integer scales in block_sums's lanes, lo[u]
 * [a | b] of columns 0-3 and hi[u] of columns 4-7; and, at more than FEW rows, the codes, made
 * once for every row. */
typedef struct {
    __m256 s[UNIT], m[UNIT];
    __m256i lo[UNIT], hi[UNIT];
    union {
        int8_t c[UNIT][NT][32];
        __m256i by_group[UNIT / 2][8][2]; /* pack_by_group's: [u / 2][g][u % 2] */
    };
    __m256i a[UNIT], b[UNIT], offset[UNIT][2]; /* pack_by_group's */
} unit_t;

/* unit_t's lo and hi from the eight columns' a and b (int16 each). */
AVX2 INLINE void ab_lanes(__m128i a, __m128i b, __m256i *lo, __m256i *hi) {
    *lo = _mm256_cvtepi16_epi32(_mm_unpacklo_epi64(a, b)), *hi = _mm256_cvtepi16_epi32(_mm_unpackhi_epi64(a, b));
}

/* unpack's scales in vector registers, once a unit for its eight columns col[n]: read column
 * after column (half() each, k_scale_min bit by bit) they cost as much as the multiplies at one
 * row; here the float16s are converted eight at a time and the scales (and mins) transposed from
 * per column to per block as int16 words. */
AVX2 INLINE void head_avx2(int type, const uint8_t *const *col, int count, unit_t *un) {
    __m256i y[NT], by[NT];
    if (type == Q8_0) {
        for (int u = 0; u < count; u++) un->s[u] = float16s(col, 34 * u);
        return;
    }
    if (type == MXFP4) { /* each block's eight E8M0 bytes gathered (as dwords) and made e8m0_half */
        int32_t off[NT]; /* (columns at most 7 rows apart: well within int32) */
        for (int n = 0; n < NT; n++) off[n] = (int32_t)(col[n] - col[0]);
        const __m256i at = _mm256_loadu_si256((const __m256i *)off);
        for (int u = 0; u < count; u++) {
            const __m256i e = _mm256_and_si256(_mm256_i32gather_epi32((const int *)(col[0] + 17 * u), at, 1),
                                               _mm256_set1_epi32(255));
            const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
            const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e); /* e < 2 */
            const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
            un->s[u] = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
        }
        return;
    }
    if (type == Q6_K) {
        for (int n = 0; n < NT; n++) /* its 16 int8 scales (a, b of block u: 2u, 2u + 1) widened */
            y[n] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(col[n] + 192)));
        transpose_words(y, by); /* by[k]: scale k of the columns | scale 8 + k */
        const __m256 d = float16s(col, 208);
        for (int u = 0; u < UNIT; u++) {
            const __m256i a = by[2 * u % 8], b = by[2 * u % 8 + 1];
            ab_lanes(u < 4 ? _mm256_castsi256_si128(a) : _mm256_extracti128_si256(a, 1),
                     u < 4 ? _mm256_castsi256_si128(b) : _mm256_extracti128_si256(b, 1), &un->lo[u], &un->hi[u]);
            un->s[u] = d;
        }
        return;
    }
    for (int n = 0; n < NT; n += 2) {
        const __m256i sm =
            k_scales_mins(_mm256_loadu2_m128i((const __m128i *)(col[n + 1] + 4), (const __m128i *)(col[n] + 4)));
        y[n] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(sm));
        y[n + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(sm, 1));
    }
    transpose_words(y, by); /* by[u]: scale u of the columns | min u */
    const __m256 d = float16s(col, 0), dmin = float16s(col, 2);
    for (int u = 0; u < UNIT; u++) {
        const __m128i a = _mm256_castsi256_si128(by[u]), mins = _mm256_extracti128_si256(by[u], 1);
        ab_lanes(a, a, &un->lo[u], &un->hi[u]);
        un->s[u] = d;
        const __m256 min = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(mins));
        un->m[u] = _mm256_xor_ps(_mm256_mul_ps(dmin, min), _mm256_set1_ps(-0.0f)); /* -(dmin * min) */
    }
}

/* unpack's codes of block u in a vector register, from the unit's bytes b alone (Q6_K's plus 32:
 * unsigned, 0-63; MXFP4's plus 12: unsigned, 0-24, one table lookup of the nibbles, the 16 bytes
 * in both lanes, shifted 4 in the high one). */
AVX2 INLINE __m256i codes_avx2(int type, const uint8_t *b, int u) {
    const __m256i four = _mm256_set1_epi8(15);
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 34 * u + 2));
    if (type == MXFP4) {
        const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 17 * u + 1)));
        const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
        const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(q, shift), four);
        const __m256i plus12 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_PLUS12));
        return _mm256_shuffle_epi8(plus12, nibbles);
    }
    if (type == Q6_K) { /* code bits 4-5: bits 2g, 2g + 1 of qh's bytes, shifted in place */
        const int h = u / 4, g = u % 4; /* half, and 32-value group within it */
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (g & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i low = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(ql, 4) : ql, four);
        const __m256i high = g < 3 ? _mm256_slli_epi16(qh, 4 - 2 * g) : _mm256_srli_epi16(qh, 2);
        return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
    }
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (type == Q4_K ? 16 : 48) + 32 * (u / 2)));
    const __m256i c = _mm256_and_si256(u & 1 ? _mm256_srli_epi16(q, 4) : q, four);
    if (type == Q4_K) return c;
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)); /* code bit 4: bit u of qh's bytes */
    const __m256i high = u < 4 ? _mm256_slli_epi16(qh, 4 - u) : _mm256_srli_epi16(qh, u - 4);
    return _mm256_or_si256(c, _mm256_and_si256(high, _mm256_set1_epi8(0x10)));
}

/* acc plus, in lane i, the four products u_b s_b of bytes 4i to 4i + 3 (u unsigned, s signed)
 * summed in int32. Without VNNI, maddubs (pairs, in int16) then madd by ones; with it, one
 * vpdpbusd in its VEX (AVX-VNNI) or EVEX (AVX512-VNNI with VL) encoding, written as assembly so
 * that this file builds with the AVX2 target alone and runs each encoding only where the probe
 * found it. The same integers: no pair sum reaches maddubs's int16 bound (|u| <= 128, |s| <= 127). */
AVX2 INLINE __m256i dot4_add(int vnni, __m256i acc, __m256i u, __m256i s) {
    if (!vnni) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
    if (vnni == VEX)
        __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
    else
        __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}

AVX2 INLINE __m256i dot4(int vnni, __m256i u, __m256i s) { return dot4_add(vnni, _mm256_setzero_si256(), u, s); }

/* A column's eight lanes of int32 sums of c_v q_v by four (unsigned codes times signed quants, or
 * Q8_0's signed codes by the sign trick, |c| times q with c's sign): lanes 0-3 of values 0-15,
 * 4-7 of 16-31. */
AVX2 INLINE __m256i quads(int type, int vnni, __m256i c, __m256i x) {
    return type == Q8_0 ? dot4(vnni, _mm256_abs_epi8(c), _mm256_sign_epi8(x, c)) : dot4(vnni, c, x);
}

/* Two columns' quads a and b halved: [a0+a2, b0+b2, a1+a3, b1+b3 | the same of lanes 4-7]. (By
 * unpacks and an add: a hadd costs four times as much on Zen 3.) */
AVX2 INLINE __m256i octs(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

/* [o sum_(v<16) q_v x4 | o sum_(v>=16) q_v x4] of a row's block x (o: the codes' offset). */
AVX2 INLINE __m256i half_sums(int o, int vnni, __m256i x) {
    const __m256i t = dot4(vnni, _mm256_set1_epi8((char)o), x);
    const __m256i t2 = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0x4E));
    return _mm256_add_epi32(t2, _mm256_shuffle_epi32(t2, 0xB1));
}

/* The eight columns' I_j from h[i] = octs of columns 2i and 2i + 1 (a row's block x): halving
 * again leaves [sum_(v<16) | sum_(v>=16)] of columns 0-3 in one vector and of 4-7 in another,
 * multiplied there by a and b (lo, hi: a K-quant's scales), and added across halves. Q6_K's codes
 * are read plus 32 (MXFP4's plus 12), so 32 (12) times x's sums over each half come off first. */
AVX2 INLINE __m256i block_sums(int type, int vnni, const __m256i h[NT / 2], __m256i lo, __m256i hi, __m256i x) {
    __m256i s0 = _mm256_add_epi32(_mm256_unpacklo_epi64(h[0], h[1]), _mm256_unpackhi_epi64(h[0], h[1]));
    __m256i s1 = _mm256_add_epi32(_mm256_unpacklo_epi64(h[2], h[3]), _mm256_unpackhi_epi64(h[2], h[3]));
    if (type == Q6_K || type == MXFP4) {
        const __m256i xo = half_sums(type == Q6_K ? 32 : 12, vnni, x);
        s0 = _mm256_sub_epi32(s0, xo), s1 = _mm256_sub_epi32(s1, xo);
    }
    if (!SMALL(type)) s0 = _mm256_mullo_epi32(s0, lo), s1 = _mm256_mullo_epi32(s1, hi);
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

/* Rows r to r + NR - 1 (NR 1 or 2: two rows share each code vector) over the unit's blocks [0,
 * count), the codes read from un->c, or (few) made by codes_avx2 from the columns' bytes col[n]
 * just before their multiplies, never stored. */
AVX2 INLINE void rows_at(int type, int vnni, int few, const unit_t *un, const uint8_t *const *col, int count, int64_t j0,
                         const int8_t *q, const float *dx, const float *bs, int64_t K, int64_t r, int NR,
                         float (*acc)[NT]) {
    __m256 a[2];
    for (int i = 0; i < NR; i++) a[i] = _mm256_loadu_ps(acc[r + i]);
#pragma GCC unroll 8 /* (a K-quant's count is UNIT: u a constant in codes_avx2) */
    for (int u = 0; u < count; u++) {
        const int64_t j = j0 + u;
        __m256i x[2], h[2][NT / 2];
        for (int i = 0; i < NR; i++) x[i] = _mm256_loadu_si256((const __m256i *)(q + (r + i) * K + 32 * j));
        for (int n = 0; n < NT; n += 2) {
            __m256i c[2];
            for (int e = 0; e < 2; e++)
                c[e] = few ? codes_avx2(type, col[n + e], u) : _mm256_loadu_si256((const __m256i *)un->c[u][n + e]);
            for (int i = 0; i < NR; i++) h[i][n / 2] = octs(quads(type, vnni, c[0], x[i]), quads(type, vnni, c[1], x[i]));
        }
        for (int i = 0; i < NR; i++) {
            const int64_t at = (r + i) * (K / 32) + j;
            const __m256i I = block_sums(type, vnni, h[i], un->lo[u], un->hi[u], x[i]);
            const __m256 m = type == Q4_K || type == Q5_K ? un->m[u] : _mm256_setzero_ps();
            const __m256 w = _mm256_add_ps(_mm256_mul_ps(un->s[u], _mm256_cvtepi32_ps(I)),
                                           _mm256_mul_ps(m, _mm256_set1_ps(bs[at])));
            a[i] = _mm256_add_ps(a[i], _mm256_mul_ps(_mm256_set1_ps(dx[at]), w));
        }
    }
    for (int i = 0; i < NR; i++) _mm256_storeu_ps(acc[r + i], a[i]);
}

/* Dwords by column to dwords by index: dword n of out[g] is dword g of y[n]. */
AVX2 INLINE void transpose_dwords(const __m256i y[NT], __m256i out[8]) {
    __m256i two[NT], four[NT];
    for (int i = 0; i < 4; i++) { /* dwords 0-1, 2-3 (and 4-7's) of y[2i], y[2i + 1] interleaved */
        two[2 * i] = _mm256_unpacklo_epi32(y[2 * i], y[2 * i + 1]);
        two[2 * i + 1] = _mm256_unpackhi_epi32(y[2 * i], y[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) /* four[4i + g]: dword g | 4 + g of columns 4i to 4i + 3 */
        for (int k = 0; k < 2; k++) {
            four[4 * i + 2 * k] = _mm256_unpacklo_epi64(two[4 * i + k], two[4 * i + 2 + k]);
            four[4 * i + 2 * k + 1] = _mm256_unpackhi_epi64(two[4 * i + k], two[4 * i + 2 + k]);
        }
    for (int g = 0; g < 4; g++) {
        out[g] = _mm256_permute2x128_si256(four[g], four[4 + g], 0x20);
        out[4 + g] = _mm256_permute2x128_si256(four[g], four[4 + g], 0x31);
    }
}

/* The tile of BY_GROUP's formats, once a unit for every row: block u's signed codes by group of four values
 * (by_group[u / 2][g][u % 2]: values 4g to 4g + 3 of the eight columns, column n's in dword n; the
 * two blocks of a pair side by side, one 512-bit vector), so that one
 * vpdpbusd of a row's four quants (broadcast) sums them into eight columns' lanes at once, with no
 * sums across lanes after. The rows' quants come plus 128 (unsigned: vpdpbusd's first factor), so
 * each lane starts at -128 times its codes' sum over the half it sums (Q6_K's, whose a and b
 * differ) or the block: offset[u]. And the scales a and b in the columns' lanes. */
AVX2 INLINE void pack_by_group(int type, int vnni, const uint8_t *const *col, int count, unit_t *un) {
    const __m256i plus = _mm256_set1_epi8((char)(type == Q6_K ? 32 : type == MXFP4 ? 12 : 0));
    for (int u = 0; u < count; u++) {
        __m256i y[NT];
        for (int n = 0; n < NT; n++) y[n] = _mm256_sub_epi8(codes_avx2(type, col[n], u), plus);
        __m256i by_group[8];
        transpose_dwords(y, by_group);
        __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int g = 0; g < 8; g++) {
            un->by_group[u / 2][g][u % 2] = by_group[g];
            sums[HALVES(type) && g >= 4] = dot4_add(vnni, sums[HALVES(type) && g >= 4], _mm256_set1_epi8(1),
                                                    by_group[g]);
        }
        for (int h = 0; h < 2; h++) un->offset[u][h] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums[h], 7));
        un->a[u] = _mm256_permute2x128_si256(un->lo[u], un->hi[u], 0x20);
        un->b[u] = _mm256_permute2x128_si256(un->lo[u], un->hi[u], 0x31);
    }
}

/* Rows r to r + NR - 1 (NR <= 4: they share each code vector) on pack_by_group's tile, their quants plus
 * 128 in qu: rows_at's sums, each lane's I_j summed in place. */
AVX2 INLINE void rows_by_group_at(int type, int vnni, const unit_t *un, int count, int64_t j0, const uint8_t *qu,
                              const float *dx, const float *bs, int64_t K, int64_t r, int NR, float (*acc)[NT]) {
    __m256 a[4];
    for (int i = 0; i < NR; i++) a[i] = _mm256_loadu_ps(acc[r + i]);
    for (int u = 0; u < count; u++) {
        const int64_t j = j0 + u;
        __m256i sums[4][2]; /* two chains a row: the halves, or (a == b) even and odd groups */
        for (int i = 0; i < NR; i++)
            sums[i][0] = un->offset[u][0], sums[i][1] = HALVES(type) ? un->offset[u][1] : _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
            const int h = HALVES(type) ? g >= 4 : g & 1;
            for (int i = 0; i < NR; i++) {
                int32_t four;
                memcpy(&four, qu + (r + i) * K + 32 * j + 4 * g, 4);
                sums[i][h] = dot4_add(vnni, sums[i][h], _mm256_set1_epi32(four), un->by_group[u / 2][g][u % 2]);
            }
        }
        for (int i = 0; i < NR; i++) {
            const int64_t at = (r + i) * (K / 32) + j;
            const __m256i both = _mm256_add_epi32(sums[i][0], sums[i][1]);
            const __m256i I = SMALL(type)       ? both
                              : HALVES(type) ? _mm256_add_epi32(_mm256_mullo_epi32(sums[i][0], un->a[u]),
                                                                 _mm256_mullo_epi32(sums[i][1], un->b[u]))
                                             : _mm256_mullo_epi32(both, un->a[u]);
            const __m256 m = type == Q4_K || type == Q5_K ? un->m[u] : _mm256_setzero_ps();
            const __m256 w = _mm256_add_ps(_mm256_mul_ps(un->s[u], _mm256_cvtepi32_ps(I)),
                                           _mm256_mul_ps(m, _mm256_set1_ps(bs[at])));
            a[i] = _mm256_add_ps(a[i], _mm256_mul_ps(_mm256_set1_ps(dx[at]), w));
        }
    }
    for (int i = 0; i < NR; i++) _mm256_storeu_ps(acc[r + i], a[i]);
}

/* This unit's share, [at, at + bytes), of the next item's weight (its NT rows at stride ldw taken
 * as one run, which the item's units sweep front to back), fetched while the unit is multiplied:
 * at few rows an item waits on reading the weight. Fetching instead the next item's same unit of
 * each row (8 rows' blocks a row apart) streamed experts from DRAM slower: one row each of 8 of
 * 128 experts, Zen 3, 1 / 2 threads, Q4_K 768 x 2048 8.9 / 14.1 GB/s against 6.9 / 11.1, Q6_K
 * 2048 x 768 9.5 / 13.5 against 5.9 / 8.7; a 6144 x 2048 Q4_K layer 8.8 / 13.2 against 6.7 / 10.6.
 * Two items ahead was no faster (Q6_K slower), the next item's unit into L1 as well no faster,
 * _MM_HINT_T1 the same as T0, and skipping the bytes of other K parts (a row's part at a wider ldw,
 * int8.py's k_parts) slower by the arithmetic than fetching them. */
AVX2 INLINE void fetch_next(const uint8_t *at, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)at + o, _MM_HINT_T0);
}

/* fetch_next of the unit at block j0. */
AVX2 INLINE void fetch_unit_share(const uint8_t *next, int64_t ldw, int64_t K, int64_t j0) {
    const int64_t units = (K / 32 + UNIT - 1) / UNIT, share = (NT * ldw + units - 1) / units;
    fetch_next(next + j0 / UNIT * share, share);
}

/* rows_at over rows [0, rows), two at a time. */
AVX2 INLINE void rows_avx2(int type, int vnni, int few, const unit_t *un, const uint8_t *const *col, int count, int64_t j0,
                           const int8_t *q, const float *dx, const float *bs, int64_t K, int64_t rows,
                           float (*acc)[NT]) {
    int64_t r = 0;
    for (; r + 1 < rows; r += 2) rows_at(type, vnni, few, un, col, count, j0, q, dx, bs, K, r, 2, acc);
    if (r < rows) rows_at(type, vnni, few, un, col, count, j0, q, dx, bs, K, r, 1, acc);
}

/* The AVX2 path, one unit (blocks [j0, j0 + count)) of an item: rows_scalar's sums, eight columns
 * in a vector's lanes (columns past cols repeat the last: their lanes are dropped). An item of FEW
 * rows or fewer multiplies each block's codes as they are made, each pair of rows making them
 * again: at one row, storing them and loading them back cost as much as the multiplies, and at 3-4
 * rows making them twice still cost no more (measured). More rows share codes made once a unit. */
/* f(r, NR) over rows [0, rows) four at a time, then the rest (NR a constant for the unrolled loops). */
#define IN_FOURS(rows, f)                                                                                   \
    do {                                                                                                    \
        int64_t r_ = 0;                                                                                     \
        for (; r_ + 3 < (rows); r_ += 4) f(r_, 4);                                                          \
        switch ((rows) - r_) {                                                                              \
        case 3: f(r_, 3); break;                                                                            \
        case 2: f(r_, 2); break;                                                                            \
        case 1: f(r_, 1); break;                                                                            \
        }                                                                                                   \
    } while (0)

/* What every vector path does first a unit: its columns' blocks col[n] (columns past cols repeat
 * the last), their scales (head_avx2), and its share of the next item's weight fetched; the count
 * of blocks (a K-quant's whole super-block: a constant for the unrolled loops). */
AVX2 INLINE int unit_start(int type, const uint8_t *w, int64_t ldw, int cols, int64_t j0, int count, int64_t K,
                           const uint8_t *next, const uint8_t **col, unit_t *un) {
    if (!SMALL(type)) count = UNIT;
    for (int n = 0; n < NT; n++) col[n] = unit_at(type, w + (n < cols ? n : cols - 1) * ldw, j0);
    head_avx2(type, col, count, un);
    if (next) fetch_unit_share(next, ldw, K, j0);
    return count;
}

AVX2 INLINE void unit_avx2(int type, int vnni, const uint8_t *w, int64_t ldw, int cols, int64_t j0, int count,
                           const int8_t *q, const uint8_t *qu, const float *dx, const float *bs, int64_t K, int64_t rows,
                           float (*acc)[NT], const uint8_t *next) {
    const uint8_t *col[NT];
    unit_t un;
    count = unit_start(type, w, ldw, cols, j0, count, K, next, col, &un);
    if (rows <= (vnni ? FEW_VNNI : FEW)) {
        rows_avx2(type, vnni, 1, &un, col, count, j0, q, dx, bs, K, rows, acc);
        return;
    }
    if (BY_GROUP(type, vnni)) {
        pack_by_group(type, vnni, col, count, &un);
#define AT(r, NR) rows_by_group_at(type, vnni, &un, count, j0, qu, dx, bs, K, r, NR, acc)
        IN_FOURS(rows, AT);
#undef AT
        return;
    }
    for (int n = 0; n < NT; n++)
        for (int u = 0; u < count; u++) _mm256_storeu_si256((__m256i *)un.c[u][n], codes_avx2(type, col[n], u));
    rows_avx2(type, vnni, 0, &un, col, count, j0, q, dx, bs, K, rows, acc);
}

/* The AVX512-VNNI path's FEW_VNNI rows or fewer: rows_at's sums on 512-bit vectors, two blocks
 * (u, u + 1) of a column in one, half the instructions a block. The same integers I_j, and each
 * column's acc takes block u's term, then u + 1's: the same bits. */
#define AVX512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* Blocks u and u + 1 (u even) of a column's codes as codes_avx2 makes them, u in the low half:
 * Q4_K's two are the low and high nibbles of the same 32 bytes. */
AVX512 INLINE __m512i codes_512(int type, const uint8_t *b, int u) {
    if (type == MXFP4) { /* codes_avx2's, both blocks' nibbles shifted, masked and looked up at once:
                          * 6-9 % faster than two of codes_avx2 (alternated calls, four experts of
                          * one row, Zen 5) */
        const __m512i q = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 17 * u + 1)))),
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 17 * u + 18))), 1);
        const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
        const __m512i plus12 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_PLUS12));
        return _mm512_shuffle_epi8(plus12, _mm512_and_si512(_mm512_srlv_epi32(q, shift), _mm512_set1_epi8(15)));
    }
    if (type == Q4_K) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (u / 2))));
        const __m512i shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
        return _mm512_and_si512(_mm512_srlv_epi64(q, shift), _mm512_set1_epi8(15));
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(codes_avx2(type, b, u)), codes_avx2(type, b, u + 1), 1);
}

/* head_avx2's MXFP4 scales of a whole unit without its eight gathers (AVX512-VBMI, the
 * avx512_vbmi path): column n's unit bytes [0, 128) in two registers, one two-table byte
 * permute taking its eight E8M0 bytes (at 17 u) to bytes 8 u + n of one register, whose
 * sixteen bytes of blocks u, u + 1 are then widened and made e8m0_half at once. The same
 * values; the one-row expert call 1.3x as fast (alternated builds, Zen 5): the gathers had
 * taken a third of it. Not inlined: the AVX512 path's functions that call it lack VBMI. */
__attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vbmi"), noinline)) static void
mxfp4_scales_vbmi(const uint8_t *const *col, unit_t *un) {
    const __m512i at = _mm512_set_epi64(0x7777777777777777LL, 0x6666666666666666LL, 0x5555555555555555LL,
                                        0x4444444444444444LL, 0x3333333333333333LL, 0x2222222222222222LL,
                                        0x1111111111111111LL, 0); /* byte 8 u + n: 17 u */
    __m512i z = _mm512_setzero_si512();
    for (int n = 0; n < NT; n++) {
        const __m512i lo = _mm512_loadu_si512((const void *)col[n]), hi = _mm512_loadu_si512((const void *)(col[n] + 64));
        z = _mm512_mask_mov_epi8(z, 0x0101010101010101ULL << n, _mm512_permutex2var_epi8(lo, at, hi));
    }
    for (int u = 0; u < UNIT; u += 2) {
        const __m512i e = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(z, u / 2));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e); /* e < 2 */
        const __m512i s = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, tiny);
        un->s[u] = _mm256_castsi256_ps(_mm512_castsi512_si256(s));
        un->s[u + 1] = _mm256_castsi256_ps(_mm512_extracti64x4_epi64(s, 1));
    }
}

/* quads on two blocks: Q8_0's signed codes by |c| times q negated where c < 0 (no vpsignb here). */
AVX512 INLINE __m512i quads_512(int type, __m512i c, __m512i x) {
    if (type == Q8_0) {
        const __m512i s = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(c), _mm512_setzero_si512(), x);
        return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(c), s);
    }
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, x);
}

/* octs in each 128-bit lane. */
AVX512 INLINE __m512i octs_512(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}

/* Two ymm vectors as one, a in the low half. */
AVX512 INLINE __m512i pair_i(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
AVX512 INLINE __m512 pair_f(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}
/* [v[0] x8 | v[1] x8] */
AVX512 INLINE __m512 two_floats(const float *v) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)v))));
}

/* A row's eight accs a plus blocks u's and u + 1's terms (I [u | u + 1], their s and m in sv and
 * mv, the row's dx and B of both at dx[0..1], bs[0..1]), u's first: rows_at's float steps. */
AVX512 INLINE __m256 add_two_blocks(__m256 a, __m512i I, __m512 sv, __m512 mv, const float *dx, const float *bs) {
    const __m512 w = _mm512_add_ps(_mm512_mul_ps(sv, _mm512_cvtepi32_ps(I)), _mm512_mul_ps(mv, two_floats(bs)));
    const __m512 t = _mm512_mul_ps(two_floats(dx), w);
    return _mm256_add_ps(_mm256_add_ps(a, _mm512_castps512_ps256(t)), _mm512_extractf32x8_ps(t, 1));
}

/* block_sums of blocks u, u + 1 from h[i] = octs_512 of columns 2i, 2i + 1: [I_u of the eight
 * columns | I_(u+1)]. Each 128-bit lane of s0 (columns 0-3) and s1 (4-7) holds a half's sums: u's
 * low, u's high, u + 1's low, u + 1's high. */
AVX512 INLINE __m512i block_sums_512(int type, const __m512i h[NT / 2], const unit_t *un, int u, __m512i x) {
    __m512i s0 = _mm512_add_epi32(_mm512_unpacklo_epi64(h[0], h[1]), _mm512_unpackhi_epi64(h[0], h[1]));
    __m512i s1 = _mm512_add_epi32(_mm512_unpacklo_epi64(h[2], h[3]), _mm512_unpackhi_epi64(h[2], h[3]));
    if (type == Q6_K || type == MXFP4) { /* half_sums in each 128-bit lane */
        const __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)(type == Q6_K ? 32 : 12)), x);
        const __m512i t2 = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, 0x4E));
        const __m512i xo = _mm512_add_epi32(t2, _mm512_shuffle_epi32(t2, 0xB1));
        s0 = _mm512_sub_epi32(s0, xo), s1 = _mm512_sub_epi32(s1, xo);
    }
    if (!SMALL(type))
        s0 = _mm512_mullo_epi32(s0, pair_i(un->lo[u], un->lo[u + 1])),
        s1 = _mm512_mullo_epi32(s1, pair_i(un->hi[u], un->hi[u + 1]));
    const __m512i sum = _mm512_add_epi32(_mm512_shuffle_i64x2(s0, s1, _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i64x2(s0, s1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_shuffle_i64x2(sum, sum, _MM_SHUFFLE(3, 1, 2, 0)); /* [u 0-3, u 4-7, u+1 0-3, u+1 4-7] */
}

/* rows_at (few) on rows [0, NR), NR <= 2 sharing each code vector, blocks two at a time. */
AVX512 INLINE void rows_512(int type, const unit_t *un, const uint8_t *const *col, int count, int64_t j0,
                            const int8_t *q, const float *dx, const float *bs, int64_t K, int NR,
                            float (*acc)[NT]) {
    __m256 a[2];
    for (int i = 0; i < NR; i++) a[i] = _mm256_loadu_ps(acc[i]);
#pragma GCC unroll 4
    for (int u = 0; u < count; u += 2) {
        const int64_t j = j0 + u;
        __m512i x[2], h[2][NT / 2];
        for (int i = 0; i < NR; i++) x[i] = _mm512_loadu_si512((const void *)(q + i * K + 32 * j));
        for (int n = 0; n < NT; n += 2) {
            const __m512i c0 = codes_512(type, col[n], u), c1 = codes_512(type, col[n + 1], u);
            for (int i = 0; i < NR; i++) h[i][n / 2] = octs_512(quads_512(type, c0, x[i]), quads_512(type, c1, x[i]));
        }
        const __m512 sv = pair_f(un->s[u], un->s[u + 1]);
        const __m512 mv = type == Q4_K || type == Q5_K ? pair_f(un->m[u], un->m[u + 1]) : _mm512_setzero_ps();
        for (int i = 0; i < NR; i++) {
            const int64_t at = i * (K / 32) + j;
            a[i] = add_two_blocks(a[i], block_sums_512(type, h[i], un, u, x[i]), sv, mv, dx + at, bs + at);
        }
    }
    for (int i = 0; i < NR; i++) _mm256_storeu_ps(acc[i], a[i]);
}

/* rows_by_group_at on the AVX512-VNNI path, blocks two at a time (count even): group g of blocks
 * u and u + 1 in one 512-bit vector, each row's four quants of both (one 64-byte load a pair of
 * blocks, one permute a group) multiplied in one vpdpbusd; each column's acc takes block u's term,
 * then u + 1's: the same bits. */
AVX512 INLINE void rows_by_group_512(int type, const unit_t *un, int count, int64_t j0, const uint8_t *qu,
                                     const float *dx, const float *bs, int64_t K, int64_t r, int NR,
                                     float (*acc)[NT]) {
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    __m256 a[4];
    for (int i = 0; i < NR; i++) a[i] = _mm256_loadu_ps(acc[r + i]);
    for (int u = 0; u < count; u += 2) {
        const int64_t j = j0 + u;
        __m512i x[4], sums[4][2];
        const __m512i first = pair_i(un->offset[u][0], un->offset[u + 1][0]);
        const __m512i second = HALVES(type) ? pair_i(un->offset[u][1], un->offset[u + 1][1]) : _mm512_setzero_si512();
        for (int i = 0; i < NR; i++)
            x[i] = _mm512_loadu_si512((const void *)(qu + (r + i) * K + 32 * j)), sums[i][0] = first, sums[i][1] = second;
        for (int g = 0; g < 8; g++) {
            const int h = HALVES(type) ? g >= 4 : g & 1;
            const __m512i c = _mm512_loadu_si512((const void *)un->by_group[u / 2][g]);
            const __m512i at = _mm512_add_epi32(halves, _mm512_set1_epi32(g));
            for (int i = 0; i < NR; i++) sums[i][h] = _mm512_dpbusd_epi32(sums[i][h], _mm512_permutexvar_epi32(at, x[i]), c);
        }
        const __m512 sv = pair_f(un->s[u], un->s[u + 1]);
        const __m512 mv = type == Q4_K || type == Q5_K ? pair_f(un->m[u], un->m[u + 1]) : _mm512_setzero_ps();
        const __m512i av = pair_i(un->a[u], un->a[u + 1]), bv = pair_i(un->b[u], un->b[u + 1]);
        for (int i = 0; i < NR; i++) {
            const int64_t at = (r + i) * (K / 32) + j;
            const __m512i both = _mm512_add_epi32(sums[i][0], sums[i][1]);
            const __m512i I = SMALL(type)       ? both
                              : HALVES(type) ? _mm512_add_epi32(_mm512_mullo_epi32(sums[i][0], av),
                                                                 _mm512_mullo_epi32(sums[i][1], bv))
                                             : _mm512_mullo_epi32(both, av);
            a[i] = add_two_blocks(a[i], I, sv, mv, dx + at, bs + at);
        }
    }
    for (int i = 0; i < NR; i++) _mm256_storeu_ps(acc[r + i], a[i]);
}

/* unit_avx2 on the AVX512-VNNI path: FEW_VNNI rows or fewer two blocks of a column a vector
 * (rows_512), more on the tile two blocks of a group a vector (rows_by_group_512); an odd count (a
 * K's last Q8_0 or MXFP4 blocks) on the 256-bit code. */
AVX512 INLINE void unit_512(int type, int vbmi, const uint8_t *w, int64_t ldw, int cols, int64_t j0, int count,
                            const int8_t *q, const uint8_t *qu, const float *dx, const float *bs, int64_t K,
                            int64_t rows, float (*acc)[NT], const uint8_t *next) {
    const uint8_t *col[NT];
    unit_t un;
    if (vbmi && type == MXFP4 && count == UNIT) {
        for (int n = 0; n < NT; n++) col[n] = unit_at(type, w + (n < cols ? n : cols - 1) * ldw, j0);
        mxfp4_scales_vbmi(col, &un);
        if (next) fetch_unit_share(next, ldw, K, j0);
    } else
        count = unit_start(type, w, ldw, cols, j0, count, K, next, col, &un);
    if (rows <= FEW_VNNI) {
        if (count % 2)
            rows_avx2(type, EVEX, 1, &un, col, count, j0, q, dx, bs, K, rows, acc);
        else if (rows == 2) /* (the count a constant for the unrolled loops) */
            rows_512(type, &un, col, count, j0, q, dx, bs, K, 2, acc);
        else
            rows_512(type, &un, col, count, j0, q, dx, bs, K, 1, acc);
        return;
    }
    pack_by_group(type, EVEX, col, count, &un);
#define AT(r, NR) rows_by_group_at(type, EVEX, &un, count, j0, qu, dx, bs, K, r, NR, acc)
#define AT_512(r, NR) rows_by_group_512(type, &un, count, j0, qu, dx, bs, K, r, NR, acc)
    if (count % 2)
        IN_FOURS(rows, AT);
    else
        IN_FOURS(rows, AT_512);
#undef AT
#undef AT_512
}

typedef void unit_fn(const uint8_t *w, int64_t ldw, int cols, int64_t j0, int count, const int8_t *q,
                     const uint8_t *qu, const float *dx, const float *bs, int64_t K, int64_t rows, float (*acc)[NT],
                     const uint8_t *next);
#define UNIT_AVX2(TYPE, VNNI)                                                                               \
    AVX2 static void unit_avx2_##TYPE##_##VNNI(const uint8_t *w, int64_t ldw, int cols, int64_t j0,         \
                                               int count, const int8_t *q, const uint8_t *qu, const float *dx,\
                                               const float *bs, int64_t K, int64_t rows, float (*acc)[NT],  \
                                               const uint8_t *next) {                                       \
        unit_avx2(TYPE, VNNI, w, ldw, cols, j0, count, q, qu, dx, bs, K, rows, acc, next);                  \
    }
#define UNITS_AVX2(VNNI) UNIT_AVX2(Q8_0, VNNI) UNIT_AVX2(Q4_K, VNNI) UNIT_AVX2(Q5_K, VNNI) UNIT_AVX2(Q6_K, VNNI) \
    UNIT_AVX2(MXFP4, VNNI)
UNITS_AVX2(0)
UNITS_AVX2(VEX)
#define UNIT_EVEX(TYPE)                                                                                     \
    AVX512 static void unit_avx2_##TYPE##_EVEX(const uint8_t *w, int64_t ldw, int cols, int64_t j0, int count,\
                                               const int8_t *q, const uint8_t *qu, const float *dx,         \
                                               const float *bs, int64_t K, int64_t rows, float (*acc)[NT],  \
                                               const uint8_t *next) {                                       \
        unit_512(TYPE, 0, w, ldw, cols, j0, count, q, qu, dx, bs, K, rows, acc, next);                      \
    }
UNIT_EVEX(Q8_0)
UNIT_EVEX(Q4_K)
UNIT_EVEX(Q5_K)
UNIT_EVEX(Q6_K)
UNIT_EVEX(MXFP4)
AVX512 static void unit_avx2_MXFP4_VBMI(const uint8_t *w, int64_t ldw, int cols, int64_t j0, int count, const int8_t *q,
                                        const uint8_t *qu, const float *dx, const float *bs, int64_t K, int64_t rows,
                                        float (*acc)[NT], const uint8_t *next) {
    unit_512(MXFP4, 1, w, ldw, cols, j0, count, q, qu, dx, bs, K, rows, acc, next);
}
#define ROW_OF_UNITS(VNNI) \
    {unit_avx2_Q8_0_##VNNI, unit_avx2_Q4_K_##VNNI, unit_avx2_Q5_K_##VNNI, unit_avx2_Q6_K_##VNNI, unit_avx2_MXFP4_##VNNI}

/* The unit function of a path (1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI, 4 the same with AVX512-VBMI) and
 * format. */
static unit_fn *unit_function(int path, int type) {
    static unit_fn *const units[4][5] = {
        ROW_OF_UNITS(0), ROW_OF_UNITS(VEX), ROW_OF_UNITS(EVEX),
        {unit_avx2_Q8_0_EVEX, unit_avx2_Q4_K_EVEX, unit_avx2_Q5_K_EVEX, unit_avx2_Q6_K_EVEX, unit_avx2_MXFP4_VBMI}};
    return units[path - 1][type == Q8_0 ? 0 : type == Q4_K ? 1 : type == Q5_K ? 2 : type == Q6_K ? 3 : 4];
}

AVX2 static void quantize_avx2(const float *x, int64_t K, int8_t *q, float *dx, float *bs) {
    quantize_row(x, K, q, dx, bs);
}

/* The paths this CPU runs, bit p for path p: 0 scalar, 1 AVX2 (with F16C), 2 AVX-VNNI, 3
 * AVX512-VNNI (with F, BW, DQ and VL: 512-bit vectors at few rows, 256-bit ones in the tile), 4
 * path 3 with AVX512-VBMI (MXFP4's scales by byte permute). */
int int8_paths(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return 1;
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                       __builtin_cpu_supports("avx512vnni");
    return 3 | !!__builtin_cpu_supports("avxvnni") << 2 | /* (it answers a bit of a mask, not 1) */
           avx512 << 3 | (avx512 && __builtin_cpu_supports("avx512vbmi")) << 4;
}
#else
int int8_paths(void) { return 1; }
#endif

int int8_supported(void) { return 1; }

/* A call's rows quantized: q, dx and B (quantize_row) per row, and on the vector paths qu, the
 * quants plus 128 (pack_by_group's tile's). */
typedef struct {
    int8_t *q;
    uint8_t *qu;
    float *dx, *bs;
} quantized_t;

static quantized_t quantize(int path, const float *x, int64_t ldx, int64_t R, int64_t K) {
    const int64_t nb = K / 32;
    quantized_t z = {malloc(R * K + 64), path ? malloc(R * K + 64) : 0, malloc((R * nb + 1) * sizeof(float)),
                     malloc((R * nb + 1) * sizeof(float))};
    _Pragma("omp parallel for schedule(static) if (R > 1)")
    for (int64_t r = 0; r < R; r++) {
#if defined(__x86_64__)
        if (path) quantize_avx2(x + r * ldx, K, z.q + r * K, z.dx + r * nb, z.bs + r * nb);
        else
#endif
            quantize_row(x + r * ldx, K, z.q + r * K, z.dx + r * nb, z.bs + r * nb);
        if (z.qu)
            for (int64_t i = r * K; i < (r + 1) * K; i++) z.qu[i] = (uint8_t)(z.q[i] ^ 0x80);
    }
    return z;
}

static void release(quantized_t z) { free(z.q), free(z.qu), free(z.dx), free(z.bs); }

/* One item: rows [0, rows) (their q, dx, B) against columns [0, cols) of w, y as item_parts, the
 * S parts of K summed in part order (lds 0) or each part's sums apart, lds floats on (a
 * tensor-parallel rank's share of experts' down projection); next: where the weight of item it + 1
 * starts (the thread's next item but at the end of a run), NULL past the last. */
static void item(int path, int type, const uint8_t *w, int64_t ldw, int cols, const float *bias, const int8_t *q,
                 const uint8_t *qu, const float *dx, const float *bs, int64_t K, int64_t rows, int64_t S, const int64_t *cuts,
                 float *y, int64_t ldy, int64_t lds, const uint8_t *next) {
    tile_t t __attribute__((aligned(64)));
    float acc[ROWS][NT];
    for (int64_t s = 0; s < S; s++) {
        memset(acc, 0, rows * sizeof acc[0]);
        for (int64_t j0 = cuts[s] / 32; j0 < cuts[s + 1] / 32; j0 += UNIT) {
            const int count = cuts[s + 1] / 32 - j0 < UNIT ? (int)(cuts[s + 1] / 32 - j0) : UNIT;
#if defined(__x86_64__)
            if (path) {
                unit_function(path, type)(w, ldw, cols, j0, count, q, qu, dx, bs, K, rows, acc, next);
                continue;
            }
#endif
            unpack_tile(type, w, ldw, cols, j0, count, &t);
            rows_scalar(&t, count, j0, q, dx, bs, K, rows, acc);
        }
        for (int64_t r = 0; r < rows; r++)
            for (int n = 0; n < cols; n++) {
                float *at = y + s * lds + r * ldy + n;
                *at = s && !lds ? *at + acc[r][n] : bias && !s ? acc[r][n] + bias[n] : acc[r][n];
            }
    }
}

/* Where item it of int8_gemm_parts starts in its part's weight (NULL past the last): item()'s
 * next. */
static const uint8_t *part_weight(const int64_t *start, int64_t P, const int64_t *n, const uint8_t *const *w,
                                  const int64_t *ldw, int64_t it) {
    if (it >= start[P]) return 0;
    const int64_t p = owner(start, P, it);
    return w[p] + (it - start[p]) % ((n[p] + NT - 1) / NT) * NT * ldw[p];
}

/* quant_gemm_parts's arguments (a projection of P parts in formats types[p], bias[p] or NULL,
 * K in S parts at cuts, NULL: whole), on the int8 arithmetic. path: int8_paths's. */
void int8_gemm_parts(int path, int64_t P, const int *types, const uint8_t *const *w, const int64_t *ldw,
                     const int64_t *n, const float *const *bias, int64_t S, const int64_t *cuts, const float *x,
                     int64_t ldx, float *y, int64_t ldy, int64_t R, int64_t K) {
    const int64_t whole[2] = {0, K}, nb = K / 32;
    if (!cuts) S = 1, cuts = whole;
    const quantized_t z = quantize(path, x, ldx, R, K);
    int64_t start[P + 1], col[P + 1]; /* each part's first item and first column */
    part_items(P, n, (R + ROWS - 1) / ROWS, NT, start, col);
    _Pragma("omp parallel for schedule(guided) if (start[P] > 1)")
    for (int64_t it = 0; it < start[P]; it++) {
        const int64_t p = owner(start, P, it), tiles = (n[p] + NT - 1) / NT, local = it - start[p];
        const int64_t c0 = local % tiles * NT, r0 = local / tiles * ROWS;
        const int cols = n[p] - c0 < NT ? (int)(n[p] - c0) : NT;
        item(path, types[p], w[p] + c0 * ldw[p], ldw[p], cols, bias[p] ? bias[p] + c0 : 0, z.q + r0 * K,
             z.qu ? z.qu + r0 * K : 0, z.dx + r0 * nb, z.bs + r0 * nb, K, R - r0 < ROWS ? R - r0 : ROWS, S, cuts, y + r0 * ldy + col[p] + c0,
             ldy, 0, part_weight(start, P, n, w, ldw, it + 1));
    }
    release(z);
}

/* Where item it of int8_gemm_grouped starts in its expert's weight (NULL past the last): item()'s
 * next. */
static const uint8_t *group_weight(const int64_t *start, int64_t G, const int64_t *groups, const uint8_t *w,
                                   int64_t lde, int64_t ldw, int64_t tiles, int64_t it) {
    if (it >= start[G]) return 0;
    const int64_t g = owner(start, G, it);
    return w + groups[3 * g] * lde + (it - start[g]) % tiles * NT * ldw;
}

/* Experts' rows (quant_gemm's arguments: x [*, K] float32, w uint8 [E][N][K's blocks] at strides
 * lde and ldw bytes, y [*, N], groups [G][3]: expert, first row, rows, covering rows [0, R); K in
 * S parts at cuts, NULL: whole, each part's sums apart, lds floats on) on the int8 arithmetic,
 * each row as int8_gemm_parts computes it alone. The parts in one call: each row's weight read
 * once (the rows quantized per block of 32, a part's from its own start or the row's alike). */
void int8_gemm_grouped(int path, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t lde, int64_t ldw,
                       float *y, int64_t ldy, const int64_t *groups, int64_t G, int64_t R, int64_t K, int64_t N,
                       int64_t S, const int64_t *cuts, int64_t lds) {
    const int64_t whole[2] = {0, K}, nb = K / 32, tiles = (N + NT - 1) / NT;
    if (!cuts) S = 1, cuts = whole;
    const quantized_t z = quantize(path, x, ldx, R, K);
    int64_t *start = malloc((G + 1) * sizeof(int64_t)); /* each group's first item */
    start[0] = 0;
    for (int64_t g = 0; g < G; g++) start[g + 1] = start[g] + (groups[3 * g + 2] + ROWS - 1) / ROWS * tiles;
    _Pragma("omp parallel for schedule(guided) if (start[G] > 1)")
    for (int64_t it = 0; it < start[G]; it++) {
        const int64_t g = owner(start, G, it), local = it - start[g], c0 = local % tiles * NT;
        const int64_t r0 = groups[3 * g + 1] + local / tiles * ROWS, left = groups[3 * g + 1] + groups[3 * g + 2] - r0;
        item(path, type, w + groups[3 * g] * lde + c0 * ldw, ldw, N - c0 < NT ? (int)(N - c0) : NT, 0, z.q + r0 * K,
             z.qu ? z.qu + r0 * K : 0, z.dx + r0 * nb, z.bs + r0 * nb, K, left < ROWS ? left : ROWS, S, cuts, y + r0 * ldy + c0, ldy, lds,
             group_weight(start, G, groups, w, lde, ldw, tiles, it + 1));
    }
    release(z), free(start);
}
