/* llama.cpp's logits at every position of token sequences, for bench_int8_accuracy.py (what
 * llama-cpp-python's logits_all gives, without its build): built against a llama.cpp tree and its
 * libllama.
 *
 *   llama_cpp_logits MODEL.gguf THREADS < sequences > logits
 *
 * stdin: one sequence a line, token ids separated by spaces; stdout: per sequence, its length
 * times the vocabulary's size float32 logits (row i: the next-token logits after token i), in
 * order. Each sequence in a fresh context, one batch, every position's logits kept. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL THREADS < sequences > logits\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const int32_t vocab = llama_vocab_n_tokens(llama_model_get_vocab(model)), threads = atoi(argv[2]);
    static char line[1 << 20];
    while (fgets(line, sizeof line, stdin)) {
        int32_t n = 0, cap = 256, *ids = malloc(cap * sizeof(int32_t));
        for (char *tok = strtok(line, " \n"); tok; tok = strtok(NULL, " \n")) {
            if (n == cap) ids = realloc(ids, (cap *= 2) * sizeof(int32_t));
            ids[n++] = atoi(tok);
        }
        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n < 64 ? 64 : n;
        cp.n_threads = cp.n_threads_batch = threads;
        struct llama_context *ctx = llama_init_from_model(model, cp);
        struct llama_batch batch = llama_batch_init(n, 0, 1);
        for (int32_t i = 0; i < n; i++) {
            batch.token[i] = ids[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = n;
        if (!ctx || llama_decode(ctx, batch)) return 1;
        for (int32_t i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), vocab, stdout);
        llama_batch_free(batch);
        llama_free(ctx);
        free(ids);
    }
    fflush(stdout);
    llama_model_free(model);
    return 0;
}
