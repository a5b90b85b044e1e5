/* A decoder layer of the llama family (models/llama.py's DecoderLayer) in one call, for a step's
 * float32 rows on quantized linear layers:
 *
 *   x += delta; h = input_norm(x)            (first layer: no delta)
 *   qkv = h @ Wqkv^T (+ bias); q, k = rotate(q_norm(q), k_norm(k)) in place (norms: Qwen3)
 *   cache[out_slots[t]] = (k, v) of row t, for every row
 *   attn = attention of each row over its keys (the step's merged key ranges)
 *   x += attn @ Wo^T; h = post_norm(x)
 *   delta = silu_mul(h @ Wgate_up^T) @ Wdown^T
 *
 * This file holds no kernel of its own: it runs the ones models/kernels/quant_gemm.c,
 * grouped_gemm.c and pool_attention.c export, through pointers models/kernels/decoder_layer.py
 * hands over (`struct kernels`), in the order and on the buffers the Python layer gives them, so
 * each output has the bits the Python layer gives it. What it saves is the Python and torch
 * dispatch between the calls: about a dozen per layer and step.
 *
 * A layer's fixed arguments (`struct layer`: weights, norms, shapes) are made once per layer, a
 * step's (`struct step`: row count, cos and sin, slots and key ranges, scratch) once per step.
 */
#include <stdint.h>
#include <string.h>

typedef void (*quant_parts_fn)(int isa, int64_t P, const int *types, const void *const *w, const int64_t *ldw,
                               const int64_t *n, const float *const *bias, const float *x, int64_t ldx,
                               float *y, int64_t ldy, int64_t R, int64_t K);
typedef void (*rms_norm_fn)(const float *x, int64_t ldx, const float *w, float *y, int64_t M, int64_t D,
                            float eps);
typedef void (*add_rms_norm_fn)(float *x, int64_t ldx, const float *d, int64_t ldd, const float *w, float *y,
                                int64_t M, int64_t D, float eps);
typedef void (*norm_rotate_fn)(float *x, int64_t ldt, int64_t ldh, int64_t tokens, int64_t heads,
                               int64_t split, const float *wq, const float *wk, float eps, const float *cos,
                               const float *sin, int64_t D);
typedef void (*silu_mul_fn)(const float *x, int64_t ldx, float *y, int64_t M, int64_t half);
typedef void (*attention_fn)(const float *q, const float *cache, const int64_t *slots, const int64_t *ranges,
                             const float *sinks, float *out, int64_t rows, int64_t heads, int64_t kv_heads,
                             int64_t D, float scale);

struct kernels {
    quant_parts_fn quant_parts; /* quant_gemm_parts */
    rms_norm_fn rms_norm;       /* rms_norm_f32 */
    add_rms_norm_fn add_rms_norm;
    norm_rotate_fn norm_rotate;
    silu_mul_fn silu_mul;
    attention_fn attention; /* pool_attention_f32 */
};

/* A QuantParts projection's arguments (models/kernels/quant.py). */
struct linear {
    int64_t parts;
    const int *types;
    const void *const *w;
    const int64_t *ldw, *n;
    const float *const *bias;
    int64_t in, out;
};

struct layer {
    struct linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL without */
    float eps, post_eps, qk_eps, scale;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, sliding;
};

struct step {
    int64_t isa, tokens;
    const float *cos, *sin;                /* [T, D] */
    const int64_t *out_slots;              /* [T] */
    const int64_t *slots;                  /* every group's key slots, one list */
    const int64_t *ranges, *window_ranges; /* [T, 3] into `slots` (pool_attention.c) */
    /* Scratch, [T, *] each: h, q/k/v, the queries alone, attention's output, gate/up, SwiGLU's;
     * `delta` takes o_proj's output (the layer's delta argument is added into x before), then
     * the MLP's, which the call leaves there for the next layer. */
    float *h, *qkv, *q, *attn, *gate_up, *act, *delta;
};

int decoder_layer_supported(void) { return 1; } /* the kernels it calls were checked where they load */

static void linear(const struct kernels *k, const struct linear *l, int64_t isa, const float *x, float *y,
                   int64_t rows) {
    k->quant_parts((int)isa, l->parts, l->types, l->w, l->ldw, l->n, l->bias, x, l->in, y, l->out, rows, l->in);
}

/* x [T, hidden] (the residual stream, updated in place); delta [T, hidden] (rows ldd apart) or
 * NULL; cache: the layer's [slots, 2 * kv_heads, head_dim]. */
void decoder_layer_f32(const struct kernels *k, const struct layer *l, const struct step *s, float *x,
                       const float *delta, int64_t ldd, float *cache) {
    const int64_t T = s->tokens, H = l->heads, KV = l->kv_heads, D = l->head_dim, hidden = l->hidden;
    const int64_t width = (H + 2 * KV) * D;
    if (delta)
        k->add_rms_norm(x, hidden, delta, ldd, l->input_norm, s->h, T, hidden, l->eps);
    else
        k->rms_norm(x, hidden, l->input_norm, s->h, T, hidden, l->eps);
    linear(k, &l->qkv, s->isa, s->h, s->qkv, T);
    k->norm_rotate(s->qkv, width, D, T, H + KV, H, l->q_norm, l->k_norm, l->qk_eps, s->cos, s->sin, D);
    /* Every row's keys and values are stored before any row attends: a prompt row reads the
     * keys of the rows before it in the same step. */
    for (int64_t t = 0; t < T; t++) {
        memcpy(cache + s->out_slots[t] * 2 * KV * D, s->qkv + t * width + H * D, sizeof(float) * 2 * KV * D);
        memcpy(s->q + t * H * D, s->qkv + t * width, sizeof(float) * H * D);
    }
    k->attention(s->q, cache, s->slots, l->sliding ? s->window_ranges : s->ranges, 0, s->attn, T, H, KV, D,
                 l->scale);
    linear(k, &l->o, s->isa, s->attn, s->delta, T);
    k->add_rms_norm(x, hidden, s->delta, hidden, l->post_norm, s->h, T, hidden, l->post_eps);
    linear(k, &l->gate_up, s->isa, s->h, s->gate_up, T);
    k->silu_mul(s->gate_up, 2 * l->intermediate, s->act, T, l->intermediate);
    linear(k, &l->down, s->isa, s->act, s->delta, T);
}
