/* A decoder layer of the llama family (models/llama.py's DecoderLayer) in one call, over a step's
 * rows in float32 or bfloat16 (the model's dtype: rows, norms and KV pool alike):
 *
 *   x += delta; h = input_norm(x)            (first layer: no delta)
 *   qkv = h @ Wqkv^T (+ bias); q, k = rotate(q_norm(q), k_norm(k)) in place (norms: Qwen3;
 *                                  a layer without rotary embedding: neither)
 *   cache[out_slots[t]] = (k, v) of row t, for every row
 *   attn = attention of each row over its keys (the step's merged key ranges)
 *   x += r * (attn @ Wo^T); h = post_norm(x)     (r: Granite's residual multiplier, else 1)
 *   delta = r * (silu_mul(h @ Wgate_up^T) @ Wdown^T)
 *
 * This file holds no kernel of its own: it runs the ones kernels/quant_gemm.c,
 * grouped_gemm.c and pool_attention.c export, through pointers kernels/decoder_layer.py
 * hands over (`struct kernels`, the variants of the model's dtype), in the order and on the
 * values the Python layer gives them, so each output has the bits the Python layer gives it. What
 * it saves is the Python and torch dispatch between the calls: about a dozen per layer and step;
 * decoder_layers runs a step's layers in one call (the Python loop over them cost ~10 us a layer,
 * 6% of a batch-1 step of the default GGUF).
 *
 * The linear layers run on the quantized kernel (float32 rows), the grouped kernel (weights of the
 * rows' dtype) or a bfloat16 unit's (bf16_linear.c: AMX or AVX512-BF16), as layers/linear.py's
 * probe placed them. The
 * grouped kernel and attention (pool_attention.c) read and write float32 rows: bfloat16 rows are
 * widened for them and their output rounded back, as the Python layer's casts do.
 *
 * A layer's fixed arguments (`struct layer`: weights, norms, shapes) are made once per layer, a
 * step's (`struct step`: row count, cos and sin, slots and key ranges, scratch) once per step;
 * both, `struct kernels` and `struct linear` are declared in kernels.h. Data pointers are void:
 * the same struct serves both dtypes.
 */
#include "kernels.h"

int decoder_layer_supported(void) { return 1; } /* the kernels it calls were checked where they load */

/* y [n] of the model's dtype times r, as torch multiplies by a Python float: in float32 (a
 * bfloat16 row widened into the step's x32 and rounded back). */
static void scale(const struct kernels *k, const struct step *s, void *y, int64_t n, float r) {
    if (s->bf16) {
        widen_bf16_row(y, s->x32, n);
        for (int64_t i = 0; i < n; i++)
            s->x32[i] *= r;
        k->round(s->x32, y, n);
    } else
        for (int64_t i = 0; i < n; i++)
            ((float *)y)[i] *= r;
}

static void linear(const struct kernels *k, const struct linear *l, const struct step *s, const void *x, void *y) {
    const int64_t in = l->in_features, out = l->out_features;
    if (l->kind == QUANT) {
        k->quant_parts((int)s->isa, l->parts, l->types, l->w, l->ldw, l->n, l->bias, l->k_parts, l->k_cuts, x, in, y,
                       out, s->tokens, in);
    } else if (l->kind == GROUPED && s->bf16) {
        widen_bf16_row(x, s->x32, s->tokens * in);
        k->grouped_bf16(s->x32, in, l->weight, l->weight_bias, s->y32, out, s->groups, 1, in, out);
        k->round(s->y32, y, s->tokens * out);
    } else if (l->kind == GROUPED) {
        k->grouped_f32(x, in, l->weight, l->weight_bias, y, out, s->groups, 1, in, out);
    } else
        (l->kind == AMX ? k->amx : k->dot)(x, in, l->weight, l->weight_bias, y, out, s->tokens, in, out);
}

/* x [T, hidden] (the residual stream, updated in place); delta [T, hidden] (rows ldd apart) or
 * NULL; cache: the layer's [slots, 2 * kv_heads, head_dim]. */
void decoder_layer(const struct kernels *k, const struct layer *l, const struct step *s, void *x,
                   const void *delta, int64_t ldd, void *cache) {
    const int64_t T = s->tokens, H = l->heads, KV = l->kv_heads, D = l->head_dim, hidden = l->hidden;
    const int64_t width = (H + 2 * KV) * D, size = s->bf16 ? 2 : 4;
    char *const qkv = s->qkv;
    if (delta)
        k->add_rms_norm(x, hidden, delta, ldd, l->input_norm, s->h, T, hidden, l->eps);
    else
        k->rms_norm(x, hidden, l->input_norm, s->h, T, hidden, l->eps);
    linear(k, &l->qkv, s, s->h, s->qkv);
    if (l->rotary)
        k->norm_rotate(s->qkv, width, D, T, H + KV, H, l->q_norm, l->k_norm, l->qk_eps, s->cos, s->sin, D);
    /* Every row's keys and values are stored before any row attends: a prompt row reads the
     * keys of the rows before it in the same step. A prompt's rows split over the threads: one
     * thread alone left the other spinning (with the bfloat16 rounding below, 2-3 % of a
     * bfloat16 scoring step's samples). */
#pragma omp parallel for if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const char *row = qkv + t * width * size;
        memcpy((char *)cache + s->out_slots[t] * 2 * KV * D * size, row + H * D * size, 2 * KV * D * size);
        if (s->bf16)
            widen_bf16_row((const uint16_t *)row, s->q + t * H * D, H * D);
        else
            memcpy(s->q + t * H * D, row, sizeof(float) * H * D);
    }
    k->attention(s->q, cache, s->slots, l->sliding ? s->window_ranges : s->ranges, 0, s->attn32, T, H, KV, D,
                 l->scale);
    if (s->bf16)
        k->round(s->attn32, s->attn, T * H * D);
    linear(k, &l->o, s, s->attn, s->delta);
    if (l->residual != 1.0f)
        scale(k, s, s->delta, T * hidden, l->residual);
    k->add_rms_norm(x, hidden, s->delta, hidden, l->post_norm, s->h, T, hidden, l->post_eps);
    linear(k, &l->gate_up, s, s->h, s->gate_up);
    k->silu_mul(s->gate_up, 2 * l->intermediate, s->act, T, l->intermediate);
    linear(k, &l->down, s, s->act, s->delta);
    if (l->residual != 1.0f)
        scale(k, s, s->delta, T * hidden, l->residual);
}

/* A step through layers[0..n) (each on its cache, caches[i]), one after the other: the call above,
 * each layer's delta the MLP output the one before it left in the step's buffer. */
void decoder_layers(const struct kernels *k, const struct layer *const *layers, int64_t n, const struct step *s,
                    void *x, void *const *caches) {
    for (int64_t i = 0; i < n; i++)
        decoder_layer(k, layers[i], s, x, i ? s->delta : 0, layers[i]->hidden, caches[i]);
}
