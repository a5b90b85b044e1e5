"""bench_engine.py's families table: decode at batch 1 and 8 of each family the registry serves,
ours against HF transformers, float32, on random models of one shape (hidden 512, heads 8 / KV 4
of 64, MLP 1536; 8 layers, 4 with --quick) with each family's quirks on (windows shorter than
the decode, Granite's multipliers, SmolLM3's unrotated layers, Gemma's (1 + w) norms and GeGLU,
GLM-4.5's and DeepSeek's routers), the default model's vocabulary. Built once under the cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import _bench_common as bc

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
           first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
# name -> (architecture, transformers config class, the family's fields on top of SHAPE)
FAMILIES = {
    "llama-3.1": ("LlamaForCausalLM", "LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=32)),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(no_rope_layer_interval=4)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0156, logits_scaling=8.0)),
    "phi-3": ("Phi3ForCausalLM", "Phi3Config", dict(sliding_window=32)),
    "gemma-3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        sliding_window=32, query_pre_attn_scalar=64, tie_word_embeddings=True)),
    "glm-4.5": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(MOE, partial_rotary_factor=0.5, use_qk_norm=True)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        MOE, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        head_dim=32, num_key_value_heads=8)),  # transformers' DeepSeek: head_dim the rope part, K/V per head
}


def family_folder(name: str, layers: int) -> Path:
    import transformers

    from freetoken.paths import cache_root

    arch, config_class, fields = FAMILIES[name]
    folder = cache_root() / "bench-models" / f"family-{name}-{layers}-v1"
    if (folder / "config.json").is_file():
        return folder
    tokenizer = bc.load_tokenizer()
    torch.manual_seed(0)
    special = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("pad", tokenizer.pad_token or tokenizer.eos_token), ("bos", tokenizer.bos_token or tokenizer.eos_token),
        ("eos", tokenizer.eos_token))}  # the families' defaults name ids of their own vocabularies
    config = getattr(transformers, config_class)(vocab_size=len(tokenizer), num_hidden_layers=layers,
                                                 **{**SHAPE, **special, **fields})
    tmp = folder.with_name(folder.name + ".tmp")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return folder


def families_table(ours_class, hf_class, args, batches=(1, 8)) -> None:
    """One row per family and batch: decode tokens/s, ours and HF's, and their ratio."""
    from freetoken.models.registry import ARCHITECTURES

    new_tokens = args.new_tokens or (16 if args.quick else 32)
    layers = 4 if args.quick else 8
    rows = []
    for name, (arch, _, _) in FAMILIES.items():
        if arch not in ARCHITECTURES:
            bc.note(f"{name}: {arch} not served by this build")
            continue
        try:
            rows += family_rows(name, family_folder(name, layers), ours_class, hf_class, args, batches,
                                new_tokens)
        except Exception as exc:  # one family's failure leaves the others' rows
            bc.note(f"{name}: failed: {type(exc).__name__}: {exc}")
    bc.print_table(f"Families, {layers} layers of hidden 512, float32: decode {new_tokens} tokens "
                   f"after {args.decode_prompt_len}-token prompts (tokens/s; ratio = ours / HF)",
                   ["family", "batch", "decode ours", "decode HF", "ratio"], rows)


def family_rows(name: str, folder: Path, ours_class, hf_class, args, batches, new_tokens: int) -> list:
    """The family's rows: our decode and HF's at each batch (one model in memory at a time)."""
    ours = ours_class("float32", args.kv_slots, folder)
    prompts = bc.token_prompts(ours.loaded.tokenizer, max(batches), args.decode_prompt_len, seed=2)
    ours.decode(prompts[:2], 4)  # warm-up: the first steps choose kernels
    hf = None if args.skip_hf else hf_class("float32", folder)
    rows = []
    for b in batches:
        dec = prompts[:b]
        tokens = b * (new_tokens - 1)
        t_ours = min(ours.decode(dec, new_tokens)[0] for _ in range(args.repeats))
        hf_rate = None
        if hf:
            t_first = bc.best_time(lambda: hf.generate(dec, 1), args.repeats)
            t_all = bc.best_time(lambda: hf.generate(dec, new_tokens), args.repeats)
            hf_rate = tokens / max(t_all - t_first, 1e-9)
        rows.append([name, b, tokens / t_ours, hf_rate, bc.ratio(tokens / t_ours, hf_rate)])
    return rows
