"""Build a family's module from a model's files (models/files.py finds them, models/registry.py
says which family).

A GGUF file of a Llama-family decoder, a Qwen MoE, gpt-oss, Gemma 3, Granite, GLM-4.5,
DeepSeek-V2/V3, Phi-3/4 or SmolLM3 is read as it is stored (models/gguf_file.py): its config and
tokenizer, which transformers parses (the last five's configs our code builds,
models/gguf_families.py), are cached as a folder without weights, and its tensors are read from
the memory-mapped file, the block formats kept quantized where asked (layers/quantized.py, the
experts layers/moe.py); a tensor-parallel rank keeps its slices of them, cut along whole blocks. Other GGUFs (the hybrids)
are converted once by transformers into a float32 HF folder (safetensors + config + tokenizer)
in a cache keyed by the file's identity: parsing and dequantising takes transformers about 13 s.
A folder's weights are read tensor by tensor (models/checkpoint.py) into the module built on
the meta device; a tensor-parallel rank reads only the slices it keeps. transformers and gguf
are imported by the GGUF functions alone: seconds of import that a folder's load does not need.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from freetoken.kernels.plan import log_plan, plan_model
from freetoken.kvcache.kv_pool import pool_bytes
from freetoken.models.checkpoint import read_weights
from freetoken.layers.kernel_choice import cpu_name
from freetoken.layers.linear import only_kernel, pack_linears
from freetoken.layers.mla import stack_heads
from freetoken.layers.moe import stack_experts, take_stacked_experts
from freetoken.distributed.parts import compute_in_parts, free_in_parts
from freetoken.layers.skeleton import on_meta
from freetoken.kernels.int8 import arithmetic as quantized_arithmetic
from freetoken.layers.quantized import QuantizedEmbedding, plan_quantized, take_quantized, weight_bytes
from freetoken.distributed.quantized_parallel import (install_quantized, quantized_head, shard_state,
                                                      widen_cut_experts)
from freetoken.distributed.tensor_parallel import shard_model
from freetoken.models.files import GGUF_LINK, gguf_cache_folder, gguf_source
from freetoken.paths import ModelNotFound, available_memory

log = logging.getLogger(__name__)

# GGUF metadata transformers' GGUF loader (5.24) does not map into the config, by its model
# type: without them a Qwen MoE's experts get transformers' default width, which fails to load
# unless it happens to match (Qwen3-30B-A3B's 768 does, Qwen3-Coder-480B-A35B's 2560 does not).
# Added to transformers' own table, which its loader reads while parsing the file once.
# gpt-oss: transformers' table names its sliding window `sliding_window` (llama.cpp writes
# `attention.sliding_window`) and leaves out the head width (64 released, not hidden / heads);
# phi3: it leaves out the window, which transformers' Phi-3 honours (weights_folder's conversion of a
# phi3 file, which freetoken itself reads: gguf_families.py).
GGUF_CONFIG_EXTRAS = {
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "gpt_oss": {"attention.sliding_window": "sliding_window", "attention.key_length": "head_dim"},
    "phi3": {"attention.sliding_window": "sliding_window"},  # Phi-3-mini-4k's 2047
}


def _map_gguf_extras() -> None:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    for model_type, keys in GGUF_CONFIG_EXTRAS.items():
        for key, name in keys.items():
            GGUF_CONFIG_MAPPING[model_type].setdefault(key, name)


def gguf_to_folder(gguf: Path, served: tuple[str, ...]) -> Path:
    """Convert a GGUF file once into an HF folder; later loads read the folder (about 1 s).
    `served`: the architectures freetoken serves, named when the conversion fails."""
    from freetoken.models.gguf_file import fill_dropped_fields, gguf_parts, open_gguf

    folder = gguf_cache_folder(gguf)
    if (folder / "model.safetensors").is_file():
        return folder
    if len(gguf_parts(gguf)) > 1:
        raise ModelNotFound(f"{gguf.name}: a split GGUF of {_gguf_architecture(gguf)}, an architecture "
                            "read through transformers' conversion, which reads one file: merge the parts "
                            "(llama.cpp's `llama-gguf-split --merge`) or pass the model's HF folder")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _map_gguf_extras()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                        dtype=torch.float32, output_loading_info=True)
    # An architecture transformers does not know (ValueError), knows only in part (KeyError), or
    # reads into a config its tensors do not fit (RuntimeError).
    except (ValueError, KeyError, RuntimeError) as exc:
        raise _unconvertible(gguf, served, exc) from exc
    # transformers leaves weights it found no tensor for randomly initialised, with a log line.
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ModelNotFound(
            f"{gguf.name}: transformers' GGUF loader found no tensor for {len(missing)} weights of "
            f"{type(hf).__name__} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "pass the model's HF folder")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(tmp)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf).__name__]
    fill_dropped_fields(open_gguf(gguf), config)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, tmp / "model.safetensors")
    try:
        tmp.replace(folder)  # atomic: a half-written cache folder is never picked up
    except OSError:  # another process (a test worker) finished the same conversion first
        if not (folder / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def gguf_config_folder(gguf: Path, served: tuple[str, ...]) -> Path:
    """`gguf`'s config folder (files.cached_config_folder) written: the file's metadata parsed
    (our reader, or transformers'); refused naming `served` where no family reads it."""
    from freetoken.models.gguf_file import config_folder

    _map_gguf_extras()
    try:
        return config_folder(gguf, gguf_cache_folder(gguf, "config"), GGUF_LINK)
    except ModelNotFound:  # a bad file, named by our reader
        raise
    except (ValueError, KeyError, RuntimeError) as exc:
        raise _unconvertible(gguf, served, exc) from exc


def weights_folder(folder: Path) -> Path:
    """An HF folder with `folder`'s weights as transformers reads them: the folder, or for a
    GGUF's config folder the file's float32 conversion (a reference to compare against)."""
    gguf = gguf_source(folder)
    return folder if gguf is None else gguf_to_folder(gguf, ())


def _unconvertible(gguf: Path, served: tuple[str, ...], exc: Exception) -> ModelNotFound:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = _gguf_architecture(gguf)
    return ModelNotFound(
        f"{gguf.name}: transformers' GGUF loader could not convert this GGUF architecture "
        f"{arch!r} ({exc!r}). It lists "
        f"{', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))}; "
        f"freetoken serves {', '.join(served)}, as HF folders where no GGUF "
        "conversion works")


def _gguf_architecture(gguf: Path) -> str:
    from freetoken.models.gguf_file import architecture, open_gguf

    return architecture(open_gguf(gguf))


def build(model_class: type, folder: Path, hf_config: dict, tokenizer, dtype: torch.dtype,
          device: torch.device, group=None, in_parts: bool | None = False,
          linear_kernel: str | None = None) -> torch.nn.Module:
    """`model_class` (a models/causal_lm.py CausalLM) with the folder's weights, its linear
    layers packed (on `linear_kernel` alone where given); with `group`, that tensor-parallel
    rank's slices only; `in_parts`: its sliced layers computed as tensor-parallel ranks compute
    them (distributed/parts.py)."""
    with on_meta():
        module = model_class.from_hf(hf_config)
    part = shard_model(module, group) if group is not None else None
    state = module.convert_hf_weights(read_weights(folder, part, module.reads))
    return _assign(module, state, {}, tokenizer, dtype, device, in_parts, linear_kernel)


def build_gguf(model_class: type, gguf: Path, hf_config: dict, tokenizer, dtype: torch.dtype,
               device: torch.device, quantized: bool, kv_slots: int = 0,
               in_parts: bool | None = False, group=None, linear_kernel: str | None = None,
               huge_pages: bool | None = None, arithmetic: str = "exact") -> torch.nn.Module:
    """`model_class` (models/llama.py's or models/qwen3_moe.py's) with `gguf`'s weights, read
    from the memory-mapped file: with `quantized` (on the CPU) the block formats kept as stored,
    else dequantized at load; refused before any weight is read where the weights and a KV pool
    of `kv_slots` (and what the load copies for a moment) would not fit in the memory available.
    With `group`, that tensor-parallel rank's slices, quantized ones cut along whole blocks
    (distributed/tensor_parallel.py). `huge_pages`: False keeps the blocks on the file's map
    (None: copied into huge pages where the kernel gives them, models/huge_pages.py).
    `arithmetic`: how the kept blocks multiply (config.QUANTIZED_ARITHMETIC)."""
    from freetoken.models.gguf_file import (ROPE_FREQS, experts_block, open_gguf, planned_bytes, read_tensors,
                                            working_bytes)
    from freetoken.models.huge_pages import place_in_huge_pages
    from freetoken.layers.rotary import LongRope
    from freetoken.models.llama import FUSED

    with on_meta():
        module = model_class.from_hf(hf_config)
    reader = open_gguf(gguf)
    cfg = module.cfg
    module.experts_block = experts_block(reader, quantized)
    part = shard_model(module, group) if group is not None else None
    kv = pool_bytes(cfg, cfg.num_layers, kv_slots, dtype)
    check_memory(gguf.name, sum(planned_bytes(reader, dtype, quantized).values()), kv,
                 working_bytes(reader, dtype, quantized))
    state = read_tensors(gguf, reader, cfg, quantized)
    if hasattr(cfg, "rope_interleaved"):  # read_tensors put DeepSeek's rope rows in halves
        module.cfg = replace(cfg, rope_interleaved=False)
    if (divisors := state.pop(ROPE_FREQS, None)) is not None:
        # Llama 3.1's schedule as llama.cpp computes it, which transformers' parse of the config
        # drops: each frequency divided by its factor, as longrope's are.
        module.cfg = replace(module.cfg, rope_scaling=LongRope(tuple(divisors.tolist()), 1.0))
    if part is not None:
        state = _rank_state(gguf.name, state, part)
    elif in_parts:
        _log_widened(gguf.name, "in the parts of K tensor-parallel ranks hold",
                     widen_cut_experts(state, module.experts_block))
    state = place_in_huge_pages(state, reader.maps, huge_pages)
    with quantized_arithmetic(arithmetic):  # the quantized layers and experts are made in here
        take_stacked_experts(module, state)
        layers = take_quantized(state, FUSED)
        state = module.convert_hf_weights(state)
        return _assign(module, state, layers, tokenizer, dtype, device, in_parts, linear_kernel)


def _assign(module: torch.nn.Module, state: dict[str, torch.Tensor], quantized: dict,
            tokenizer, dtype: torch.dtype, device: torch.device, in_parts: bool | None,
            linear_kernel: str | None) -> torch.nn.Module:
    """`state` assigned to `module`'s parameters, the `quantized` layers (our module name ->
    weight parts) put in place, the head tied, the linear layers packed (`in_parts`: the sliced
    ones computed as tensor-parallel ranks compute them, distributed/parts.py; None: where
    that costs about nothing, parts.free_in_parts), every op's kernel planned."""
    tied = module.ties_head(state)
    if tied:
        state.pop("lm_head.weight", None)
    # Each tensor becomes its parameter (assign): no second copy of the model is allocated, and
    # one cast at a time, in place of its source, keeps a bfloat16 load from holding float32.
    for name, value in state.items():
        held = torch.float32 if name.endswith(module.float32_weights) else dtype
        state[name] = value.to(device=device, dtype=held).contiguous()
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    # The caller's dict too: each weight is then held by its parameter alone (freed once packed).
    state.clear()
    held = {f"{name}.weight" for name in quantized}
    missing = [m for m in missing if not (tied and m == "lm_head.weight") and m not in held]
    if missing or unexpected:
        raise ModelNotFound(f"Weights do not match the architecture: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    install_quantized(module, quantized, dtype)
    if tied:
        embedding = module.model.embed_tokens
        if isinstance(embedding, QuantizedEmbedding):
            module.lm_head = quantized_head(embedding, module.lm_head)
        else:
            module.lm_head.weight = embedding.weight
    module.post_load(tokenizer, dtype, device)
    module.requires_grad_(False)
    module.weight_bytes = weight_bytes(module)  # before packing frees the plain weights
    stack_experts(module)
    stack_heads(module)
    with only_kernel(linear_kernel):
        if in_parts or (in_parts is None and free_in_parts(module)):
            compute_in_parts(module)
        plan = pack_linears(module)
    if quantized:
        plan = plan_quantized(module, plan, dtype)
    # Every other op's kernel, chosen once here and kept by its module (kernels/plan.py).
    module.kernel_plan = plan_model(module, plan, dtype, device)
    log_plan(module.kernel_plan, cpu_name())
    return module


def _rank_state(name: str, state: dict, part) -> dict:
    widened: list[str] = []
    state = shard_state(state, part, widened)
    _log_widened(name, f"on rank {part.rank}", widened)
    return state


def _log_widened(name: str, where: str, widened: list[str]) -> None:
    if widened:
        log.info("%s: dequantized at load %s, its part of K not whole blocks: %d tensors (%s%s)",
                 name, where, len(widened), ", ".join(widened[:3]), ", ..." if len(widened) > 3 else "")


def check_memory(name: str, weights: int, kv: int, working: int = 0) -> None:
    """Refuse a model whose weights and KV pool (and `working`, what its load holds beyond its
    weights for a moment) exceed the memory available, each named."""
    available = available_memory()
    if available is not None and weights + kv + working > available:
        loading = f" + {working / 2**30:.2f} GiB while loading" if working else ""
        raise ModelNotFound(f"{name}: needs {weights / 2**30:.2f} GiB of weights + {kv / 2**30:.2f} "
                            f"GiB of KV pool{loading}, but {available / 2**30:.2f} GiB of memory is "
                            "available (fewer --kv-cache-tokens, or a smaller quantization)")


def eos_ids(folder: Path, hf_config: dict, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = folder / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.is_file() else {}, hf_config):
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
