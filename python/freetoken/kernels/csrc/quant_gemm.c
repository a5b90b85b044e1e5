/* Matmuls on GGUF block-quantized weights, read in place: y[R, N] = x[R, K] @ dequant(W)[N, K]^T
 * (+ bias), x and y float32, W uint8 [N, row_bytes] as the file stores it (blocks along K, no
 * repacking, any alignment). Formats: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4 (GGML type ids).
 *
 * Dequantized values are exactly gguf's (its numpy dequantizers are the reference): every
 * product of a scale and a quant is exact in float32, and where the format adds a minimum the
 * one rounding is an FMA's, as numpy's multiply-then-add (the product being exact).
 *
 * THE ORDER. Each output element is one sum in a fixed order: sixteen lanes, lane j the fused
 * multiply-add chain over c = 0, 1, ..., K/16 - 1 of x[16c + j] * w[16c + j] from zero; then
 * t_j = s_j + s_(j+8) and y = ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)) (+ bias, last).
 * Nothing of it depends on the row count, the tile the element lands in, the thread, the group,
 * or the instruction set: AVX-512 holds the sixteen lanes in one register, AVX2 in two (lanes
 * 0-7 and 8-15), both run the same chains and the same final additions, so both give the same
 * bits (on one CPU or across CPUs).
 *
 * How it runs. Work items are (group, block of 48-192 rows (block_rows), tile of NT output
 * columns, or WIDE such tiles where the block's x would not stay in L2), spread over torch's
 * OpenMP threads (we share its libgomp) in guided chunks: a thread takes a run of consecutive
 * items, so it walks a stretch of the weight front to back (which the hardware prefetcher
 * streams, and where the next tile an item prefetches is its own thread's next item, not the
 * other core's), and no two threads write one cache line of y; the runs shrink towards the end,
 * so the threads still finish together. (Items handed out one at a time alternate between the
 * threads: a batch-1 decode step took 1.7x as long on two threads.) An item walks K in ranges of
 * at most KB: it dequantizes a tile's columns' weights for the range into a panel in L1, then
 * runs every row tile of its rows over the panel (AVX-512: 3 rows by the 8 columns, a row's eight
 * sums finished together), tile after tile, the lanes kept in a buffer between ranges (a K of one
 * range keeps them in registers throughout). A decode step's few
 * rows read each weight byte once from memory (the step is bound by that read); a prefill's rows
 * reuse each panel for every row of the item, so the FMA microkernel, not the dequantization,
 * sets the pace. An item of at most FEW rows (AVX-512; a decode step of up to 8 requests) skips
 * the panel: it multiplies each block as it dequantizes it, in registers, the same chains in the
 * same order (few_avx512), the scales read through a table; 1-5 rows four columns at a time,
 * 6-8 rows three (two in the 32-value formats), so that every row of the item shares each
 * block's one dequantization (at 8 rows the FMAs, eight per 16 weights of a column, are most of
 * the work; a second pass of 4 rows would dequantize each block again).
 *
 * Built at first use by kernels/build.py for quant.py; x86-64 with AVX2, FMA and F16C, else
 * unsupported. Signatures: kernels.h.
 */
#include <stdlib.h>

#include "kernels.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };

#define NT 8   /* output columns per tile */
#define KB 640 /* most k values per panel (K splits evenly into ranges of whole super-blocks) */
#define LDP (KB + 16) /* panel column stride: off a multiple of 4 KiB */
#define RB 48  /* fewest rows per work item that block_rows picks (a multiple of both row tiles) */
#define RB_MAX 192 /* most rows per work item */
#define CAP ((int64_t)1 << 18) /* x values per work item that stay in L2 between its tiles (1 MiB) */
#define WIDE 4 /* tiles of NT columns per work item of more than FEW rows (quant_gemm_parts) */

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* Every float16 as float32 (F16C's conversion, so exactly): a scale is read as a table load,
 * which a broadcast takes straight from memory, rather than a conversion and a shuffle on the
 * vector ports that the dequantization itself keeps busy. Filled by quant_isa, which the caller
 * runs before anything else. */
static float halves[65536];

AVX2 static void fill_halves(void) {
    for (int h = 0; h < 65536; h += 8) {
        const __m128i bits = _mm_add_epi16(_mm_set1_epi16((short)h), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_storeu_ps(halves + h, _mm256_cvtph_ps(bits));
    }
}

INLINE float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return halves[h];
}

/* 0: no kernel, 1: AVX2, 2: AVX-512 (F, DQ and VL; the best this CPU runs). */
int quant_isa(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!((c >> 29) & 1)) return 0; /* F16C */
    fill_halves();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
               ? 2
               : 1;
}


/* ---------------------------------------------------------------- dequantizing one block
 * Each writes the block's values in k order to dst. AVX2 and AVX-512 variants compute the same
 * values (each is exact or one FMA rounding); the AVX-512 ones look 4-bit codes up in a table of
 * the block's 16 values (vpermps reads an index's low 4 bits only). */

/* 16 int8 times scale, as two registers (values 0-7, 8-15): what put_i8 stores, and what the
 * AVX2 few-row path (few_avx2) multiplies without storing. */
AVX2 INLINE void i8_pair(__m128i q, __m256 scale, __m256 *lo, __m256 *hi) {
    *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale);
    *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), scale);
}

AVX2 INLINE void u8_fma_pair(__m128i q, __m256 d, __m256 m, __m256 *lo, __m256 *hi) { /* 16 uint8: q*d + m */
    *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, m);
    *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), d, m);
}

AVX2 INLINE void put_i8(__m128i q, __m256 scale, float *dst) {
    __m256 lo, hi;
    i8_pair(q, scale, &lo, &hi);
    _mm256_storeu_ps(dst, lo), _mm256_storeu_ps(dst + 8, hi);
}

AVX2 INLINE void put_u8_fma(__m128i q, __m256 d, __m256 m, float *dst) {
    __m256 lo, hi;
    u8_fma_pair(q, d, m, &lo, &hi);
    _mm256_storeu_ps(dst, lo), _mm256_storeu_ps(dst + 8, hi);
}

AVX512 INLINE __m512 i8_512(__m128i q, __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale);
}

AVX512 INLINE __m512 u8_fma_512(__m128i q, __m512 d, __m512 m) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), d, m);
}

AVX512 INLINE void put_i8_512(__m128i q, __m512 scale, float *dst) { _mm512_storeu_ps(dst, i8_512(q, scale)); }

AVX512 INLINE void put_u8_fma_512(__m128i q, __m512 d, __m512 m, float *dst) {
    _mm512_storeu_ps(dst, u8_fma_512(q, d, m));
}

AVX512 INLINE __m512 iota_512(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

AVX2 INLINE __m128i low_nibbles(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(0x0F)); }
AVX2 INLINE __m128i high_nibbles(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)); }

/* The E8M0 byte as half its power of two (gguf's e8m0_to_fp32_half), for doubled e2m1 codes. */
INLINE float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return scale;
}

/* Q4_K and Q5_K: 8 sub-blocks of 32, each a 6-bit scale and minimum packed in 12 bytes, to
 * s[j] = d * scale_j and s[8 + j] = -(dmin * min_j) (exact products), unpacked four bytes to a
 * word: scale_j, j < 4, is byte j's low 6 bits, scale_(4+i) byte 8+i's low nibble under byte i's
 * top 2 bits; min_j likewise from bytes 4+j, and byte 8+i's high nibble under byte 4+i's top 2. */
AVX2 INLINE void k_scales(const uint8_t *b, float s[16]) {
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303, low_mins = u[1] & six;
    u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    u[2] = low_mins;
    u[0] &= six;
    const __m128i bytes = _mm_loadu_si128((const __m128i *)u);
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_set1_ps(half(b))));
    _mm256_storeu_ps(s + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))),
                                          _mm256_set1_ps(-half(b + 2))));
}

/* k_scales's s from vector registers alone (the few-row tiles, where its scalar unpacking cost
 * as much as a tenth of the time, and the panel's Q4_K, 1-2 % of a 32-row prefill's): the 12
 * bytes shuffled to [0-3 | 8-11 | 4-7 | 8-11], each group masked to its part (scale_0-3's 6 bits, scale_4-7's low nibbles, min_0-3's 6 bits, min_4-7's
 * high nibbles shifted down), bytes 0-3's and 4-7's top two bits shifted under groups 1 and 3. */
AVX512 INLINE void k_scales_512(const uint8_t *b, float s[16]) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4)); /* (its last 4 bytes: codes, unused) */
    const __m128i low = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i six = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m128i high_nibbles = _mm_and_si128(_mm_srli_epi16(low, 4), _mm_setr_epi32(0, 0, 0, 0x0F0F0F0F));
    const __m128i bytes = _mm_or_si128(_mm_or_si128(_mm_and_si128(low, six), high_nibbles),
                                       _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
    const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(half(b)), _mm256_set1_ps(-half(b + 2)), 1);
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), d));
}

/* Q6_K: 16 sub-blocks of 16, each an int8 scale: s[j] = d * scale_j (exact products). */
AVX2 INLINE void q6_scales(const uint8_t *b, float s[16]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m256 d = _mm256_set1_ps(half(b + 208));
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d));
    _mm256_storeu_ps(s + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), d));
}

/* Q5_K's 32 5-bit codes of sub-block j: nibble j % 2 of qs[32(j / 2) + v], bit j of qh[v]. */
AVX2 INLINE __m256i q5_codes(const uint8_t *b, int j) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (j / 2)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), four = _mm256_set1_epi8(0x0F);
    const __m256i low = j & 1 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), four) : _mm256_and_si256(q, four);
    return _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
}

/* Q6_K's 32 codes minus 32 of group t in half h (values 128h + 32t on): in half h, value v takes
 * the nibble v/64 of ql[64h + v%64] and the bit pair v/32 of qh[32h + v%32]. */
AVX2 INLINE __m256i q6_codes(const uint8_t *b, int h, int t) {
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), four = _mm256_set1_epi8(0x0F);
    const __m256i low = t >> 1 ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), four) : _mm256_and_si256(ql, four);
    const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
}

/* Values 32i to 32i + 31 of a super-block b whose scales are s (k_scales, q6_scales), 16 at a time
 * by PUT(codes, scale(s), dst + k): dst a pointer, or (the few-row path, which multiplies instead
 * of storing) an offset along K. */
#define Q5_K_PART(PUT, SET, i)                                                                   \
    {                                                                                            \
        const __m256i codes = q5_codes(b, i);                                                    \
        PUT(_mm256_castsi256_si128(codes), SET(s[i]), SET(s[8 + (i)]), dst + 32 * (i));          \
        PUT(_mm256_extracti128_si256(codes, 1), SET(s[i]), SET(s[8 + (i)]), dst + 32 * (i) + 16); \
    }

/* Half h = i / 4, group t = i % 4 of q6_codes; sub-blocks 2i and 2i + 1. */
#define Q6_K_PART(PUT, SET, i)                                                                   \
    {                                                                                            \
        const __m256i codes = q6_codes(b, (i) / 4, (i) % 4);                                     \
        PUT(_mm256_castsi256_si128(codes), SET(s[2 * (i)]), dst + 32 * (i));                     \
        PUT(_mm256_extracti128_si256(codes, 1), SET(s[2 * (i) + 1]), dst + 32 * (i) + 16);       \
    }

#define Q5_K_BODY(PUT, SET)                                                                      \
    float s[16];                                                                                 \
    k_scales(b, s);                                                                              \
    for (int i = 0; i < 8; i++) Q5_K_PART(PUT, SET, i)

#define Q6_K_BODY(PUT, SET)                                                                      \
    float s[16];                                                                                 \
    q6_scales(b, s);                                                                             \
    for (int i = 0; i < 8; i++) Q6_K_PART(PUT, SET, i)

AVX2 INLINE void dq_q8_0(const uint8_t *b, float *dst) {
    const __m256 d = _mm256_set1_ps(half(b));
    put_i8(_mm_loadu_si128((const __m128i *)(b + 2)), d, dst);
    put_i8(_mm_loadu_si128((const __m128i *)(b + 18)), d, dst + 16);
}
AVX2 INLINE void dq_q5_k(const uint8_t *b, float *dst) { Q5_K_BODY(put_u8_fma, _mm256_set1_ps) }
AVX2 INLINE void dq_q6_k(const uint8_t *b, float *dst) { Q6_K_BODY(put_i8, _mm256_set1_ps) }
AVX512 INLINE void dq_q5_k_512(const uint8_t *b, float *dst) { Q5_K_BODY(put_u8_fma_512, _mm512_set1_ps) }
AVX512 INLINE void dq_q6_k_512(const uint8_t *b, float *dst) { Q6_K_BODY(put_i8_512, _mm512_set1_ps) }

/* Q4_0, Q4_1, MXFP4: values 0-15 the low nibbles of the 16 bytes, 16-31 the high ones. */
AVX2 INLINE void dq_q4_0(const uint8_t *b, float *dst) {
    const __m256 d = _mm256_set1_ps(half(b));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), eight = _mm_set1_epi8(8);
    put_i8(_mm_sub_epi8(low_nibbles(q), eight), d, dst);
    put_i8(_mm_sub_epi8(high_nibbles(q), eight), d, dst + 16);
}

AVX2 INLINE void dq_q4_1(const uint8_t *b, float *dst) {
    const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(half(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
    put_u8_fma(low_nibbles(q), d, m, dst);
    put_u8_fma(high_nibbles(q), d, m, dst + 16);
}

AVX2 INLINE void dq_mxfp4(const uint8_t *b, float *dst) {
    const __m256 d = _mm256_set1_ps(e8m0_half(b[0]));
    const __m128i codes = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 1));
    put_i8(_mm_shuffle_epi8(codes, low_nibbles(q)), d, dst);
    put_i8(_mm_shuffle_epi8(codes, high_nibbles(q)), d, dst + 16);
}

AVX2 INLINE void dq_q4_k(const uint8_t *b, float *dst) {
    float s[16];
    k_scales(b, s);
    for (int j = 0; j < 8; j++) {
        const __m256 dj = _mm256_set1_ps(s[j]), mj = _mm256_set1_ps(s[8 + j]);
        for (int p = 0; p < 2; p++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 16 + 32 * (j / 2) + 16 * p));
            put_u8_fma(j & 1 ? high_nibbles(q) : low_nibbles(q), dj, mj, dst + 32 * j + 16 * p);
        }
    }
}

/* The 32-value formats' blocks as two registers (values 0-15, 16-31): what their dq_*_512 store,
 * and what the few-row path (few_avx512) multiplies without storing. */
AVX512 INLINE void nibble_pair_512(const uint8_t *q, __m512 table, __m512 *lo, __m512 *hi) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *lo = _mm512_permutexvar_ps(codes, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
}

AVX512 INLINE void pair_q8_0_512(const uint8_t *b, __m512 *lo, __m512 *hi) {
    const __m512 d = _mm512_set1_ps(half(b));
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
}

AVX512 INLINE void pair_q4_0_512(const uint8_t *b, __m512 *lo, __m512 *hi) {
    nibble_pair_512(b + 2, _mm512_mul_ps(_mm512_sub_ps(iota_512(), _mm512_set1_ps(8)), _mm512_set1_ps(half(b))), lo, hi);
}

AVX512 INLINE void pair_q4_1_512(const uint8_t *b, __m512 *lo, __m512 *hi) {
    nibble_pair_512(b + 4, _mm512_fmadd_ps(iota_512(), _mm512_set1_ps(half(b)), _mm512_set1_ps(half(b + 2))), lo, hi);
}

AVX512 INLINE void pair_mxfp4_512(const uint8_t *b, __m512 *lo, __m512 *hi) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    nibble_pair_512(b + 1, _mm512_mul_ps(codes, _mm512_set1_ps(e8m0_half(b[0]))), lo, hi);
}

#define STORE_PAIR_512(NAME, PAIR)                                                               \
    AVX512 INLINE void NAME(const uint8_t *b, float *dst) {                                      \
        __m512 lo, hi;                                                                           \
        PAIR(b, &lo, &hi);                                                                       \
        _mm512_storeu_ps(dst, lo);                                                               \
        _mm512_storeu_ps(dst + 16, hi);                                                          \
    }
STORE_PAIR_512(dq_q8_0_512, pair_q8_0_512)
STORE_PAIR_512(dq_q4_0_512, pair_q4_0_512)
STORE_PAIR_512(dq_q4_1_512, pair_q4_1_512)
STORE_PAIR_512(dq_mxfp4_512, pair_mxfp4_512)

/* Q4_K's values 64g to 64g + 63 (sub-block 2g in the low nibbles of 32 bytes, 2g + 1 in the high)
 * as four registers in k order, s from k_scales: each sub-block's 16 values a table. */
AVX512 INLINE void q4_k_group_512(const uint8_t *b, const float *s, int g, __m512 w[4]) {
    const __m512 lo = _mm512_fmadd_ps(iota_512(), _mm512_set1_ps(s[2 * g]), _mm512_set1_ps(s[8 + 2 * g]));
    const __m512 hi = _mm512_fmadd_ps(iota_512(), _mm512_set1_ps(s[2 * g + 1]), _mm512_set1_ps(s[9 + 2 * g]));
    const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 + 32 * g)));
    const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32 + 32 * g)));
    w[0] = _mm512_permutexvar_ps(c0, lo);
    w[1] = _mm512_permutexvar_ps(c1, lo);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), hi);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(c1, 4), hi);
}

AVX512 INLINE void dq_q4_k_512(const uint8_t *b, float *dst) {
    float s[16];
    k_scales_512(b, s);
    for (int g = 0; g < 4; g++) {
        __m512 w[4];
        q4_k_group_512(b, s, g, w);
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(dst + 64 * g + 16 * c, w[c]);
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

/* Blocks [b0, b0 + count) of a row, their values contiguous from dst. */
#define DEQUANT_BLOCKS(NAME, TARGET, Q8_0_, Q4_0_, Q4_1_, MXFP4_, Q4_K_, Q5_K_, Q6_K_)                  \
    TARGET static void NAME(int type, const uint8_t *row, int64_t b0, int64_t count, float *dst) {      \
        const int64_t size = block_bytes(type), values = block_values(type);                            \
        row += b0 * size;                                                                               \
        switch (type) {                                                                                 \
        case Q8_0: for (int64_t i = 0; i < count; i++) Q8_0_(row + i * size, dst + i * values); break;  \
        case Q4_0: for (int64_t i = 0; i < count; i++) Q4_0_(row + i * size, dst + i * values); break;  \
        case Q4_1: for (int64_t i = 0; i < count; i++) Q4_1_(row + i * size, dst + i * values); break;  \
        case MXFP4: for (int64_t i = 0; i < count; i++) MXFP4_(row + i * size, dst + i * values); break; \
        case Q4_K: for (int64_t i = 0; i < count; i++) Q4_K_(row + i * size, dst + i * values); break;  \
        case Q5_K: for (int64_t i = 0; i < count; i++) Q5_K_(row + i * size, dst + i * values); break;  \
        case Q6_K: for (int64_t i = 0; i < count; i++) Q6_K_(row + i * size, dst + i * values); break;  \
        }                                                                                               \
    }

DEQUANT_BLOCKS(dequant_avx2, AVX2, dq_q8_0, dq_q4_0, dq_q4_1, dq_mxfp4, dq_q4_k, dq_q5_k, dq_q6_k)
DEQUANT_BLOCKS(dequant_avx512, AVX512, dq_q8_0_512, dq_q4_0_512, dq_q4_1_512, dq_mxfp4_512, dq_q4_k_512,
               dq_q5_k_512, dq_q6_k_512)

static void dequant_blocks(int isa, int type, const uint8_t *row, int64_t b0, int64_t count, float *dst) {
    if (isa == 2) dequant_avx512(type, row, b0, count, dst);
    else dequant_avx2(type, row, b0, count, dst);
}

/* Rows ids[i] of a [rows, K] weight, row stride ldw bytes (ids NULL: every row), to float32 out [n, K].
 * A decode step's embedding rows (a few thousand values) take less than waking the other threads. */
void quant_dequantize_rows(int isa, int type, const uint8_t *w, int64_t ldw, const int64_t *ids, int64_t n,
                           int64_t K, float *out) {
    _Pragma("omp parallel for schedule(static) if (n * K >= 65536)")
    for (int64_t i = 0; i < n; i++)
        dequant_blocks(isa, type, w + (ids ? ids[i] : i) * ldw, 0, K / block_values(type), out + i * K);
}

/* ---------------------------------------------------------------- microkernels
 * panel [NT][LDP]: the tile's columns' dequantized weights for one K range; acc [rows][NT][16]: the
 * sixteen lanes of every (row, column), in memory between K ranges; x rows of stride ldx. */

/* AVX2: two rows by two columns, each (row, column) as two registers: lanes 0-7 and 8-15. */
AVX2 INLINE void tile_avx2(const float *x, int64_t ldx, const int rows, const float *panel, int64_t chunks,
                           float *acc) {
    __m256 lo[2][2], hi[2][2];
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < 2; n++) {
            lo[r][n] = _mm256_loadu_ps(acc + r * NT * 16 + n * 16);
            hi[r][n] = _mm256_loadu_ps(acc + r * NT * 16 + n * 16 + 8);
        }
    for (int64_t c = 0; c < chunks; c++)
        for (int n = 0; n < 2; n++) {
            const __m256 w_lo = _mm256_load_ps(panel + n * LDP + 16 * c), w_hi = _mm256_load_ps(panel + n * LDP + 16 * c + 8);
            for (int r = 0; r < rows; r++) {
                lo[r][n] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + 16 * c), w_lo, lo[r][n]);
                hi[r][n] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + 16 * c + 8), w_hi, hi[r][n]);
            }
        }
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < 2; n++) {
            _mm256_storeu_ps(acc + r * NT * 16 + n * 16, lo[r][n]);
            _mm256_storeu_ps(acc + r * NT * 16 + n * 16 + 8, hi[r][n]);
        }
}

AVX2 static void rows_avx2(const float *x, int64_t ldx, int64_t rows, const float *panel, int64_t chunks, float *acc) {
    for (int64_t r = 0; r < rows; r += 2)
        for (int n = 0; n < NT; n += 2) {
            if (rows - r >= 2) tile_avx2(x + r * ldx, ldx, 2, panel + n * LDP, chunks, acc + r * NT * 16 + n * 16);
            else tile_avx2(x + r * ldx, ldx, 1, panel + n * LDP, chunks, acc + r * NT * 16 + n * 16);
        }
}

/* ---------------------------------------------------------------- the sums' last steps
 * Sixteen lanes s to one value: t_j = s_j + s_(j+8), then ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)).
 * The AVX-512 form runs these very additions for four (row, column) pairs at once. */

static void finish_scalar(const float *acc, float out[4]) {
    for (int n = 0; n < 4; n++) {
        const float *s = acc + 16 * n;
        float t[8];
        for (int j = 0; j < 8; j++) t[j] = s[j] + s[j + 8];
        out[n] = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
    }
}

/* finish_scalar's additions for four (row, column) pairs at once, each given as its lanes 0-7 and
 * 8-15 (lo, hi): the AVX2 few-row path's sums, without a round trip through memory and fifteen
 * scalar additions per pair (a + b is b + a, bit for bit, so only the tree matters). */
AVX2 INLINE __m128 finish4_avx2(const __m256 lo[4], const __m256 hi[4]) {
    __m256 t[4]; /* t_j = s_j + s_(j+8) */
    for (int n = 0; n < 4; n++) t[n] = _mm256_add_ps(lo[n], hi[n]);
    /* [u(0) | u(1)], [u(2) | u(3)]: u_j = t_j + t_(j+4), j < 4 */
    const __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
    const __m256 u23 = _mm256_add_ps(_mm256_permute2f128_ps(t[2], t[3], 0x20), _mm256_permute2f128_ps(t[2], t[3], 0x31));
    /* [v(0) v(2) | v(1) v(3)], each v_0 = u_0 + u_2, v_1 = u_1 + u_3 */
    const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, 0x44), _mm256_shuffle_ps(u01, u23, 0xEE));
    const __m256 sums = _mm256_add_ps(v, _mm256_permute_ps(v, 0xB1)); /* v_0 + v_1: lanes 0, 2 | 4, 6 */
    /* lanes 0, 4, 2, 6: columns 0, 1, 2, 3 */
    const __m128 lo02 = _mm256_castps256_ps128(sums), hi13 = _mm256_extractf128_ps(sums, 1);
    return _mm_shuffle_ps(_mm_unpacklo_ps(lo02, hi13), _mm_unpackhi_ps(lo02, hi13), 0x44);
}

/* Four (row, column) pairs' lanes a, b, c, d to their sums, bias added, stored in the first `cols`
 * of y by one 128-bit masked store. (A store loop over so few columns GCC made a memcpy call, one
 * a row per tile: 3 % of a batch-8 decode step's samples, the calls' cost besides; a 512-bit
 * masked store ran one row 0.95-0.97x as fast on the Zen 4, the 128-bit one 1.03-1.05x, 8 rows
 * 1.07-1.11x: the default GGUF's linears for a step, two threads.) */
AVX512 INLINE void finish_avx512(__m512 a, __m512 b, __m512 c, __m512 d, float *y, const float *bias, int cols) {
    /* [t(a) | t(b)] and [t(c) | t(d)]: each 8 lanes t_j = s_j + s_(j+8) */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* 128-bit lane k of u: u_j = t_j + t_(j+4), j < 4, for a, b, c, d */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E)); /* v_0 = u_0 + u_2, v_1 = u_1 + u_3 */
    const __m512 sums = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1)); /* v_0 + v_1 */
    __m128 out = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), sums));
    const __mmask8 m = (__mmask8)((1u << cols) - 1);
    if (bias) out = _mm_add_ps(out, _mm_maskz_loadu_ps(m, bias));
    _mm_mask_storeu_ps(y, m, out);
}

/* Eight (row, column) pairs' lanes a[0..7] to their sums, in column order: the additions of
 * finish_avx512 (every lane of the last two steps holding a sum, not half of them), and the
 * eight stored at once, bias added, in the first `cols` of y. */
AVX512 INLINE void finish8_avx512(const __m512 a[NT], float *y, const float *bias, int cols) {
    __m512 t[4]; /* [t(a_2i) | t(a_2i+1)] */
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    /* 128-bit lane k of u0: u_j = t_j + t_(j+4) of column k; of u1: of column 4 + k */
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
    /* lane k: v_0 = u_0 + u_2, v_1 = u_1 + u_3 of column k, then of column 4 + k */
    const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
    const __m512 s = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1)); /* v_0 + v_1 */
    __m512 out = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0), s);
    const __mmask16 m = (__mmask16)((1u << cols) - 1);
    if (bias) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(m, bias));
    _mm512_mask_storeu_ps(y, m, out);
}

/* AVX-512: up to three rows by the panel's eight columns, a register per (row, column) (24, with
 * three for x and one for a weight: 28 of the 32). A chunk loads each row's x once and each
 * column's weights once, 11 loads to 24 FMAs, and the rows' x stream from L2 evenly (a taller,
 * narrower tile reads them in bursts, then not at all). The first K range starts the lanes from
 * zero, the last finishes the sums into y (its first `cols` columns, + bias; `add`: y + the sums,
 * a later K part's). */
AVX512 INLINE void tile_avx512(const float *x, int64_t ldx, const int rows, const float *panel, int64_t chunks,
                               float *acc, int first, int last, float *y, int64_t ldy, const float *bias, int cols,
                               int add) {
    __m512 a[3][NT];
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < NT; n++) a[r][n] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * NT * 16 + n * 16);
    /* two chunks a turn: 2-3 % faster on the 8B's layers at 32 rows than one (four: no faster) */
#pragma GCC unroll 2
    for (int64_t c = 0; c < chunks; c++) {
        __m512 xv[3];
        for (int r = 0; r < rows; r++) xv[r] = _mm512_loadu_ps(x + r * ldx + 16 * c);
        for (int n = 0; n < NT; n++) {
            __m512 w = _mm512_load_ps(panel + n * LDP + 16 * c);
            __asm__("" : "+v"(w)); /* one load into a register, not one per FMA as a memory operand */
            for (int r = 0; r < rows; r++) a[r][n] = _mm512_fmadd_ps(xv[r], w, a[r][n]);
        }
    }
    for (int r = 0; r < rows; r++) {
        if (!last) {
            for (int n = 0; n < NT; n++) _mm512_storeu_ps(acc + r * NT * 16 + n * 16, a[r][n]);
            continue;
        }
        finish8_avx512(a[r], y + r * ldy, add ? y + r * ldy : bias, cols); /* a + b is b + a, bit for bit */
    }
}

AVX512 static void rows_avx512(const float *x, int64_t ldx, int64_t rows, const float *panel, int64_t chunks,
                               float *acc, int first, int last, float *y, int64_t ldy, const float *bias, int cols,
                               int add) {
    for (int64_t r = 0; r < rows; r += 3) {
        const float *xr = x + r * ldx;
        float *ar = acc + r * NT * 16, *yr = y + r * ldy;
        switch (rows - r < 3 ? rows - r : 3) {
        case 1: tile_avx512(xr, ldx, 1, panel, chunks, ar, first, last, yr, ldy, bias, cols, add); break;
        case 2: tile_avx512(xr, ldx, 2, panel, chunks, ar, first, last, yr, ldy, bias, cols, add); break;
        default: tile_avx512(xr, ldx, 3, panel, chunks, ar, first, last, yr, ldy, bias, cols, add); break;
        }
    }
}

/* AVX-512, few rows (a decode step's): up to 5 rows by four columns (6-8 rows by three or two)
 * over the whole of K, each block dequantized in registers and multiplied at once: no panel, no lanes
 * kept in memory. The lanes run the very chains of tile_avx512 (one FMA per chunk, in chunk
 * order) and end in the same finish_avx512, so a row gets the same bits here as through the
 * panel. Columns past `cols` repeat the last one (their sums are not written). */
#define FEW 8
#define AHEAD 4 /* columns: the next 4-column tile (measured on the 8B: 2 ahead 336 ms a step, 4-8 253-256) */

/* How far ahead (bytes, into L2) a tile of `rows` rows fetches its weight; 0: the next tile, into
 * L1 (FETCH_AHEAD says why and what was measured). */
static int64_t far_bytes(int type, int64_t rows) {
    if (type == Q8_0) return rows <= 2 ? 16 << 10 : 0;
    return rows == 1 ? 8 << 10 : 0;
}

/* Lines from p on, one per 64 bytes of [p, p + bytes), into L1 (into L2 with `far`). Called
 * block by block along a column, a line a block straddles is asked for twice, and the last line
 * ahead of time: measured, that is 5 % faster than asking for each line once. */
INLINE void prefetch_lines(const uint8_t *p, int64_t bytes, int far) {
    for (int64_t o = 0; o < bytes; o += 64) {
        if (far) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
        else _mm_prefetch((const char *)p + o, _MM_HINT_T0);
    }
}

/* Block blk of the tile's columns `ahead` columns on (a later tile's, usually this thread's own
 * next work), fetched while this block is multiplied: a decode step is bound by reading the
 * weight. Asking for the next tile in one burst at a tile's start (as before) read the 8B's
 * weights at 11.5 GB/s on two threads; spread along the blocks, 17. Q8_0 at one or two rows is
 * the one case whose work per byte runs ahead of memory (its dequantization is the cheapest:
 * scripts/bench_quant.py's ceilings), so it waits on the weight the most: it asks for it at least
 * 16 KiB ahead, into L2. On the Zen 4, 2 threads, one row: the default GGUF's Q8_0 head (K =
 * 576) read at 26 GB/s rather than 15.5, batch-1 decode 1.12x. Every other format at one row asks
 * 8 KiB ahead, into L2, once the weights lie in huge pages (models/huge_pages.py; on 4 KiB pages a
 * fetch that far ahead also walks the page tables, and the 16 KiB of Q8_0 made Q4_1 layers 1.09x
 * slower): on the Zen 4, 2 threads, weights in huge pages, small models' widths (K = 576-1536),
 * Q4_0 1.18x, Q4_1 1.12x, Q5_K 1.13x, Q6_K 1.15x, MXFP4 1.07x, Q4_K 1.01x, and 4096-wide Q6_K
 * 1.07x, Q4_K 1.00x. At two rows it was as often slower as faster (Q4_0 0.89x, Q6_K 1.14x), and at
 * 8 rows slower (Q6_K 1.18x, Q4_1 1.03x): there the next tile into L1 stays. */
#define FETCH_AHEAD(COLS, blk)                                                                   \
    for (int n = 0; n < (COLS); n++) prefetch_lines(col[n] + ahead * ldw + (blk) * size, size, far);

#define FEW_FMA(C, W)                                                                            \
    {                                                                                            \
        const __m512 w_ = (W);                                                                   \
        for (int r = 0; r < few_rows; r++) a[r][n] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + (C)), w_, a[r][n]); \
    }
#define FEW_I8(Q, SCALE, C) FEW_FMA(C, i8_512(Q, SCALE))
#define FEW_U8_FMA(Q, D, M, C) FEW_FMA(C, u8_fma_512(Q, D, M))

/* The super-block formats at four columns (1-4 rows), a block of the columns at a time, in PARTS
 * parts that go round the columns (so that each column's chains wait on the others' work, not on
 * their own FMAs); PART reads column n's block b, its scales s, and adds values from k = dst on. */
#define FEW_SUPER(SCALES, PARTS, PART)                                                           \
    for (int64_t blk = 0; blk < K / 256; blk++) {                                                \
        float scales[4][16];                                                                     \
        for (int n = 0; n < few_cols; n++) SCALES(col[n] + blk * size, scales[n]);               \
        FETCH_AHEAD(few_cols, blk)                                                               \
        for (int i = 0; i < PARTS; i++)                                                          \
            for (int n = 0; n < few_cols; n++) {                                                 \
                const uint8_t *b = col[n] + blk * size;                                          \
                const float *s = scales[n];                                                      \
                const int64_t dst = 256 * blk;                                                   \
                PART                                                                             \
            }                                                                                    \
    }

#define FEW_Q4_K_PART                                                                            \
    __m512 w[4];                                                                                 \
    q4_k_group_512(b, s, i, w);                                                                  \
    for (int c = 0; c < 4; c++) FEW_FMA(dst + 64 * i + 16 * c, w[c])

/* x's sixteen values at p in a register that every column's FMA shares: left to itself, the
 * compiler folds the load into each FMA, loading x once per column, with an indexed address that
 * splits each FMA in two. */
AVX512 INLINE __m512 x_shared(const float *p) {
    __m512 v = _mm512_loadu_ps(p);
    __asm__("" : "+v"(v));
    return v;
}

/* acc += x * w, one vfmadd231ps on the accumulator's own register: left to itself, GCC picks
 * forms that overwrite x or w and copies registers about to make up for it. */
AVX512 INLINE void fma_in_place(__m512 *acc, __m512 x, __m512 w) {
    __asm__("vfmadd231ps %2, %1, %0" : "+v"(*acc) : "v"(x), "v"(w));
}

/* The 32-value formats: a block of every column dequantized, then each row's x loaded once for
 * all of them (values 0-15 of every (row, column), then 16-31: each chain still in chunk order).
 * The next block is dequantized ahead of this one's multiply-adds, in program order, so that its
 * table loads and lookups run beside them: dequantized just before its own FMAs, a block left
 * them waiting (Zen 4, one thread, 8 rows of a Q4_1 weight in L2: 1.06-1.10x, 1-7 rows
 * 0.98-1.04x; the default GGUF's decode step at batch 8 1.01x). */
#define FEW_PAIRS(PAIR)                                                                          \
    {                                                                                            \
        __m512 lo[4], hi[4], next_lo[4], next_hi[4];                                             \
        for (int n = 0; n < few_cols; n++) PAIR(col[n], &next_lo[n], &next_hi[n]);              \
        for (int64_t blk = 0; blk < K / 32; blk++) {                                             \
            for (int n = 0; n < few_cols; n++) lo[n] = next_lo[n], hi[n] = next_hi[n];          \
            FETCH_AHEAD(few_cols, blk)                                                           \
            if (blk + 1 < K / 32)                                                                \
                for (int n = 0; n < few_cols; n++)                                               \
                    PAIR(col[n] + (blk + 1) * size, &next_lo[n], &next_hi[n]);                   \
            for (int r = 0; r < few_rows; r++) {                                                 \
                const __m512 xv = x_shared(x + r * ldx + 32 * blk);                              \
                for (int n = 0; n < few_cols; n++) a[r][n] = _mm512_fmadd_ps(xv, lo[n], a[r][n]); \
            }                                                                                    \
            for (int r = 0; r < few_rows; r++) {                                                 \
                const __m512 xv = x_shared(x + r * ldx + 32 * blk + 16);                         \
                for (int n = 0; n < few_cols; n++) a[r][n] = _mm512_fmadd_ps(xv, hi[n], a[r][n]); \
            }                                                                                    \
        }                                                                                        \
    }

/* p, through a register the compiler cannot see through, so that each part of a block reads its
 * bytes (or scales) afresh: left to itself, it keeps what later parts read again in registers,
 * which at 6-8 rows by three columns are the accumulators' (spilled to the stack). */
INLINE const uint8_t *opaque(const uint8_t *p) {
    __asm__("" : "+r"(p));
    return p;
}

/* Q5_K's and Q6_K's values 32i to 32i + 31 as two registers (as Q5_K_PART and Q6_K_PART make them). */
AVX512 INLINE void q5_k_part_512(const uint8_t *b, const float *s, int i, __m512 w[2]) {
    const __m256i codes = q5_codes(opaque(b), i);
    const __m512 d = _mm512_set1_ps(s[i]), m = _mm512_set1_ps(s[8 + i]);
    w[0] = u8_fma_512(_mm256_castsi256_si128(codes), d, m);
    w[1] = u8_fma_512(_mm256_extracti128_si256(codes, 1), d, m);
}

AVX512 INLINE void q6_k_part_512(const uint8_t *b, const float *s, int i, __m512 w[2]) {
    const __m256i codes = q6_codes(opaque(b), i / 4, i % 4);
    w[0] = i8_512(_mm256_castsi256_si128(codes), _mm512_set1_ps(s[2 * i]));
    w[1] = i8_512(_mm256_extracti128_si256(codes, 1), _mm512_set1_ps(s[2 * i + 1]));
}

/* Q4_K's values 16c to 16c + 15 (bytes 16 + 32(c / 4) + 16(c % 2) on, their low nibbles for an
 * even sub-block c / 2, the high for an odd one) in one register, looked up in the sub-block's
 * table (as q4_k_group_512's, built afresh for each of its two chunks so that no table takes a
 * register from one chunk to the next). */
AVX512 INLINE void q4_k_chunk_512(const uint8_t *b, const float *s, int c, __m512 w[1]) {
    const float *sub = (const float *)opaque((const uint8_t *)(s + c / 2));
    const __m512 table = _mm512_fmadd_ps(iota_512(), _mm512_set1_ps(sub[0]), _mm512_set1_ps(sub[8]));
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)opaque(b + 16 + 32 * (c / 4) + 16 * (c % 2))));
    w[0] = _mm512_permutexvar_ps(c / 2 % 2 ? _mm512_srli_epi32(codes, 4) : codes, table);
}

/* The super-block formats at 5-8 rows: part i of every column's block (PART filling 256 / PARTS
 * values as registers: Q4_K 16, Q5_K and Q6_K 32), then each row's x loaded once for all the
 * columns. So few registers a column leave room for three or four columns' accumulators (24 at
 * 8 rows by 3, with 3-6 for the weights and one for x), and each x load (from L2: 8 rows of a K of 4096 overflow L1) feeds
 * three or four FMAs rather than two. */
#define FEW_SUPER_SHARED(SCALES, PARTS, PART)                                                    \
    for (int64_t blk = 0; blk < K / 256; blk++) {                                                \
        float scales[4][16];                                                                     \
        for (int n = 0; n < few_cols; n++) SCALES(col[n] + blk * size, scales[n]);               \
        FETCH_AHEAD(few_cols, blk)                                                               \
        _Pragma("GCC unroll 16")                                                                 \
        for (int i = 0; i < PARTS; i++) {                                                        \
            __m512 wp[4][256 / PARTS / 16];                                                      \
            for (int n = 0; n < few_cols; n++) PART(col[n] + blk * size, scales[n], i, wp[n]);   \
            for (int c = 0; c < 256 / PARTS / 16; c++)                                           \
                for (int r = 0; r < few_rows; r++) {                                             \
                    const __m512 xv = x_shared(x + r * ldx + 256 * blk + 256 / PARTS * i + 16 * c); \
                    for (int n = 0; n < few_cols; n++) fma_in_place(&a[r][n], xv, wp[n][c]);    \
                }                                                                                \
        }                                                                                        \
    }

/* ROWS rows by COLS (2 to 4) columns. */
#define FEW_TILE(ROWS, COLS)                                                                     \
    AVX512 static void few_avx512_##ROWS##x##COLS(int type, const float *x, int64_t ldx, const uint8_t *w, \
                                                  int64_t ldw, int cols, int64_t K, float *y, int64_t ldy, \
                                                  const float *bias) {                           \
        const int64_t size = block_bytes(type), few_rows = ROWS, few_cols = COLS;               \
        const int64_t reach = far_bytes(type, ROWS);                                             \
        const int far = reach > 0;                                                               \
        const int64_t ahead = far && AHEAD * ldw < reach ? (reach + ldw - 1) / ldw : AHEAD;      \
        const uint8_t *col[COLS];                                                                \
        for (int n = 0; n < COLS; n++) col[n] = w + (n < cols ? n : cols - 1) * ldw;             \
        __m512 a[ROWS][COLS];                                                                    \
        for (int r = 0; r < ROWS; r++)                                                           \
            for (int n = 0; n < COLS; n++) a[r][n] = _mm512_setzero_ps();                        \
        switch (type) {                                                                          \
        case Q8_0: FEW_PAIRS(pair_q8_0_512) break;                                               \
        case Q4_0: FEW_PAIRS(pair_q4_0_512) break;                                               \
        case Q4_1: FEW_PAIRS(pair_q4_1_512) break;                                               \
        case MXFP4: FEW_PAIRS(pair_mxfp4_512) break;                                             \
        case Q4_K:                                                                               \
            if (ROWS > 4) FEW_SUPER_SHARED(k_scales_512, 16, q4_k_chunk_512)                     \
            else FEW_SUPER(k_scales_512, 4, FEW_Q4_K_PART)                                       \
            break;                                                                               \
        case Q5_K:                                                                               \
            if (ROWS > 4) FEW_SUPER_SHARED(k_scales_512, 8, q5_k_part_512)                       \
            else FEW_SUPER(k_scales_512, 8, Q5_K_PART(FEW_U8_FMA, _mm512_set1_ps, i))            \
            break;                                                                               \
        case Q6_K:                                                                               \
            if (ROWS > 4) FEW_SUPER_SHARED(q6_scales, 8, q6_k_part_512)                          \
            else FEW_SUPER(q6_scales, 8, Q6_K_PART(FEW_I8, _mm512_set1_ps, i))                   \
            break;                                                                               \
        }                                                                                        \
        for (int r = 0; r < ROWS; r++) /* (with two or three columns, some finished twice) */   \
            finish_avx512(a[r][0], a[r][1], a[r][2 % COLS], a[r][3 % COLS], y + r * ldy, bias, cols); \
    }
FEW_TILE(1, 4)
FEW_TILE(2, 4)
FEW_TILE(3, 4)
FEW_TILE(4, 4)
FEW_TILE(5, 4)
FEW_TILE(6, 3)
FEW_TILE(7, 3)
FEW_TILE(8, 3)
FEW_TILE(6, 2)
FEW_TILE(7, 2)
FEW_TILE(8, 2)

typedef void (*few_tile)(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, int cols,
                         int64_t K, float *y, int64_t ldy, const float *bias);
static const few_tile few_tiles[FEW + 1] = {0, few_avx512_1x4, few_avx512_2x4, few_avx512_3x4, few_avx512_4x4,
                                            few_avx512_5x4, few_avx512_6x3, few_avx512_7x3, few_avx512_8x3};
static const few_tile few_pairs[FEW + 1] = {0, 0, 0, 0, 0, 0, few_avx512_6x2, few_avx512_7x2, few_avx512_8x2};

/* Rows [0, rows), rows <= FEW, against output columns [0, cols) of w in one pass, each block
 * dequantized once for all the rows: four columns at a time up to 5 rows, three at 6-8 in the
 * super-block formats (the registers hold no more accumulators with the dequantized weights and
 * x; the 32-value formats measured no faster at three, and keep two), the last two of 8 (or
 * fewer) columns by a two-column tile rather than a three-column one that repeats one. */
static void few_avx512(int type, const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int64_t ldw,
                       int cols, int64_t K, float *y, int64_t ldy, const float *bias) {
    const int width = rows < 6 ? 4 : block_values(type) == 256 ? 3 : 2; /* the tile's columns */
    for (int n = 0; n < cols; n += width) {
        const int left = cols - n < width ? cols - n : width;
        const few_tile tile = left <= 2 && few_pairs[rows] ? few_pairs[rows] : few_tiles[rows];
        tile(type, x, ldx, w + n * ldw, ldw, left, K, y + n, ldy, bias ? bias + n : 0);
    }
}

/* AVX2, one or two rows (a decode step's, and most groups of a MoE's experts): one row by four
 * columns or two rows by two, over the whole of K, each block's values made in registers as the
 * dq_* functions make them for the panel and multiplied at once: no panel, no lanes in memory.
 * Each (row, column) keeps the two registers of tile_avx2 (lanes 0-7, 8-15), one FMA each per
 * 16-value chunk in chunk order, and ends in finish_scalar: the bits of the panel path. The
 * columns take turns chunk by chunk, so that their chains of FMAs overlap. (On the Zen 3, one row
 * through the panel multiplied a Qwen3-30B-A3B expert's Q4_K rows at 4 GMAC/s a core.) */
#define FEW2 2

/* A block's scales (sc_*: s[0] = d, s[1] = m for the 32-value formats; k_scales, q6_scales for
 * the super-blocks), then its values 32 at a time (pr_*), made as the dq_* functions make them. */
AVX2 INLINE void sc_d(const uint8_t *b, float s[16]) { s[0] = half(b), s[1] = 0.0f; }
AVX2 INLINE void sc_dm(const uint8_t *b, float s[16]) { s[0] = half(b), s[1] = half(b + 2); }
AVX2 INLINE void sc_e8m0(const uint8_t *b, float s[16]) { s[0] = e8m0_half(b[0]), s[1] = 0.0f; }

/* The 32 values from 32j of a block, as four registers (two chunks of 16: values 0-7, 8-15 of each). */
AVX2 INLINE void pr_q8_0(const uint8_t *b, const float *s, int j, __m256 w[4]) {
    (void)j;
    const __m256 d = _mm256_set1_ps(s[0]);
    i8_pair(_mm_loadu_si128((const __m128i *)(b + 2)), d, w, w + 1);
    i8_pair(_mm_loadu_si128((const __m128i *)(b + 18)), d, w + 2, w + 3);
}
AVX2 INLINE void pr_q4_0(const uint8_t *b, const float *s, int j, __m256 w[4]) {
    (void)j;
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), eight = _mm_set1_epi8(8);
    const __m256 d = _mm256_set1_ps(s[0]);
    i8_pair(_mm_sub_epi8(low_nibbles(q), eight), d, w, w + 1);
    i8_pair(_mm_sub_epi8(high_nibbles(q), eight), d, w + 2, w + 3);
}
AVX2 INLINE void pr_q4_1(const uint8_t *b, const float *s, int j, __m256 w[4]) {
    (void)j;
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
    const __m256 d = _mm256_set1_ps(s[0]), m = _mm256_set1_ps(s[1]);
    u8_fma_pair(low_nibbles(q), d, m, w, w + 1);
    u8_fma_pair(high_nibbles(q), d, m, w + 2, w + 3);
}
AVX2 INLINE void pr_mxfp4(const uint8_t *b, const float *s, int j, __m256 w[4]) {
    (void)j;
    const __m128i codes = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 1));
    const __m256 d = _mm256_set1_ps(s[0]);
    i8_pair(_mm_shuffle_epi8(codes, low_nibbles(q)), d, w, w + 1);
    i8_pair(_mm_shuffle_epi8(codes, high_nibbles(q)), d, w + 2, w + 3);
}
AVX2 INLINE void pr_q4_k(const uint8_t *b, const float *s, int j, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(s[j]), m = _mm256_set1_ps(s[8 + j]);
    for (int p = 0; p < 2; p++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 16 + 32 * (j / 2) + 16 * p));
        u8_fma_pair(j & 1 ? high_nibbles(q) : low_nibbles(q), d, m, w + 2 * p, w + 2 * p + 1);
    }
}
AVX2 INLINE void pr_q5_k(const uint8_t *b, const float *s, int j, __m256 w[4]) {
    const __m256i codes = q5_codes(b, j);
    const __m256 d = _mm256_set1_ps(s[j]), m = _mm256_set1_ps(s[8 + j]);
    u8_fma_pair(_mm256_castsi256_si128(codes), d, m, w, w + 1);
    u8_fma_pair(_mm256_extracti128_si256(codes, 1), d, m, w + 2, w + 3);
}
AVX2 INLINE void pr_q6_k(const uint8_t *b, const float *s, int j, __m256 w[4]) {
    const __m256i codes = q6_codes(b, j / 4, j % 4);
    i8_pair(_mm256_castsi256_si128(codes), _mm256_set1_ps(s[2 * j]), w, w + 1);
    i8_pair(_mm256_extracti128_si256(codes, 1), _mm256_set1_ps(s[2 * j + 1]), w + 2, w + 3);
}

/* ROWS rows by COLS columns of format NAME (its SCALES and PAIR, VALUES a block of SIZE bytes), `cols`
 * of them real (a partial tile's last column repeats, its sums not written); `add`: y + the sums
 * (a later K part's, item_parts), else the sums + bias. */
#define FEW2_TILE(NAME, ROWS, COLS, SCALES, PAIR, SIZE, VALUES)                         \
    AVX2 static void few2_##NAME##_##ROWS##x##COLS(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, \
                                                   int cols, int64_t K, float *y, int64_t ldy, const float *bias, \
                                                   int add) {                                    \
        const uint8_t *col[COLS];                                                                \
        for (int n = 0; n < COLS; n++) col[n] = w + (n < cols ? n : cols - 1) * ldw;             \
        __m256 lo[ROWS][COLS], hi[ROWS][COLS];                                                   \
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++)                                   \
            _Pragma("GCC unroll 4") for (int n = 0; n < COLS; n++) lo[r][n] = hi[r][n] = _mm256_setzero_ps(); \
        for (int64_t blk = 0; blk < K / (VALUES); blk++) {                                       \
            float s[COLS][16];                                                                   \
            const uint8_t *b[COLS];                                                              \
            _Pragma("GCC unroll 4") for (int n = 0; n < COLS; n++) {                             \
                b[n] = col[n] + blk * (SIZE);                                                    \
                prefetch_lines(b[n] + COLS * ldw, SIZE, 0); /* the next tile's block */          \
                SCALES(b[n], s[n]);                                                              \
            }                                                                                    \
            for (int j = 0; j < (VALUES) / 32; j++) {                                            \
                const float *xc = x + blk * (VALUES) + 32 * j;                                   \
                _Pragma("GCC unroll 4") for (int n = 0; n < COLS; n++) {                         \
                    __m256 v[4];                                                                 \
                    PAIR(b[n], s[n], j, v);                                                      \
                    _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++)                          \
                        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {                 \
                            const float *xr = xc + r * ldx + 16 * c;                             \
                            lo[r][n] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), v[2 * c], lo[r][n]); \
                            hi[r][n] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), v[2 * c + 1], hi[r][n]); \
                        }                                                                        \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        /* the tile's ROWS x COLS = 4 (row, column) pairs summed at once, in row-major order */ \
        __m256 l4[4], h4[4];                                                                     \
        for (int i = 0; i < 4; i++) l4[i] = lo[i / (COLS)][i % (COLS)], h4[i] = hi[i / (COLS)][i % (COLS)]; \
        float out[4];                                                                            \
        _mm_storeu_ps(out, finish4_avx2(l4, h4));                                                \
        for (int r = 0; r < ROWS; r++)                                                           \
            for (int n = 0; n < COLS && n < cols; n++) {                                         \
                float *at = y + r * ldy + n;                                                     \
                const float sum = out[r * (COLS) + n];                                           \
                *at = add ? *at + sum : bias ? sum + bias[n] : sum;                              \
            }                                                                                    \
    }
#define FEW2_FORMAT(NAME, SCALES, SIZE, VALUES) /* (both tiles: 4 pairs, finish4_avx2's) */  \
    FEW2_TILE(NAME, 1, 4, SCALES, pr_##NAME, SIZE, VALUES)                                       \
    FEW2_TILE(NAME, 2, 2, SCALES, pr_##NAME, SIZE, VALUES)
FEW2_FORMAT(q8_0, sc_d, 34, 32)
FEW2_FORMAT(q4_0, sc_d, 18, 32)
FEW2_FORMAT(q4_1, sc_dm, 20, 32)
FEW2_FORMAT(mxfp4, sc_e8m0, 17, 32)
FEW2_FORMAT(q4_k, k_scales, 144, 256)
FEW2_FORMAT(q5_k, k_scales, 176, 256)
FEW2_FORMAT(q6_k, q6_scales, 210, 256)

typedef void (*few2_tile)(const float *, int64_t, const uint8_t *, int64_t, int, int64_t, float *, int64_t,
                          const float *, int);
#define FEW2_PAIR(NAME) {few2_##NAME##_1x4, few2_##NAME##_2x2}

/* Rows [0, rows), rows <= FEW2, against output columns [0, cols) of w: with `add`, y + the sums
 * (a later K part's, item_parts), else the sums + bias. */
static void few_avx2(int type, const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int64_t ldw, int cols,
                     int64_t K, float *y, int64_t ldy, const float *bias, int add) {
    few2_tile tiles[2];
    switch (type) {
    case Q8_0: { const few2_tile t[2] = FEW2_PAIR(q8_0); memcpy(tiles, t, sizeof t); } break;
    case Q4_0: { const few2_tile t[2] = FEW2_PAIR(q4_0); memcpy(tiles, t, sizeof t); } break;
    case Q4_1: { const few2_tile t[2] = FEW2_PAIR(q4_1); memcpy(tiles, t, sizeof t); } break;
    case MXFP4: { const few2_tile t[2] = FEW2_PAIR(mxfp4); memcpy(tiles, t, sizeof t); } break;
    case Q4_K: { const few2_tile t[2] = FEW2_PAIR(q4_k); memcpy(tiles, t, sizeof t); } break;
    case Q5_K: { const few2_tile t[2] = FEW2_PAIR(q5_k); memcpy(tiles, t, sizeof t); } break;
    default: { const few2_tile t[2] = FEW2_PAIR(q6_k); memcpy(tiles, t, sizeof t); } break;
    }
    const int width = rows == 1 ? 4 : 2;
    for (int n = 0; n < cols; n += width) {
        const int left = cols - n < width ? cols - n : width;
        tiles[rows - 1](x, ldx, w + n * ldw, ldw, left, K, y + n, ldy, bias ? bias + n : 0, add);
    }
}

/* ---------------------------------------------------------------- the GEMM */

/* y[:rows, :cols] += later[:rows, :cols] (row stride NT). */
AVX512 static void add_rows_avx512(const float *later, float *y, int64_t ldy, int64_t rows, int cols) {
    const __mmask16 m = (__mmask16)((1u << cols) - 1);
    for (int64_t r = 0; r < rows; r++)
        _mm512_mask_storeu_ps(y + r * ldy, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + r * ldy),
                                                           _mm512_maskz_loadu_ps(m, later + r * NT)));
}

/* A thread's buffer for an item's lanes between K ranges, [WIDE][rows][NT][16] at most, made at
 * its first use and kept (allocating it per item mapped fresh pages each time: 1.15-1.20x the
 * time of 4096-wide layers at 256 rows; on the stack it would ask 384 KiB of every thread). */
static float *lanes_buffer(void) {
    static __thread float *lanes;
    if (!lanes) lanes = aligned_alloc(64, (size_t)WIDE * RB_MAX * NT * 16 * sizeof(float));
    return lanes;
}

/* One work item: rows [0, rows) of x against output columns [n0, n0 + cols) of a weight whose
 * row n starts at w + n * ldw, its sums (+ bias) stored in y, or with `add` (a later K part's,
 * item_parts) added to what y holds. Through the panel, each K range runs every tile of NT of the
 * item's columns in turn: the range's x rows, read again by each tile, stay in L2 however long K
 * is (an item of one tile read its rows of x whole once per tile: the 8B's down_proj, K = 12288,
 * streamed 48 rows' 2.4 MB from L3 for every 8 columns). */
static void item(int isa, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t ldw,
                 const float *bias, float *y, int64_t ldy, int64_t rows, int64_t n0, int cols, int64_t K, int add) {
    if (isa == 2 && rows <= FEW && add) {
        for (int n = 0; n < cols; n += NT) {
            const int left = cols - n < NT ? cols - n : NT;
            float later[FEW * NT];
            few_avx512(type, x, ldx, rows, w + (n0 + n) * ldw, ldw, left, K, later, NT, 0);
            add_rows_avx512(later, y + n0 + n, ldy, rows, left);
        }
        return;
    }
    if (isa == 2 && rows <= FEW) {
        few_avx512(type, x, ldx, rows, w + n0 * ldw, ldw, cols, K, y + n0, ldy, bias ? bias + n0 : 0);
        return;
    }
    if (isa == 1 && rows <= FEW2) {
        few_avx2(type, x, ldx, rows, w + n0 * ldw, ldw, cols, K, y + n0, ldy, bias ? bias + n0 : 0, add);
        return;
    }
    float panel[NT * LDP] __attribute__((aligned(64)));
    const int tiles = (cols + NT - 1) / NT;
    const size_t lanes = (size_t)rows * NT * 16; /* one tile's */
    float *acc = lanes_buffer();
    /* Even ranges of whole 256-value super-blocks (32-value blocks for a K that has no such), as
     * few as fit the panel: a K of 576 or 640 (small models' width) is one range, whose lanes
     * never leave the registers. */
    const int64_t per_block = block_values(type), size = block_bytes(type), unit = K % 256 ? 32 : 256;
    const int64_t ranges = (K / unit + KB / unit - 1) / (KB / unit), span = (K / unit + ranges - 1) / ranges * unit;
    if (cols % NT) memset(panel, 0, sizeof panel); /* (a partial tile's other columns: finite values) */
    if (isa != 2) memset(acc, 0, tiles * lanes * sizeof(float));
    for (int64_t k0 = 0; k0 < K; k0 += span) {
        const int64_t kb = K - k0 < span ? K - k0 : span;
        for (int t = 0; t < tiles; t++) {
            const int64_t c0 = n0 + t * NT;
            const int tc = cols - t * NT < NT ? cols - t * NT : NT;
            for (int n = 0; n < tc; n++) {
                /* Weights dequantized later, which the memory system would otherwise start
                 * fetching only once a thread asks for them (prefetches do not fault): the same
                 * range of the next tile's rows (past the item's last tile, the next item's
                 * first), or after a wide item's last tile its next range's first. (An item of
                 * one tile that fetched its own next range instead: 1.03-1.05x the time.) */
                const int wrap = t + 1 == tiles && tiles > 1;
                const uint8_t *ahead = w + ((wrap ? n0 : c0 + NT) + n) * ldw
                                       + (wrap ? k0 + span : k0) / per_block * size;
                for (int64_t b = 0; b < kb / per_block * size; b += 64)
                    _mm_prefetch((const char *)ahead + b, _MM_HINT_T0);
                dequant_blocks(isa, type, w + (c0 + n) * ldw, k0 / per_block, kb / per_block, panel + n * LDP);
            }
            if (isa == 2)
                rows_avx512(x + k0, ldx, rows, panel, kb / 16, acc + t * lanes, k0 == 0, k0 + kb == K, y + c0, ldy,
                            bias ? bias + c0 : 0, tc, add);
            else rows_avx2(x + k0, ldx, rows, panel, kb / 16, acc + t * lanes);
        }
    }
    if (isa != 2)
        for (int t = 0; t < tiles; t++)
            for (int64_t r = 0; r < rows; r++)
                for (int n = 0; n < NT && t * NT + n < cols; n += 4) {
                    float out[4];
                    finish_scalar(acc + t * lanes + r * NT * 16 + n * 16, out);
                    for (int i = 0; i < 4 && t * NT + n + i < cols; i++) {
                        const int64_t c = n0 + t * NT + n + i;
                        float *at = y + r * ldy + c;
                        *at = add ? *at + out[i] : bias ? out[i] + bias[c] : out[i];
                    }
                }
}

/* item over K cut into S parts at cuts[0] = 0 < cuts[1] < ... < cuts[S] = K (values, on block
 * boundaries; cuts NULL: K whole): each part's sums in THE ORDER over its own K (lanes from zero,
 * the closing tree), as item computes a weight holding that part alone, then added in part order,
 * the bias in the first: ((y_0 + bias) + y_1) + ..., the bits of S calls on the parts added
 * afterwards, which are a tensor-parallel group's ranks' partial products summed in rank order
 * (distributed/parts.py). */
static void item_parts(int isa, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t ldw,
                       const float *bias, float *y, int64_t ldy, int64_t rows, int64_t n0, int cols, int64_t K,
                       int64_t S, const int64_t *cuts) {
    const int64_t whole[2] = {0, K};
    if (!cuts) S = 1, cuts = whole;
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *part = w + cuts[s] / block_values(type) * block_bytes(type);
        item(isa, type, x + cuts[s], ldx, part, ldw, s ? 0 : bias, y, ldy, rows, n0, cols, cuts[s + 1] - cuts[s],
             s > 0);
    }
}

/* Rows per work item for a group of R rows: as many as keep an item's rows of x near 1 MiB (they
 * stay in L2 while the item's successors, the next column tiles, read them again), between RB and
 * RB_MAX, in equal blocks rounded up to whole row tiles. More rows per item dequantize each weight
 * fewer times; which item a row lands in changes none of its bits. K 0: x need not stay (an item
 * of WIDE tiles, which reads each K range of its rows for all its tiles at once): RB_MAX. */
static int64_t block_rows(int64_t R, int64_t K) {
    if (R < 1) return RB; /* no items either way */
    int64_t cap = K > 0 ? CAP / K : RB_MAX;
    cap = cap < RB ? RB : cap > RB_MAX ? RB_MAX : cap;
    const int64_t blocks = (R + cap - 1) / cap, rows = ((R + blocks - 1) / blocks + 5) / 6 * 6;
    return rows > RB_MAX ? RB_MAX : rows;
}

/* A projection of P parts, each y[:, its columns] = x @ W_p^T (+ bias_p), in one parallel loop over
 * every part's items (q/k/v or gate/up: one fork and join, not one per part). Part p: types[p],
 * w[p] uint8 [n[p]][K's blocks] (row stride ldw[p] bytes), bias[p] float32 [n[p]] or NULL, its
 * columns following part p - 1's; x [R, K] float32 (row stride ldx), y [R, sum n] (row stride ldy).
 * cuts (NULL: none): K computed in S parts added in order, as item_parts does (a row-parallel
 * layer computed as a tensor-parallel group's ranks would). */
void quant_gemm_parts(int isa, int64_t P, const int *types, const uint8_t *const *w, const int64_t *ldw,
                      const int64_t *n, const float *const *bias, int64_t S, const int64_t *cuts, const float *x,
                      int64_t ldx, float *y, int64_t ldy, int64_t R, int64_t K) {
    int64_t start[P + 1], col[P + 1]; /* each part's first item and first column */
    /* Items of WIDE tiles where an item's rows of x would not stay in L2 (the 8B's down_proj, K =
     * 12288, from 22 rows: 0.75x its time at 256 rows, and 0.91x again with 128 rows an item rather
     * than 48); where they stay, of one tile (WIDE ones measured up to 1.09x slower there: the
     * lanes of four tiles between K ranges leave L1). */
    const int64_t wide = R > FEW && block_rows(R, K) * K > CAP, rb = block_rows(R, wide ? 0 : K);
    const int64_t blocks = (R + rb - 1) / rb, width = wide ? NT * WIDE : NT;
    part_items(P, n, blocks, width, start, col);
    _Pragma("omp parallel for schedule(guided) if (start[P] > 1)")
    for (int64_t it = 0; it < start[P]; it++) {
        const int64_t p = owner(start, P, it), local = it - start[p], tiles = (n[p] + width - 1) / width;
        const int64_t tile = local % tiles, first = local / tiles * rb;
        const int cols = n[p] - tile * width < width ? (int)(n[p] - tile * width) : (int)width;
        item_parts(isa, types[p], x + first * ldx, ldx, w[p], ldw[p], bias[p], y + first * ldy + col[p], ldy,
                   R - first < rb ? R - first : rb, tile * width, cols, K, S, cuts);
    }
}

/* Experts' rows (dense layers run quant_gemm_parts): x [*, K] float32 (row stride ldx); w uint8
 * [E][N][K's blocks], strides lde and ldw bytes; y [*, N] (row stride ldy); groups [G][3]:
 * expert, first row, rows. cuts (NULL: none): K in S parts at cuts[0] = 0 < ... < cuts[S] = K
 * (on block boundaries), part s's sums stored apart at y + s * lds, each as a call on that part's
 * blocks alone computes them (the experts' weighted sum of each part comes before the parts are
 * added: layers/moe.py). One item runs its columns' parts in turn, so each row of weights is read
 * front to back once, as K whole reads it (two calls on the parts, each reading its strided share
 * of every row: 1.07-1.2x the time of K whole from memory). */
void quant_gemm(int isa, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t lde, int64_t ldw,
                float *y, int64_t ldy, const int64_t *groups, int64_t G, int64_t K, int64_t N, int64_t S,
                const int64_t *cuts, int64_t lds) {
    const int64_t whole[2] = {0, K}, tiles = (N + NT - 1) / NT;
    if (!cuts) S = 1, cuts = whole;
    int64_t *start = malloc((G + 1) * sizeof(int64_t)); /* first item of each group */
    start[0] = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t rows = groups[3 * g + 2], rb = block_rows(rows, K);
        start[g + 1] = start[g] + (rows + rb - 1) / rb * tiles;
    }
    _Pragma("omp parallel for schedule(guided) if (start[G] > 1)")
    for (int64_t it = 0; it < start[G]; it++) {
        const int64_t g = owner(start, G, it);
        const int64_t local = it - start[g], block = local / tiles, tile = local % tiles;
        const int64_t rb = block_rows(groups[3 * g + 2], K);
        const int64_t e = groups[3 * g], first = groups[3 * g + 1] + block * rb;
        const int64_t left = groups[3 * g + 1] + groups[3 * g + 2] - first;
        const int cols = N - tile * NT < NT ? (int)(N - tile * NT) : NT;
        for (int64_t p = 0; p < S; p++)
            item(isa, type, x + first * ldx + cuts[p], ldx, w + e * lde + cuts[p] / block_values(type) * block_bytes(type),
                 ldw, 0, y + p * lds + first * ldy, ldy, left < rb ? left : rb, tile * NT, cols, cuts[p + 1] - cuts[p], 0);
    }
    free(start);
}

#else

int quant_isa(void) { return 0; }

#endif
