/* Matmuls on GGUF block-quantized weights, read in place: y[R, N] = x[R, K] @ dequant(W)[N, K]^T
 * (+ bias), x and y float32, W uint8 [N, row_bytes] as the file stores it (blocks along K, no
 * repacking, any alignment). Formats: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4 (GGML type ids).
 *
 * Dequantized values are exactly gguf's (its numpy dequantizers are the reference): every
 * product of a scale and a quant is exact in float32, and where the format adds a minimum the
 * one rounding is an FMA's, as numpy's multiply-then-add (the product being exact).
 *
 * THE ORDER. Each output element is one sum in a fixed order: eight lanes, lane j the fused
 * multiply-add chain over c = 0, 1, ..., K/8 - 1 of x[8c + j] * w[8c + j] from zero, then
 *     y = ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))   (+ bias).
 * Nothing of it depends on the row count, the tile or strip the element lands in, the thread,
 * the group, or the instruction set: the AVX-512 path holds two output columns' eight lanes in
 * one register and runs the same chains, so both paths give the same bits.
 *
 * How it runs. Work items are (group, block of RB rows, tile of NT output columns), spread over
 * torch's OpenMP threads (we share its libgomp). An item walks K in ranges of KB: it dequantizes
 * the tile's weights for the range into a panel in L1 ([chunk][column][8 lanes]), then runs every
 * row tile of its rows over the panel, accumulators kept in an L1 buffer between ranges. A
 * decode step's few rows read each weight byte once; a prefill's rows reuse each panel RB times,
 * so the FMA microkernel, not the dequantization, sets the pace.
 *
 * Built at first use by models/kernels/quant.py; x86-64 with AVX2, FMA and F16C, else unsupported.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };

#define NT 8   /* output columns per tile */
#define KB 256 /* k values per panel */
#define RB 64  /* rows per work item */

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* 0: no kernel, 1: AVX2, 2: AVX-512 (the best this CPU runs). */
int quant_isa(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!((c >> 29) & 1)) return 0; /* F16C */
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? 2 : 1;
}

AVX2 INLINE float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ---------------------------------------------------------------- dequantizing one block
 * Each writes the block's values in k order, eight at a time: values 8i..8i+7 at dst + i*stride. */

AVX2 INLINE void put_i8(__m128i q, __m256 scale, float *dst, int64_t stride) { /* 16 int8 */
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale));
    _mm256_storeu_ps(dst + stride,
                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), scale));
}

AVX2 INLINE void put_u8_fma(__m128i q, __m256 d, __m256 m, float *dst, int64_t stride) { /* 16 uint8: d*q + m */
    _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, m));
    _mm256_storeu_ps(dst + stride,
                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), d, m));
}

AVX2 INLINE __m128i low_nibbles(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(0x0F)); }
AVX2 INLINE __m128i high_nibbles(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)); }

AVX2 INLINE void dq_q8_0(const uint8_t *b, float *dst, int64_t stride) {
    const __m256 d = _mm256_set1_ps(half(b));
    put_i8(_mm_loadu_si128((const __m128i *)(b + 2)), d, dst, stride);
    put_i8(_mm_loadu_si128((const __m128i *)(b + 18)), d, dst + 2 * stride, stride);
}

/* Q4_0, Q4_1, MXFP4: values 0-15 the low nibbles of the 16 bytes, 16-31 the high ones. */
AVX2 INLINE void dq_q4_0(const uint8_t *b, float *dst, int64_t stride) {
    const __m256 d = _mm256_set1_ps(half(b));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), eight = _mm_set1_epi8(8);
    put_i8(_mm_sub_epi8(low_nibbles(q), eight), d, dst, stride);
    put_i8(_mm_sub_epi8(high_nibbles(q), eight), d, dst + 2 * stride, stride);
}

AVX2 INLINE void dq_q4_1(const uint8_t *b, float *dst, int64_t stride) {
    const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(half(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
    put_u8_fma(low_nibbles(q), d, m, dst, stride);
    put_u8_fma(high_nibbles(q), d, m, dst + 2 * stride, stride);
}

AVX2 INLINE void dq_mxfp4(const uint8_t *b, float *dst, int64_t stride) {
    /* The E8M0 byte as half its power of two (gguf's e8m0_to_fp32_half), times doubled e2m1 codes. */
    const uint32_t bits = b[0] < 2 ? 0x00200000u << b[0] : (uint32_t)(b[0] - 1) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    const __m256 d = _mm256_set1_ps(scale);
    const __m128i codes = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 1));
    put_i8(_mm_shuffle_epi8(codes, low_nibbles(q)), d, dst, stride);
    put_i8(_mm_shuffle_epi8(codes, high_nibbles(q)), d, dst + 2 * stride, stride);
}

/* Q4_K and Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and minimum packed in 12 bytes. */
INLINE void k_scales(const uint8_t *b, float sc[8], float mn[8]) {
    const uint8_t *s = b + 4;
    for (int j = 0; j < 8; j++) {
        sc[j] = (float)(j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        mn[j] = (float)(j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

AVX2 INLINE void dq_q4_k(const uint8_t *b, float *dst, int64_t stride) {
    float sc[8], mn[8];
    k_scales(b, sc, mn);
    const float d = half(b), dmin = half(b + 2);
    for (int g = 0; g < 4; g++) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 16 + 32 * g));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 16 + 32 * g + 16));
        for (int upper = 0; upper < 2; upper++) {
            const int j = 2 * g + upper;
            const __m256 dj = _mm256_set1_ps(d * sc[j]), mj = _mm256_set1_ps(-(dmin * mn[j]));
            float *out = dst + 4 * j * stride;
            put_u8_fma(upper ? high_nibbles(q0) : low_nibbles(q0), dj, mj, out, stride);
            put_u8_fma(upper ? high_nibbles(q1) : low_nibbles(q1), dj, mj, out + 2 * stride, stride);
        }
    }
}

AVX2 INLINE void dq_q5_k(const uint8_t *b, float *dst, int64_t stride) {
    float sc[8], mn[8];
    k_scales(b, sc, mn);
    const float d = half(b), dmin = half(b + 2);
    const __m128i qh0 = _mm_loadu_si128((const __m128i *)(b + 16));
    const __m128i qh1 = _mm_loadu_si128((const __m128i *)(b + 32)), one = _mm_set1_epi8(1);
    for (int g = 0; g < 4; g++) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 48 + 32 * g));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 48 + 32 * g + 16));
        for (int upper = 0; upper < 2; upper++) {
            const int j = 2 * g + upper;
            const __m128i h0 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh0, j), one), 4);
            const __m128i h1 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh1, j), one), 4);
            const __m256 dj = _mm256_set1_ps(d * sc[j]), mj = _mm256_set1_ps(-(dmin * mn[j]));
            float *out = dst + 4 * j * stride;
            put_u8_fma(_mm_or_si128(upper ? high_nibbles(q0) : low_nibbles(q0), h0), dj, mj, out, stride);
            put_u8_fma(_mm_or_si128(upper ? high_nibbles(q1) : low_nibbles(q1), h1), dj, mj,
                       out + 2 * stride, stride);
        }
    }
}

/* Q6_K: two halves of 128; in half h, value v takes the nibble v/64 of ql[64h + v%64] and the
 * bit pair v/32 of qh[32h + v%32], minus 32; an int8 scale per 16 values, times d. */
AVX2 INLINE void dq_q6_k(const uint8_t *b, float *dst, int64_t stride) {
    const float d = half(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    const __m128i three = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        for (int t = 0; t < 4; t++) {
            for (int part = 0; part < 2; part++) { /* 16 values */
                const __m128i ql = _mm_loadu_si128((const __m128i *)(b + 64 * h + 32 * (t & 1) + 16 * part));
                const __m128i qh = _mm_loadu_si128((const __m128i *)(b + 128 + 32 * h + 16 * part));
                const __m128i lo = t >> 1 ? high_nibbles(ql) : low_nibbles(ql);
                const __m128i hi = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 2 * t), three), 4);
                const __m128i q = _mm_sub_epi8(_mm_or_si128(lo, hi), bias);
                const int sub = 8 * h + 2 * t + part;
                const __m256 s = _mm256_set1_ps(d * (float)scales[sub]);
                put_i8(q, s, dst + 2 * sub * stride, stride);
            }
        }
    }
}

static int block_values(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32; }

static int block_bytes(int type) {
    switch (type) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case MXFP4: return 17;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Blocks [b0, b0 + count) of a row: block i's values from dst + (i - b0) * (values / 8) * stride. */
AVX2 static void dequant_blocks(int type, const uint8_t *row, int64_t b0, int64_t count, float *dst,
                                int64_t stride) {
    const int64_t size = block_bytes(type), step = block_values(type) / 8 * stride;
#define EACH(FN) for (int64_t i = 0; i < count; i++) FN(row + (b0 + i) * size, dst + i * step, stride); break
    switch (type) {
    case Q8_0: EACH(dq_q8_0);
    case Q4_0: EACH(dq_q4_0);
    case Q4_1: EACH(dq_q4_1);
    case MXFP4: EACH(dq_mxfp4);
    case Q4_K: EACH(dq_q4_k);
    case Q5_K: EACH(dq_q5_k);
    case Q6_K: EACH(dq_q6_k);
    }
#undef EACH
}

/* Rows ids[i] of a [rows, K] weight (ids NULL: every row) to float32 out [n, K]. */
void quant_dequantize_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *ids, int64_t n,
                           int64_t K, float *out) {
    _Pragma("omp parallel for schedule(static)")
    for (int64_t i = 0; i < n; i++)
        dequant_blocks(type, w + (ids ? ids[i] : i) * row_bytes, 0, K / block_values(type), out + i * K, 8);
}

/* ---------------------------------------------------------------- microkernels
 * acc [rows][NT][8] in memory between K ranges; panel [chunks][NT][8]; x rows of stride ldx. */

/* AVX2: two rows by four columns (the other four by a second call). */
AVX2 INLINE void tile_avx2(const float *x, int64_t ldx, const int rows, const float *panel, int64_t chunks,
                           float *acc) {
    __m256 a[2][4];
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < 4; n++) a[r][n] = _mm256_loadu_ps(acc + r * NT * 8 + n * 8);
    for (int64_t c = 0; c < chunks; c++) {
        const float *p = panel + c * NT * 8;
        const __m256 w0 = _mm256_load_ps(p), w1 = _mm256_load_ps(p + 8);
        const __m256 w2 = _mm256_load_ps(p + 16), w3 = _mm256_load_ps(p + 24);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + c * 8);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(xv, w2, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(xv, w3, a[r][3]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < 4; n++) _mm256_storeu_ps(acc + r * NT * 8 + n * 8, a[r][n]);
}

AVX2 static void rows_avx2(const float *x, int64_t ldx, int64_t rows, const float *panel, int64_t chunks,
                           float *acc) {
    for (int64_t r = 0; r < rows; r += 2) {
        const float *xr = x + r * ldx;
        float *ar = acc + r * NT * 8;
        for (int h = 0; h < 2; h++) {
            if (rows - r >= 2) tile_avx2(xr, ldx, 2, panel + 32 * h, chunks, ar + 32 * h);
            else tile_avx2(xr, ldx, 1, panel + 32 * h, chunks, ar + 32 * h);
        }
    }
}

/* AVX-512: up to six rows by eight columns, a register per row and column pair (two times 8 lanes). */
AVX512 INLINE void tile_avx512(const float *x, int64_t ldx, const int rows, const float *panel,
                               int64_t chunks, float *acc) {
    __m512 a[6][4];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < 4; p++) a[r][p] = _mm512_loadu_ps(acc + r * NT * 8 + p * 16);
    for (int64_t c = 0; c < chunks; c++) {
        const float *pc = panel + c * NT * 8;
        const __m512 w0 = _mm512_load_ps(pc), w1 = _mm512_load_ps(pc + 16);
        const __m512 w2 = _mm512_load_ps(pc + 32), w3 = _mm512_load_ps(pc + 48);
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + c * 8));
            a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(xv, w2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(xv, w3, a[r][3]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < 4; p++) _mm512_storeu_ps(acc + r * NT * 8 + p * 16, a[r][p]);
}

AVX512 static void rows_avx512(const float *x, int64_t ldx, int64_t rows, const float *panel, int64_t chunks,
                               float *acc) {
    for (int64_t r = 0; r < rows; r += 6) {
        const float *xr = x + r * ldx;
        float *ar = acc + r * NT * 8;
        switch (rows - r < 6 ? rows - r : 6) {
        case 1: tile_avx512(xr, ldx, 1, panel, chunks, ar); break;
        case 2: tile_avx512(xr, ldx, 2, panel, chunks, ar); break;
        case 3: tile_avx512(xr, ldx, 3, panel, chunks, ar); break;
        case 4: tile_avx512(xr, ldx, 4, panel, chunks, ar); break;
        case 5: tile_avx512(xr, ldx, 5, panel, chunks, ar); break;
        default: tile_avx512(xr, ldx, 6, panel, chunks, ar); break;
        }
    }
}

/* ---------------------------------------------------------------- the GEMM */

/* One work item: rows [first, first + rows) of x against output columns [n0, n0 + cols) of a
 * weight whose row n starts at w + n * row_bytes. */
AVX2 static void item(int isa, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                      const float *bias, float *y, int64_t ldy, int64_t rows, int64_t n0, int cols, int64_t K) {
    float panel[KB / 8 * NT * 8] __attribute__((aligned(64)));
    float acc[RB * NT * 8] __attribute__((aligned(64)));
    const int64_t per_block = block_values(type);
    memset(acc, 0, (size_t)rows * NT * 8 * sizeof(float));
    if (cols < NT) memset(panel, 0, sizeof panel);
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t kb = K - k0 < KB ? K - k0 : KB;
        for (int n = 0; n < cols; n++)
            dequant_blocks(type, w + (n0 + n) * row_bytes, k0 / per_block, kb / per_block, panel + n * 8, NT * 8);
        if (isa == 2) rows_avx512(x + k0, ldx, rows, panel, kb / 8, acc);
        else rows_avx2(x + k0, ldx, rows, panel, kb / 8, acc);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int n = 0; n < cols; n++) {
            const float *s = acc + r * NT * 8 + n * 8;
            const float sum = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
            y[r * ldy + n0 + n] = bias ? sum + bias[n0 + n] : sum;
        }
}

/* x [*, K] float32 (row stride ldx); w uint8 [E][N][row_bytes]; bias [N] float32 or NULL (dense
 * calls only); y [*, N] (row stride ldy); groups [G][3]: expert, first row, rows. */
void quant_gemm(int isa, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                const float *bias, float *y, int64_t ldy, const int64_t *groups, int64_t G, int64_t K,
                int64_t N) {
    const int64_t tiles = (N + NT - 1) / NT;
    int64_t *start = malloc((G + 1) * sizeof(int64_t)); /* first item of each group */
    start[0] = 0;
    for (int64_t g = 0; g < G; g++) start[g + 1] = start[g] + (groups[3 * g + 2] + RB - 1) / RB * tiles;
    _Pragma("omp parallel for schedule(dynamic, 1)")
    for (int64_t it = 0; it < start[G]; it++) {
        int64_t g = 0, hi = G - 1; /* the last group starting at or before it */
        while (g < hi) {
            const int64_t mid = (g + hi + 1) / 2;
            if (start[mid] <= it) g = mid;
            else hi = mid - 1;
        }
        const int64_t local = it - start[g], block = local / tiles, tile = local % tiles;
        const int64_t e = groups[3 * g], first = groups[3 * g + 1] + block * RB;
        const int64_t left = groups[3 * g + 1] + groups[3 * g + 2] - first;
        const int cols = N - tile * NT < NT ? (int)(N - tile * NT) : NT;
        item(isa, type, x + first * ldx, ldx, w + e * N * row_bytes, row_bytes, bias, y + first * ldy, ldy,
             left < RB ? left : RB, tile * NT, cols, K);
    }
    free(start);
}

#else

int quant_isa(void) { return 0; }
void quant_dequantize_rows(void) {}
void quant_gemm(void) {}

#endif
