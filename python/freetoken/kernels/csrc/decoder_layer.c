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
 *           or, a sparse layer's (struct moe), r * the weighted sum of its routed experts' SwiGLUs
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
    if (l->kind == QUANT || l->kind == INT8) {
        (l->kind == QUANT ? k->quant_parts : k->int8_parts)((int)(l->kind == QUANT ? s->isa : l->path), l->parts,
                                                            l->types, l->w, l->ldw, l->n, l->bias, l->k_parts,
                                                            l->k_cuts, x, in, y, out, s->tokens, in);
    } else if (l->kind == GROUPED && s->bf16) {
        widen_bf16_row(x, s->x32, s->tokens * in);
        k->grouped_bf16(s->x32, in, l->weight, l->weight_bias, s->y32, out, s->groups, 1, in, out);
        k->round(s->y32, y, s->tokens * out);
    } else if (l->kind == GROUPED) {
        k->grouped_f32(x, in, l->weight, l->weight_bias, y, out, s->groups, 1, in, out);
    } else
        (l->kind == AMX ? k->amx : k->dot)(x, in, l->weight, l->weight_bias, y, out, s->tokens, in, out);
}

/* One projection of a sparse MLP's experts: x [R, K] grouped by expert (the step's G groups) into
 * y [R, N] (rows ldy apart), on the experts' kernel, plus `bias` (NULL: none; struct moe's, N a
 * row); quantized, K in S parts at cuts (NULL: whole), each part's sums apart, lds floats on, the
 * bias in the first. */
static void experts(const struct kernels *k, const struct moe *m, const struct step *s, const struct experts_weight *w,
                    const void *packed, const float *bias, const float *x, int64_t K, int64_t N, float *y, int64_t ldy,
                    int64_t G, int64_t R, int64_t S, const int64_t *cuts, int64_t lds) {
    if (m->kind == INT8)
        k->int8_grouped((int)m->path, (int)w->type, x, K, w->w, w->lde, w->ldw, y, ldy, s->groups_by_expert, G, R, K,
                        w->rows, S, cuts, lds);
    else if (m->kind == QUANT)
        k->quant_grouped((int)s->isa, (int)w->type, x, K, w->w, w->lde, w->ldw, y, ldy, s->groups_by_expert, G, K,
                         w->rows, S, cuts, lds);
    else
        k->grouped_f32(x, K, packed, bias, y, ldy, s->groups_by_expert, G, K, N);
    if (m->kind != GROUPED && bias) /* each row's expert's bias, added to its float32 sums */
        for (int64_t g = 0; g < G; g++) {
            const int64_t *group = s->groups_by_expert + 3 * g;
            const float *b = bias + group[0] * N;
            for (int64_t r = group[1]; r < group[1] + group[2]; r++)
                for (int64_t n = 0; n < N; n++) y[r * ldy + n] += b[n];
        }
}

/* The sparse MLP of h into delta, as layers/moe.py's SparseMoeBlock.forward runs it (its kernels,
 * its order): the route; the (token, slot)s ordered by expert, ascending id, a token's slots in
 * order within one (a stable sort), their rows copied so; each projection one grouped call over
 * the active experts; SwiGLU; each token's weighted outputs summed in ascending expert id. */
static void sparse_mlp(const struct kernels *k, const struct layer *l, const struct step *s) {
    const struct moe *m = l->moe;
    const int64_t T = s->tokens, top = m->top_k, E = m->experts, H = l->hidden, I = m->intermediate, R = T * top;
    const float *h = s->h;
    linear(k, &m->router, s, h, s->logits);
    k->moe_route(s->logits, E, T, E, top, m->route, s->route_weights, s->expert_ids);
    int64_t *next = s->expert_counts, G = 0;
    memset(next, 0, (E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < R; i++) next[s->expert_ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) {
        if (next[e + 1]) {
            int64_t *g = s->groups_by_expert + 3 * G++;
            g[0] = e, g[1] = next[e], g[2] = next[e + 1];
        }
        next[e + 1] += next[e]; /* now where expert e + 1's rows start */
    }
    for (int64_t i = 0; i < R; i++) {
        const int64_t j = next[s->expert_ids[i]]++;
        s->expert_order[j] = i, s->expert_scale[j] = s->route_weights[i];
        memcpy(s->expert_rows + j * H, h + i / top * H, H * sizeof(float));
    }
    int64_t *filled = s->expert_counts; /* each token's slots so far (the counts are spent) */
    memset(filled, 0, T * sizeof(int64_t));
    for (int64_t j = 0; j < R; j++) {
        const int64_t t = s->expert_order[j] / top;
        s->expert_slots[t * top + filled[t]++] = j;
    }
    if (m->up.w) { /* gate and up apart: each with its half of the bias, as the Python block splits it */
        experts(k, m, s, &m->gate_up, 0, 0, s->expert_rows, H, I, s->expert_gate_up, 2 * I, G, R, 1, 0, 0);
        experts(k, m, s, &m->up, 0, 0, s->expert_rows, H, I, s->expert_gate_up + I, 2 * I, G, R, 1, 0, 0);
        if (m->gate_up_bias)
            for (int64_t g = 0; g < G; g++) {
                const int64_t *group = s->groups_by_expert + 3 * g;
                const float *b = m->gate_up_bias + group[0] * 2 * I;
                for (int64_t r = group[1]; r < group[1] + group[2]; r++)
                    for (int64_t n = 0; n < 2 * I; n++) s->expert_gate_up[r * 2 * I + n] += b[n];
            }
    } else
        experts(k, m, s, &m->gate_up, m->packed_gate_up, m->gate_up_bias, s->expert_rows, H, 2 * I, s->expert_gate_up,
                2 * I, G, R, 1, 0, 0);
    if (m->activation)
        k->clamped_swiglu(s->expert_gate_up, 2 * I, s->expert_act, R, I, m->alpha, m->limit);
    else
        k->silu_mul(s->expert_gate_up, 2 * I, s->expert_act, R, I);
    experts(k, m, s, &m->down, m->packed_down, m->down_bias, s->expert_act, I, H, s->expert_down, H, G, R,
            m->down_parts, m->down_cuts, R * H);
    float *delta = s->delta;
    for (int64_t part = 0; part < m->down_parts; part++) {
        float *sum = part ? s->part_sum : delta;
        k->moe_sum(s->expert_down + part * R * H, H, s->expert_scale, s->expert_slots, T, top, H, sum);
        if (part)
            for (int64_t i = 0; i < T * H; i++) delta[i] += sum[i];
    }
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
    k->attention(s->q, cache, s->slots, l->sliding ? s->window_ranges : s->ranges, l->sinks, s->attn32, T, H, KV, D,
                 l->scale);
    if (s->bf16)
        k->round(s->attn32, s->attn, T * H * D);
    linear(k, &l->o, s, s->attn, s->delta);
    if (l->residual != 1.0f)
        scale(k, s, s->delta, T * hidden, l->residual);
    k->add_rms_norm(x, hidden, s->delta, hidden, l->post_norm, s->h, T, hidden, l->post_eps);
    if (l->moe)
        sparse_mlp(k, l, s);
    else {
        linear(k, &l->gate_up, s, s->h, s->gate_up);
        k->silu_mul(s->gate_up, 2 * l->intermediate, s->act, T, l->intermediate);
        linear(k, &l->down, s, s->act, s->delta);
    }
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
