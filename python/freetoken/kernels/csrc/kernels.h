/* What the kernels share: every exported function's signature, decoder_layer.c's structs, and the
 * bfloat16, ISA and work-item helpers more than one file uses.
 *
 * Written once: kernels/build.py reads this file for the ctypes side too (each prototype's
 * argument types, each struct's fields, the enum's values), so a signature changed here changes
 * both. It reads a plain subset of C: prototypes `void|int name(params);` on top-level lines,
 * `struct name { type a, *b; ... };` and `enum { NAME = value, ... };`. A data pointer whose
 * element type follows the model's dtype is `void *` (one struct field or function pointer serves
 * both dtypes); each definition takes it so and reads it through its own type.
 */
#ifndef FREETOKEN_KERNELS_H
#define FREETOKEN_KERNELS_H

#include <stdint.h>
#include <string.h>

/* ---------------------------------------------------------------- grouped_gemm.c */
int grouped_gemm_supported(void);
void grouped_gemm_f32(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy,
                      const int64_t *groups, int64_t G, int64_t K, int64_t N);
void grouped_gemm_bf16(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy,
                       const int64_t *groups, int64_t G, int64_t K, int64_t N);
void rms_norm_f32(const void *x, int64_t ldx, const void *w, void *y, int64_t M, int64_t D, float eps);
void rms_norm_bf16(const void *x, int64_t ldx, const void *w, void *y, int64_t M, int64_t D, float eps);
void rotate_f32(const void *x, int64_t ldt, int64_t ldh, const void *cos, const void *sin, void *y, int64_t tokens,
                int64_t heads, int64_t D);
void rotate_bf16(const void *x, int64_t ldt, int64_t ldh, const void *cos, const void *sin, void *y, int64_t tokens,
                 int64_t heads, int64_t D);
void add_rms_norm_f32(void *x, int64_t ldx, const void *d, int64_t ldd, const void *w, void *y, int64_t M, int64_t D,
                      float eps);
void add_rms_norm_bf16(void *x, int64_t ldx, const void *d, int64_t ldd, const void *w, void *y, int64_t M, int64_t D,
                       float eps);
void norm_rotate_f32(void *x, int64_t ldt, int64_t ldh, int64_t tokens, int64_t heads, int64_t split, const void *wq,
                     const void *wk, float eps, const void *cos, const void *sin, int64_t D);
void norm_rotate_bf16(void *x, int64_t ldt, int64_t ldh, int64_t tokens, int64_t heads, int64_t split, const void *wq,
                      const void *wk, float eps, const void *cos, const void *sin, int64_t D);
void silu_mul_f32(const void *x, int64_t ldx, void *y, int64_t M, int64_t half);
void silu_mul_bf16(const void *x, int64_t ldx, void *y, int64_t M, int64_t half);
void round_to_bf16(const float *x, uint16_t *y, int64_t n);
void moe_sum_f32(const float *down, int64_t ldd, const float *scale, const int64_t *slots, int64_t T,
                 int64_t k, int64_t H, float *out);
void moe_route_f32(const float *logits, int64_t ldl, int64_t T, int64_t E, int64_t k, int64_t mode,
                   float *weights, int64_t *ids);
void clamped_swiglu_f32(const float *x, int64_t ldx, float *y, int64_t M, int64_t half, float alpha, float limit);
/* moe_route_f32's modes: Qwen-MoE's softmax then top k (renormalised or not), gpt-oss's top k
 * then softmax. */
enum { ROUTE_SOFTMAX_TOPK = 0, ROUTE_SOFTMAX_TOPK_NORM = 1, ROUTE_TOPK_SOFTMAX = 2 };

/* ---------------------------------------------------------------- pool_attention.c */
int pool_attention_supported(void);
int pool_attention_set_isa(int isa);
void pool_attention_f32(const float *q, const void *cache, const int64_t *slots, const int64_t *ranges,
                        const float *sinks, float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t D,
                        float scale);
void pool_attention_bf16(const float *q, const void *cache, const int64_t *slots, const int64_t *ranges,
                         const float *sinks, float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t D,
                         float scale);
void pool_attention_f32_latent(const float *q, const void *cache, const int64_t *slots, const int64_t *ranges,
                               float *out, int64_t rows, int64_t heads, int64_t D, int64_t Dv, float scale);
void pool_attention_bf16_latent(const float *q, const void *cache, const int64_t *slots, const int64_t *ranges,
                                float *out, int64_t rows, int64_t heads, int64_t D, int64_t Dv, float scale);

/* ---------------------------------------------------------------- quant_gemm.c */
int quant_isa(void);
void quant_gemm(int isa, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t lde, int64_t ldw, float *y,
                int64_t ldy, const int64_t *groups, int64_t G, int64_t K, int64_t N, int64_t S, const int64_t *cuts,
                int64_t lds);
void quant_gemm_parts(int isa, int64_t P, const int *types, const uint8_t *const *w, const int64_t *ldw,
                      const int64_t *n, const float *const *bias, int64_t S, const int64_t *cuts, const float *x,
                      int64_t ldx, float *y, int64_t ldy, int64_t R, int64_t K);
void quant_dequantize_rows(int isa, int type, const uint8_t *w, int64_t ldw, const int64_t *ids, int64_t n, int64_t K,
                           float *out);

/* ---------------------------------------------------------------- int8_gemm.c */
int int8_supported(void);
int int8_paths(void);
void int8_gemm_parts(int path, int64_t P, const int *types, const uint8_t *const *w, const int64_t *ldw,
                     const int64_t *n, const float *const *bias, int64_t S, const int64_t *cuts, const float *x,
                     int64_t ldx, float *y, int64_t ldy, int64_t R, int64_t K);
void int8_gemm_grouped(int path, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t lde, int64_t ldw,
                       float *y, int64_t ldy, const int64_t *groups, int64_t G, int64_t R, int64_t K, int64_t N,
                       int64_t S, const int64_t *cuts, int64_t lds);

/* ---------------------------------------------------------------- bf16_linear.c */
int bf16_linear_supported(void);
int amx_bf16_supported(void);
int dot_bf16_supported(void);
void amx_linear_bf16(const void *x, int64_t ldx, const void *w, const float *bias, void *y, int64_t ldy, int64_t M,
                     int64_t K, int64_t N);
void dot_linear_bf16(const void *x, int64_t ldx, const void *w, const float *bias, void *y, int64_t ldy, int64_t M,
                     int64_t K, int64_t N);

/* ---------------------------------------------------------------- decoder_layer.c
 * The kernels a layer calls (the variants of the model's dtype), by address: kernels/decoder_layer.py
 * fills it from the libraries above. */
struct kernels {
    __typeof__(quant_gemm_parts) *quant_parts;
    __typeof__(grouped_gemm_f32) *grouped_f32, *grouped_bf16;
    __typeof__(amx_linear_bf16) *amx, *dot; /* amx_linear_bf16, dot_linear_bf16, or NULL */
    __typeof__(rms_norm_f32) *rms_norm;
    __typeof__(add_rms_norm_f32) *add_rms_norm;
    __typeof__(norm_rotate_f32) *norm_rotate;
    __typeof__(silu_mul_f32) *silu_mul;
    __typeof__(pool_attention_f32) *attention;
    __typeof__(round_to_bf16) *round; /* bfloat16 rows only */
    __typeof__(int8_gemm_parts) *int8_parts; /* NULL where int8_gemm.c is not built */
    __typeof__(int8_gemm_grouped) *int8_grouped;
    __typeof__(quant_gemm) *quant_grouped;
    __typeof__(moe_route_f32) *moe_route;
    __typeof__(moe_sum_f32) *moe_sum;
    __typeof__(clamped_swiglu_f32) *clamped_swiglu;
};

/* A projection's kind: a QuantParts (kernels/quant.py), a weight packed by grouped_gemm.py's
 * `pack` (one expert), one packed by bf16_linear.py's `pack_pairs` for a bfloat16 unit, or an
 * Int8Parts (kernels/int8.py: a QuantParts' arguments on the int8 arithmetic). */
enum { QUANT = 0, GROUPED = 1, AMX = 2, DOT = 3, INT8 = 4 };

/* A projection: QUANT and INT8, a QuantParts' arguments (INT8: on int8_gemm.c's `path`);
 * GROUPED, the packed weight and its float32 bias; AMX and DOT likewise. */
struct linear {
    int64_t kind, parts;
    const int *types;
    const uint8_t *const *w;
    const int64_t *ldw, *n;
    const float *const *bias;
    int64_t k_parts;       /* QUANT: K computed in these parts, added in order (0: whole) */
    const int64_t *k_cuts; /* their bounds, k_parts + 1 of them */
    const void *weight;
    const float *weight_bias;
    int64_t in_features, out_features;
    int64_t path;
};

/* One projection of a layer's experts kept quantized (layers/moe.py's QuantizedExperts): blocks of
 * GGUF type `type`, expert e's row n at w + e * lde + n * ldw bytes, `rows` rows an expert. */
struct experts_weight {
    int64_t type;
    const uint8_t *w;
    int64_t lde, ldw, rows;
};

/* A sparse MLP (layers/moe.py's SparseMoeBlock without a shared expert, gpt-oss's GptOssMoe): the
 * router, moe_route_f32's `route` (a mode) to the top_k of `experts`, each expert's SwiGLU of
 * `intermediate` (`activation`: 0 silu_mul, 1 clamped_swiglu at alpha and limit). kind: GROUPED,
 * experts packed by grouped_gemm.py (float32 rows: packed_gate_up [gate | up], packed_down, their
 * packed biases gate_up_bias and down_bias or NULL); QUANT or INT8 (on `path`), quantized: gate_up
 * (each expert's gate rows, then its up rows) or, where gate and up are two weights, gate_up the
 * gate's and up the up's (up.w NULL: one weight), down, whose K runs in down_parts parts (bounds
 * down_cuts, NULL: whole), each part's weighted sum added in part order (distributed/parts.py's
 * tensor-parallel bits); biases [E, 2I] and [E, H] float32 or NULL, added to a row's float32 sums
 * (down's to the first part's). */
struct moe {
    struct linear router;
    struct experts_weight gate_up, up, down;
    const void *packed_gate_up, *packed_down;
    const float *gate_up_bias, *down_bias;
    int64_t kind, path, experts, top_k, route, activation, intermediate, down_parts;
    const int64_t *down_cuts;
    float alpha, limit;
};

/* A layer's fixed arguments, made once. */
struct layer {
    struct linear qkv, o, gate_up, down;
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL without */
    float eps, post_eps, qk_eps, scale;
    float residual; /* Granite's residual multiplier: 1 leaves the outputs as the projections give them */
    int64_t hidden, heads, kv_heads, head_dim, intermediate, sliding;
    int64_t rotary; /* 0: q and k are not turned (SmolLM3's NoPE layers; none has q/k norms) */
    const struct moe *moe; /* NULL: the dense MLP (gate_up, down, intermediate) */
    const float *sinks;    /* [heads] float32: gpt-oss's attention sinks, or NULL */
};

/* A step's arguments, made once a step. */
struct step {
    int64_t isa, tokens, bf16;
    const void *cos, *sin;                 /* [T, D] */
    const int64_t *out_slots;              /* [T] */
    const int64_t *slots;                  /* every group's key slots, one list */
    const int64_t *ranges, *window_ranges; /* [T, 3] into `slots` (pool_attention.c) */
    const int64_t *groups;                 /* [1, 3] = (0, 0, T): the grouped kernel's one group */
    float *x32, *y32;                      /* a bfloat16 layer's rows around the grouped kernel, or scaled by r */
    /* Scratch, [T, *] each: h, q/k/v, the queries and attention's rows in float32, attention's
     * rows in the model dtype (float32: the same buffer), gate/up, SwiGLU's; `delta` takes
     * o_proj's output (the layer's delta argument is added into x before), then the MLP's,
     * which the call leaves there for the next layer. */
    void *h, *qkv;
    float *q, *attn32;
    void *attn, *gate_up, *act, *delta;
    /* A sparse MLP's (NULL without): the router's logits [T, E], each token's top-k weights and
     * experts [T, k], its (token, slot)s ordered by expert (`order` [T * k]) and their rows, scale
     * and outputs in that order (rows, gate/up, SwiGLU's, down's [T * k, *]), each token's rows in
     * ascending expert id (`expert_slots` [T * k]), the active experts' groups [E, 3], counts
     * [max(E + 1, T)]; down's output is [parts, T * k, hidden], a part's weighted sum [T, hidden]. */
    float *logits, *route_weights, *expert_scale, *expert_rows, *expert_gate_up, *expert_act, *expert_down;
    float *part_sum;
    int64_t *expert_ids, *expert_order, *expert_slots, *groups_by_expert, *expert_counts;
};

int decoder_layer_supported(void);
void decoder_layer(const struct kernels *k, const struct layer *l, const struct step *s, void *x, const void *delta,
                   int64_t ldd, void *cache);
void decoder_layers(const struct kernels *k, const struct layer *const *layers, int64_t n, const struct step *s,
                    void *x, void *const *caches);

/* ---------------------------------------------------------------- helpers */

/* bfloat16 x [n] widened into float32 y: exact, its bits shifted. */
static inline void widen_bf16_row(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(y + i, &bits, sizeof bits);
    }
}

/* A projection's work items (quant_gemm_parts, int8_gemm_parts): part p of P (n[p] columns) has
 * `blocks` row blocks times its tiles of `width` columns, its items starting at start[p] and its
 * columns at col[p]; start[P] counts every item. */
static inline void part_items(int64_t P, const int64_t *n, int64_t blocks, int64_t width, int64_t *start,
                              int64_t *col) {
    start[0] = col[0] = 0;
    for (int64_t p = 0; p < P; p++) {
        start[p + 1] = start[p] + blocks * ((n[p] + width - 1) / width);
        col[p + 1] = col[p] + n[p];
    }
}

/* Of the G spans of work items starting at start[0] = 0 <= start[1] ..., the last starting at or
 * before item it (a part or group of no items is passed over). */
static inline int64_t owner(const int64_t *start, int64_t G, int64_t it) {
    int64_t g = 0, hi = G - 1;
    while (g < hi) {
        const int64_t mid = (g + hi + 1) / 2;
        if (start[mid] <= it) g = mid;
        else hi = mid - 1;
    }
    return g;
}

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) static inline
#define AVX512_INLINE __attribute__((target("avx512f,avx2,fma"), always_inline)) static inline

/* The ISA grouped_gemm.c and pool_attention.c need. */
static inline int has_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* Eight lanes of float32 read as floats: float32 as stored, bfloat16 widened (exact). */
AVX2_INLINE __m256 widen_bf16(__m256i lanes) { return _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16)); }

AVX2_INLINE __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

AVX2_INLINE __m256 load8_bf16(const uint16_t *p) {
    return widen_bf16(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Eight floats rounded to bfloat16 as torch rounds (nearest-even, a NaN kept quiet), in the low
 * 16 bits of each lane. */
AVX2_INLINE __m256i round_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
    const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}

/* round_bf16's eight lanes stored as eight bfloat16. */
AVX2_INLINE void pack_bf16(uint16_t *y, __m256i rounded) {
    const __m256i packed = _mm256_packus_epi32(rounded, _mm256_setzero_si256());
    _mm_storeu_si128((__m128i *)y, _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

/* The sum of eight lanes in a fixed tree: (l0 + l4, l1 + l5, ...), then pairs, then the two. */
AVX2_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The same on sixteen lanes (AVX-512): each lane the operations of its 8-lane twin. */
AVX512_INLINE __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

AVX512_INLINE __m512 widen16_bf16(__m512i lanes) { return _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16)); }

AVX512_INLINE __m512 load16_bf16(const uint16_t *p) {
    return widen16_bf16(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)));
}

AVX512_INLINE __m512i round16_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded,
                                   _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

AVX512_INLINE void pack16_bf16(uint16_t *y, __m512i rounded) {
    _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(rounded));
}

#endif
#endif
