/* The AMX level of quant_gemm.c (isa 3), included by it: the same matmuls on the tile unit's
 * bfloat16 dot products (TDPBF16PS), every row count alike, one row included.
 *
 * Exact operands. Each float32 x is split into three bfloat16 parts, x = hi + mid + lo: hi is x
 * cut to its top 8 significant bits, mid the remainder cut likewise, lo what is left (at most 8
 * bits: exact). Every quant is a small integer, exact in bfloat16: Q4_0's nibble - 8, Q4_1's and
 * Q4_K's nibble, Q5_K's 5-bit code, Q6_K's code - 32, Q8_0's int8, MXFP4's doubled e2m1 value. So
 * every product the tile unit forms (8 by 8 significant bits) is exact; its sums are float32.
 *
 * THE ORDER (AMX). Per row, three "combos": its hi, mid and lo parts. For each output column n
 * and combo c, an accumulator a(n, c) starts at zero and takes fma(S, scale, a) for each step
 * along K in order (a block of 32 values; Q6_K: a sub-block of 16), S the tile unit's dot product
 * of the step's quants of column n with the step's part c values (one TDPBF16PS from zero), scale
 * the step's float32 scale (Q8_0, Q4_0, Q4_1: d; MXFP4: half its power of two, on doubled codes;
 * Q4_K, Q5_K, Q6_K: d times the sub-block's scale, an exact product). The formats with a minimum
 * (Q4_1, Q4_K, Q5_K) keep a second accumulator m(n, c), from zero: fma(min, X, m) for each step in
 * order, min the step's float32 minimum (Q4_1: m; Q4_K, Q5_K: -(dmin times the sub-block's
 * minimum)) and X the sum of the step's part c values (the two halves added lane by lane, then the
 * sixteen lanes in _mm512_reduce_add_ps's fixed tree); then a(n, c) + m(n, c). Last, y = (hi's +
 * mid's) + lo's (+ bias). A tile row is one column, a tile column one combo: no sum sees another
 * row, so nothing depends on the row count, the tile or lane a combo lands in, the thread or the
 * group. The bits differ from the FMA paths' (the level is chosen per process); the error is
 * float32 rounding of the same size (each step's sum of 32 exact products, then one FMA per step
 * and term). Parts of x below about 2^-126 (x itself below about 2^-110) count as zero: the tile
 * unit reads bfloat16 subnormals as zero.
 *
 * How it runs. A work item is AMX_NT = 16 output columns (one tile row each) by up to RB_MAX rows.
 * quant_gemm_parts and quant_gemm split every item's rows once per call (amx_split: each item's
 * combos in groups of 16, their parts in the tile unit's pair layout, 1 KiB per group and block,
 * and X), then each item walks K in ranges: it writes its columns' quants for the range as
 * bfloat16 tiles (a 64-byte tile row per column and block) with their scales, then for each group
 * of 16 of its combos runs the range's steps, tiles A (16 columns by 32 k), B (16 k pairs by 16
 * combos) and C (16 by 16 float32 sums), the vector units draining step s's C into a(n, c) while
 * the tile unit computes steps s + 1 and s + 2; the minimum terms follow per range, eight combos at
 * a time.
 *
 * Speed (docs/performance.md): the drain costs a C row per column, block and group whatever the
 * rows, so one row runs at about half the FMA path's speed, 8 rows at about its speed, and from
 * 32 rows on it gains 1.1-1.4x: the level runs only where asked (quant.py).
 */
#define AMX_NT 16 /* output columns per work item: one tile row each */

#if defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11) /* AMX intrinsics, arch_prctl */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#define AMX_KB 640 /* most k values per range: the range's bfloat16 tiles take 20 KiB */
#define AMX_GROUPS ((3 * RB_MAX + 15) / 16)

/* AMX-BF16 and AVX512-BW, and Linux's leave to use the tiles (asked once per process). */
static int amx_supported(void) {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 22) & 1) || !((d >> 24) & 1) || !((b >> 30) & 1)) return 0; /* AMX-BF16, AMX-TILE, AVX512BW */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* The rows of a call as the tile unit reads them, in regions (a work item's rows each): region j's
 * combos (3r + p: its row r's part p) in groups of 16 from group region[j] on, the last group's
 * unused combos zero. b [group][K/2][16][2] bfloat16: one B tile per group and 32 k, 1 KiB in a
 * run; sums [group][K/32][16] float32: X. `call` tells the calls apart (a thread loads the tile
 * configuration once per call). */
typedef struct {
    uint16_t *b;
    float *sums;
    int64_t *region, *group_region; /* group_region: quant_gemm's first region of each expert group */
    int64_t call, K;
} amx_rows;

/* 32 float32 (two registers) to their bfloat16 bits in order: each value's top 16 bits. */
AMX INLINE __m512i top_halves(__m512 a, __m512 b) {
    static const uint16_t odd[32] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                     33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    return _mm512_permutex2var_epi16(_mm512_castps_si512(a), _mm512_loadu_si512(odd), _mm512_castps_si512(b));
}

/* `rows` rows of x (stride ldx) into the region whose first group is g0. */
AMX static void amx_split_region(const float *x, int64_t ldx, int64_t rows, int64_t g0, const amx_rows *s) {
    const int64_t K = s->K, last = g0 + (3 * rows - 1) / 16;
    const __m512 top = _mm512_castsi512_ps(_mm512_set1_epi32((int)0xFFFF0000u));
    const __m512i pairs = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    memset(s->b + last * K * 16, 0, (size_t)K * 32);
    memset(s->sums + last * K / 2, 0, (size_t)K * 2);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < K; k += 32) {
            __m512 v0 = _mm512_loadu_ps(x + r * ldx + k), v1 = _mm512_loadu_ps(x + r * ldx + k + 16);
            for (int p = 0; p < 3; p++) {
                const __m512 h0 = _mm512_and_ps(v0, top), h1 = _mm512_and_ps(v1, top);
                const int64_t g = g0 + (3 * r + p) / 16, lane = (3 * r + p) % 16;
                _mm512_i32scatter_epi32((int *)s->b + (g * K / 2 + k / 2) * 16 + lane, pairs, top_halves(h0, h1), 4);
                s->sums[(g * K / 32 + k / 32) * 16 + lane] = _mm512_reduce_add_ps(_mm512_add_ps(h0, h1));
                v0 = _mm512_sub_ps(v0, h0); /* exact: h is v's leading bits */
                v1 = _mm512_sub_ps(v1, h1);
            }
        }
}

/* Regions [0, n) (region j: rows[j] rows from row first[j] of x) split into `s`. */
static void amx_split(const float *x, int64_t ldx, int64_t K, int64_t n, const int64_t *first, const int64_t *rows,
                      amx_rows *s) {
    static int64_t calls;
    s->call = __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
    s->K = K;
    s->region = malloc((n + 1) * sizeof(int64_t));
    s->region[0] = 0;
    for (int64_t j = 0; j < n; j++) s->region[j + 1] = s->region[j] + (3 * rows[j] + 15) / 16;
    s->b = aligned_alloc(64, (size_t)(s->region[n] * K * 32 + 64));
    s->sums = aligned_alloc(64, (size_t)(s->region[n] * K * 2 + 64));
    int64_t total = 0;
    for (int64_t j = 0; j < n; j++) total += rows[j];
    _Pragma("omp parallel for schedule(dynamic, 1) if (n > 1 && total * K >= (1 << 16))")
    for (int64_t j = 0; j < n; j++) amx_split_region(x + first[j] * ldx, ldx, rows[j], s->region[j], s);
}

/* quant_gemm_parts's regions: blocks of rb rows of R. */
static void amx_split_blocks(const float *x, int64_t ldx, int64_t K, int64_t R, int64_t rb, amx_rows *s) {
    const int64_t n = (R + rb - 1) / rb;
    int64_t *first = malloc(2 * n * sizeof(int64_t)), *rows = first + n;
    for (int64_t j = 0; j < n; j++) {
        first[j] = j * rb;
        rows[j] = R - j * rb < rb ? R - j * rb : rb;
    }
    amx_split(x, ldx, K, n, first, rows, s);
    s->group_region = 0;
    free(first);
}

static int64_t block_rows(int64_t R, int64_t K);

/* quant_gemm's regions: each expert group's blocks (block_rows of its rows), in order. */
static void amx_split_groups(const float *x, int64_t ldx, int64_t K, const int64_t *groups, int64_t G,
                             amx_rows *s) {
    int64_t n = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t count = groups[3 * g + 2], rb = block_rows(count, K);
        n += (count + rb - 1) / rb;
    }
    int64_t *first = malloc(2 * n * sizeof(int64_t)), *rows = first + n, j = 0;
    s->group_region = malloc(G * sizeof(int64_t));
    for (int64_t g = 0; g < G; g++) {
        const int64_t count = groups[3 * g + 2], rb = block_rows(count, K);
        s->group_region[g] = j;
        for (int64_t r = 0; r < count; r += rb, j++) {
            first[j] = groups[3 * g + 1] + r;
            rows[j] = count - r < rb ? count - r : rb;
        }
    }
    amx_split(x, ldx, K, n, first, rows, s);
    free(first);
}

static void amx_free(amx_rows *s) {
    free(s->b);
    free(s->sums);
    free(s->region);
    free(s->group_region);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0, 1: A (16 columns by `step` k); 2, 3: B (step / 2 k pairs by 16 combos); 4-6: C. Loaded
 * when this thread's tiles hold another call's or another step's configuration. */
AMX INLINE void amx_configure(int64_t call, int step) {
    static __thread int64_t loaded = -1;
    if (loaded == 2 * call + (step == 16)) return;
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) {
        cfg.rows[t] = t == 2 || t == 3 ? step / 2 : AMX_NT;
        cfg.colsb[t] = t < 2 ? 2 * step : 64;
    }
    _tile_loadconfig(&cfg);
    loaded = 2 * call + (step == 16);
}

/* bfloat16 bits of 32 values (a lookup table for vpermw, which reads an index's low 5 bits). */
AMX INLINE __m512i bf16_table(__m512 low16, __m512 high16) { return top_halves(low16, high16); }

/* 32 byte codes (k order) to bfloat16 through `table` (their low 5 bits index it). */
AMX INLINE __m512i look_up(__m256i codes, __m512i table) {
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table);
}

/* 16 bytes of nibbles: values 0-15 the low nibbles, 16-31 the high (a table of 16 values, twice). */
AMX INLINE __m512i nibbles_bf16(const uint8_t *q, __m512i table) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    return look_up(_mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1), table);
}

AMX INLINE __m512i int8_bf16(const uint8_t *q) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return top_halves(lo, hi); /* small integers: their top halves are exact */
}

/* A range's quants of the item's columns as A tiles, panel [step][AMX_NT][32] bfloat16, with each
 * step's scale [step16 or step][AMX_NT] and minimum [step][AMX_NT] (Q6_K: two 16-k steps per 32). */
AMX static void amx_panel(int type, const uint8_t *const *col, int64_t k0, int64_t kb, uint16_t *panel, float *scale,
                          float *mins) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 fp4 = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const int64_t size = block_bytes(type), values = block_values(type), first = k0 / values;
    const int64_t blocks = kb / values;
#define ROW(step, n) ((__m512i *)(panel + ((step) * AMX_NT + (n)) * 32))
    switch (type) {
    case Q8_0:
    case Q4_0:
    case Q4_1:
    case MXFP4: {
        const __m512 t = type == Q4_0 ? _mm512_sub_ps(iota, _mm512_set1_ps(8)) : type == MXFP4 ? fp4 : iota;
        const __m512i table = bf16_table(t, t);
        int offsets[AMX_NT];
        for (int n = 0; n < AMX_NT; n++) offsets[n] = (int)(col[n] - col[0]);
        const __m512i at = _mm512_loadu_si512(offsets);
        for (int64_t i = 0; i < blocks; i++) { /* the 16 columns' scales (and minima) of block i at once */
            const __m512i head = _mm512_i32gather_epi32(at, col[0] + (first + i) * size, 1);
            if (type == MXFP4) { /* e8m0_half */
                const __m512i e = _mm512_and_si512(head, _mm512_set1_epi32(0xFF));
                const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
                const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
                const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
                _mm512_store_ps(scale + i * AMX_NT, _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny)));
            } else {
                _mm512_store_ps(scale + i * AMX_NT, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
                if (type == Q4_1)
                    _mm512_store_ps(mins + i * AMX_NT, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))));
            }
        }
        const int64_t at_quants = type == Q8_0 || type == Q4_0 ? 2 : type == Q4_1 ? 4 : 1;
        for (int n = 0; n < AMX_NT; n++)
            for (int64_t i = 0; i < blocks; i++) {
                const uint8_t *q = col[n] + (first + i) * size + at_quants;
                _mm512_store_si512(ROW(i, n), type == Q8_0 ? int8_bf16(q) : nibbles_bf16(q, table));
            }
        break;
    }
    case Q4_K:
    case Q5_K: {
        const __m512i table = type == Q4_K ? bf16_table(iota, iota)
                                           : bf16_table(iota, _mm512_add_ps(iota, _mm512_set1_ps(16)));
        for (int n = 0; n < AMX_NT; n++)
            for (int64_t i = 0; i < blocks; i++) {
                const uint8_t *b = col[n] + (first + i) * size;
                float s[16];
                k_scales(b, s);
                for (int j = 0; j < 8; j++) {
                    __m256i codes;
                    if (type == Q5_K) codes = q5_codes(b, j);
                    else {
                        codes = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (j / 2)));
                        if (j & 1) codes = _mm256_srli_epi16(codes, 4);
                    }
                    _mm512_store_si512(ROW(8 * i + j, n), look_up(codes, table));
                    scale[(8 * i + j) * AMX_NT + n] = s[j];
                    mins[(8 * i + j) * AMX_NT + n] = s[8 + j];
                }
            }
        break;
    }
    case Q6_K: {
        /* codes - 32 as bytes: their low 6 bits index a table of 0..31 then -32..-1 */
        const __m512i t0 = bf16_table(iota, _mm512_add_ps(iota, _mm512_set1_ps(16)));
        const __m512i t1 = bf16_table(_mm512_sub_ps(iota, _mm512_set1_ps(32)), _mm512_sub_ps(iota, _mm512_set1_ps(16)));
        for (int n = 0; n < AMX_NT; n++)
            for (int64_t i = 0; i < blocks; i++) {
                const uint8_t *b = col[n] + (first + i) * size;
                float s[16];
                q6_scales(b, s);
                for (int j = 0; j < 8; j++) {
                    const __m512i codes = _mm512_cvtepu8_epi16(q6_codes(b, j / 4, j % 4));
                    _mm512_store_si512(ROW(8 * i + j, n), _mm512_permutex2var_epi16(t0, codes, t1));
                    scale[(16 * i + 2 * j) * AMX_NT + n] = s[2 * j];
                    scale[(16 * i + 2 * j + 1) * AMX_NT + n] = s[2 * j + 1];
                }
            }
        break;
    }
    }
#undef ROW
}

/* Steps [0, steps) of a range for one group of 16 combos: tile A of step s in the panel, B at
 * b + s * bstep (rows ldb bytes apart), into the accumulators acc[AMX_NT] (acc[n] lane c: column n,
 * combo c). Step s takes tiles A and B 0, 2 or 1, 3 (s even or odd) and C 4 + s % 3: its C is
 * stored and drained once step s + 2's product is issued, while the tile unit computes. */
#define AMX_PRODUCT(TA, TB, TC, s)                                                               \
    {                                                                                            \
        _tile_loadd(TA, panel + ((s) * step / 32) * AMX_NT * 32 + (s) * step % 32, 64);          \
        _tile_loadd(TB, b + (s) * bstep, ldb);                                                   \
        _tile_zero(TC);                                                                          \
        _tile_dpbf16ps(TC, TA, TB);                                                              \
    }
#define AMX_DRAIN(s, out)                                                                        \
    for (int n = 0; n < AMX_NT; n++)                                                             \
        acc[n] = _mm512_fmadd_ps(_mm512_load_ps(out + 16 * n), _mm512_set1_ps(scale[(s) * AMX_NT + n]), acc[n]);

AMX INLINE void amx_steps(const uint16_t *panel, const float *scale, const uint16_t *b, int64_t bstep, int64_t ldb,
                          int64_t steps, const int step, __m512 acc[AMX_NT]) {
    float out[3][AMX_NT * 16] __attribute__((aligned(64)));
    AMX_PRODUCT(0, 2, 4, 0)
    if (steps > 1) AMX_PRODUCT(1, 3, 5, 1)
#define AMX_STAGE(i, TA, TB, TN, TC)                                                             \
    if (s + (i) >= steps) break;                                                                 \
    if (s + (i) + 2 < steps) AMX_PRODUCT(TA, TB, TN, s + (i) + 2)                                \
    _tile_stored(TC, out[(i) % 3], 64);                                                          \
    AMX_DRAIN(s + (i), out[(i) % 3])
    for (int64_t s = 0; s < steps; s += 6) {
        AMX_STAGE(0, 0, 2, 6, 4)
        AMX_STAGE(1, 1, 3, 4, 5)
        AMX_STAGE(2, 0, 2, 5, 6)
        AMX_STAGE(3, 1, 3, 6, 4)
        AMX_STAGE(4, 0, 2, 4, 5)
        AMX_STAGE(5, 1, 3, 5, 6)
    }
#undef AMX_STAGE
}

/* The minimum terms of `combos` combos over a range's steps: m[c] (lane n: column n) takes
 * fma(min of step s, X of step s and combo c, m[c]) for s in order; combo c's X of step s at
 * x[c / 16 * gx + 16 s + c % 16]. */
AMX INLINE void amx_mins(const float *mins, const float *x, int64_t gx, int64_t steps, int64_t combos, float *m) {
    int64_t c = 0;
    for (; c + 8 <= combos; c += 8) { /* eight at a time: each step's minima loaded once */
        __m512 a[8];
        const float *xc[8];
        for (int j = 0; j < 8; j++) {
            a[j] = _mm512_load_ps(m + 16 * (c + j));
            xc[j] = x + (c + j) / 16 * gx + (c + j) % 16;
        }
        for (int64_t s = 0; s < steps; s++) {
            const __m512 v = _mm512_load_ps(mins + s * AMX_NT);
            for (int j = 0; j < 8; j++) a[j] = _mm512_fmadd_ps(v, _mm512_set1_ps(xc[j][16 * s]), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm512_store_ps(m + 16 * (c + j), a[j]);
    }
    for (; c < combos; c++) {
        __m512 a = _mm512_load_ps(m + 16 * c);
        const float *xc = x + c / 16 * gx + c % 16;
        for (int64_t s = 0; s < steps; s++)
            a = _mm512_fmadd_ps(_mm512_load_ps(mins + s * AMX_NT), _mm512_set1_ps(xc[16 * s]), a);
        _mm512_store_ps(m + 16 * c, a);
    }
}

/* r[i] lane j to r[j] lane i. */
AMX INLINE void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 lo = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44), hi = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
        const __m512 lo2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44), hi2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
        t[j] = _mm512_shuffle_f32x4(lo, lo2, 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(lo, lo2, 0xDD);
        t[8 + j] = _mm512_shuffle_f32x4(hi, hi2, 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(hi, hi2, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* One work item on AMX: the `rows` rows of region `region` of the split `xs` against output
 * columns [0, cols) of w (row n at w + n * ldw), y at the item's first row and column. */
AMX static void amx_item(int type, const amx_rows *xs, int64_t region, int64_t rows, const uint8_t *w, int64_t ldw,
                         const float *bias, float *y, int64_t ldy, int cols, int64_t K) {
    uint16_t panel[AMX_KB / 32 * AMX_NT * 32] __attribute__((aligned(64)));
    float scale[AMX_KB / 16 * AMX_NT] __attribute__((aligned(64))), mins[AMX_KB / 32 * AMX_NT] __attribute__((aligned(64)));
    /* acc [group][column][16 combos]: the scaled sums between ranges; m [combo][column]: the
     * minimum terms, then the finished sums */
    float acc[AMX_GROUPS * AMX_NT * 16] __attribute__((aligned(64))), m[3 * RB_MAX * AMX_NT] __attribute__((aligned(64)));
    const int step = type == Q6_K ? 16 : 32, with_mins = type == Q4_1 || type == Q4_K || type == Q5_K;
    const int64_t per_block = block_values(type), size = block_bytes(type), combos = 3 * rows, g0 = xs->region[region];
    const int64_t ranges = (K / per_block + AMX_KB / per_block - 1) / (AMX_KB / per_block);
    const int64_t span = (K / per_block + ranges - 1) / ranges * per_block, groups = (combos + 15) / 16;
    const uint8_t *col[AMX_NT];
    for (int n = 0; n < AMX_NT; n++) col[n] = w + (n < cols ? n : cols - 1) * ldw; /* a part tile repeats its last */
    if (with_mins) memset(m, 0, (size_t)combos * AMX_NT * sizeof(float));
    amx_configure(xs->call, step);
    for (int64_t k0 = 0; k0 < K; k0 += span) {
        const int64_t kb = K - k0 < span ? K - k0 : span;
        /* The same range of the next tile's columns, which the memory system would otherwise
         * start fetching only once a thread asks for them (prefetches do not fault). */
        for (int n = 0; n < AMX_NT; n++)
            for (int64_t b = 0; b < kb / per_block * size; b += 64)
                _mm_prefetch((const char *)w + (n + AMX_NT) * ldw + k0 / per_block * size + b, _MM_HINT_T0);
        amx_panel(type, col, k0, kb, panel, scale, mins);
        for (int64_t g = 0; g < groups; g++) {
            __m512 a[AMX_NT];
            for (int n = 0; n < AMX_NT; n++) a[n] = k0 ? _mm512_load_ps(acc + (g * AMX_NT + n) * 16) : _mm512_setzero_ps();
            const uint16_t *b = xs->b + ((g0 + g) * K / 2 + k0 / 2) * 32;
            if (step == 16) amx_steps(panel, scale, b, 8 * 32, 64, kb / 16, 16, a);
            else amx_steps(panel, scale, b, 16 * 32, 64, kb / 32, 32, a);
            if (k0 + kb < K) {
                for (int n = 0; n < AMX_NT; n++) _mm512_store_ps(acc + (g * AMX_NT + n) * 16, a[n]);
                continue;
            }
            /* the last range: the group's sums by combo (lanes: columns), plus the minimum terms,
             * wait in m once these are complete */
            if (with_mins) amx_mins(mins, xs->sums + ((g0 + g) * K / 32 + k0 / 32) * 16, K / 2, kb / 32,
                                    combos - 16 * g < 16 ? combos - 16 * g : 16, m + 16 * 16 * g);
            transpose16(a);
            for (int c = 0; c < 16 && 16 * g + c < combos; c++) {
                float *mc = m + 16 * (16 * g + c);
                _mm512_store_ps(mc, with_mins ? _mm512_add_ps(a[c], _mm512_load_ps(mc)) : a[c]);
            }
        }
        if (with_mins && k0 + kb < K) amx_mins(mins, xs->sums + (g0 * K / 32 + k0 / 32) * 16, K / 2, kb / 32, combos, m);
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const float *mr = m + 48 * r;
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(mr), _mm512_load_ps(mr + 16)), _mm512_load_ps(mr + 32));
        _mm512_mask_storeu_ps(y + r * ldy, keep, bias ? _mm512_add_ps(sum, b) : sum);
    }
}

#else

static int amx_supported(void) { return 0; }
typedef struct {
    uint16_t *b;
    float *sums;
    int64_t *region, *group_region;
    int64_t call, K;
} amx_rows;
static void amx_split_blocks(const float *x, int64_t ldx, int64_t K, int64_t R, int64_t rb, amx_rows *s) {}
static void amx_split_groups(const float *x, int64_t ldx, int64_t K, const int64_t *groups, int64_t G,
                             amx_rows *s) {}
static void amx_free(amx_rows *s) {}
static void amx_item(int type, const amx_rows *xs, int64_t region, int64_t rows, const uint8_t *w, int64_t ldw,
                     const float *bias, float *y, int64_t ldy, int cols, int64_t K) {}

#endif
