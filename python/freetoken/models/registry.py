"""The architectures freetoken serves, and loading one: the interface of models/ to the rest.

`ARCHITECTURES` is the one table: a config.json's architecture names its family's module and
class, imported by name when a model of that family loads (a server imports one family).
A new family is a module of models/ with a `CausalLM` subclass (models/causal_lm.py) and a
row here.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken import envs
from freetoken.config import WeightsConfig, native_context, rope_parameters, rope_type, text_config
from freetoken.hub import HubOptions, hub_name, resolve_model
from freetoken.models.files import cached_config_folder, default_model_path, gguf_source
from freetoken.paths import ModelNotFound
from freetoken.tokenizer.load import load_tokenizer

if TYPE_CHECKING:  # imported where a model loads: the server's process finds one without torch
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    module: str  # under freetoken.models
    cls: str
    tensor_parallel: str | None = None  # why tensor parallelism is refused; None: supported
    implements: frozenset[str] = frozenset()  # the QUIRKS its layers compute as transformers does
    rope_types: tuple[str, ...] = ("default", "yarn", "llama3")  # the rotary schedules it computes
    test_only: bool = False  # loadable, but not named among the architectures freetoken serves


# The attention of Qwen's, Mistral's, SmolLM3's and gpt-oss's releases honours `sliding_window`;
# transformers' Llama ignores it.
_WINDOWED = frozenset({"sliding_window"})
# The sigmoid routers' scale and expert groups (layers/sigmoid_moe.py): GLM-4.5's, DeepSeek's.
_ROUTED_GROUPS = frozenset({"routed_scaling_factor", "n_group"})
# Gemma 3: its text-only checkpoints, and the language model of the image-text ones.
_GEMMA3 = Family("gemma3", "Gemma3ForCausalLM", implements=_WINDOWED | {"query_pre_attn_scalar"},
                 rope_types=("default", "linear"))
_HYBRID = Family("qwen3_5", "Qwen3_5ForCausalLM", tensor_parallel=(
    "tensor parallelism splits the attention-only decoders, not the hybrid (linear-attention) models"),
    implements=frozenset({"layer_types", "partial_rotary_factor"}), rope_types=("default",))
# DeepSeek's multi-head latent attention, V3's router and V2's (models/deepseek.py).
_MLA_TP = ("tensor parallelism is not implemented for multi-head latent attention (every rank would hold "
           "each token's latent, shared by all heads)")
ARCHITECTURES = {
    "LlamaForCausalLM": Family("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": Family("llama", "LlamaForCausalLM", implements=_WINDOWED),
    "SmolLM3ForCausalLM": Family("llama", "LlamaForCausalLM", implements=_WINDOWED | {"no_rope_layers"}),
    "GraniteForCausalLM": Family("llama", "LlamaForCausalLM", implements=frozenset({
        "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"})),
    # Phi-3's checkpoint holds q/k/v and gate/up fused as our layers do: its names are ours.
    # transformers' Phi-3 reads a `yarn` schedule as longrope: only its own two are computed.
    "Phi3ForCausalLM": Family("llama", "LlamaForCausalLM", implements=_WINDOWED | {"partial_rotary_factor"},
                              rope_types=("default", "longrope")),
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3,
    "Qwen2ForCausalLM": Family("llama", "LlamaForCausalLM", implements=_WINDOWED),
    "Qwen3ForCausalLM": Family("llama", "LlamaForCausalLM", implements=_WINDOWED),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "Qwen3MoeForCausalLM", implements=_WINDOWED),
    "Qwen2MoeForCausalLM": Family("qwen3_moe", "Qwen2MoeForCausalLM", implements=_WINDOWED),
    "GptOssForCausalLM": Family("gpt_oss", "GptOssForCausalLM", implements=_WINDOWED),
    "DeepseekV3ForCausalLM": Family("deepseek", "DeepseekV3ForCausalLM", tensor_parallel=_MLA_TP,
                                    rope_types=("default", "yarn"), implements=_ROUTED_GROUPS),
    "DeepseekV2ForCausalLM": Family("deepseek", "DeepseekV2ForCausalLM", tensor_parallel=_MLA_TP,
                                    rope_types=("default", "yarn"), implements=_ROUTED_GROUPS),
    "Glm4MoeForCausalLM": Family("glm4_moe", "Glm4MoeForCausalLM",
                                 implements=_ROUTED_GROUPS | {"partial_rotary_factor"}),
    "ScriptedForCausalLM": Family("scripted", "ScriptedForCausalLM", tensor_parallel=(
        "the scripted test model does not support tensor parallelism"), test_only=True),
    "Qwen3_5ForCausalLM": _HYBRID,
    "Qwen3_5ForConditionalGeneration": _HYBRID,
    "Qwen3_5MoeForCausalLM": _HYBRID,
    "Qwen3_5MoeForConditionalGeneration": _HYBRID,
    "Qwen3NextForCausalLM": _HYBRID,
}
# What `freetoken serve` names as served.
SERVED = tuple(arch for arch, family in ARCHITECTURES.items() if not family.test_only)


def _other_than(default):
    return lambda cfg, field: None if cfg.get(field) in (None, default) else cfg[field]


def _window(cfg: dict, field: str) -> int | None:
    # A window as long as the context never binds.
    window = cfg.get(field)
    return window if window and cfg.get("use_sliding_window", True) and window < native_context(cfg) else None


def _partial_rotary(cfg: dict, field: str) -> float | None:
    factor = rope_parameters(cfg).get(field, cfg.get(field))  # where the hybrids read it first
    return None if factor in (None, 1) else factor


# Config fields that change what a model computes, each with the value a config relies on (given
# the language model's config and the field's name; None: the field is not in effect). A family
# computes those its row `implements`; a config of another that sets one is refused by name,
# even where transformers' class of the architecture ignores it too: the checkpoint was trained
# with it, or relabelled from a family that reads it, and served without it gives other tokens
# than the model it names.
QUIRKS = {
    "sliding_window": _window,  # models/llama.py slides the layers transformers' Qwen rule marks
    "layer_types": lambda cfg, field: sorted(set(cfg.get(field) or ()) - {"full_attention", "sliding_attention"})
    or None,
    "no_rope_layers": lambda cfg, field: None if all(cfg.get(field) or ()) else cfg[field],  # SmolLM3's 0s
    "partial_rotary_factor": _partial_rotary,
    "hidden_act": lambda cfg, field: None if cfg.get(field, "silu") in ("silu", "swish") else cfg[field],  # SwiGLU
    # Gemma's name for it: its MLP's GeGLU, transformers' gelu_pytorch_tanh.
    "hidden_activation": lambda cfg, field: None if cfg.get(field) in (None, "gelu_pytorch_tanh") else cfg[field],
    "mlp_bias": lambda cfg, field: cfg.get(field) or None,
    # Granite's scales (attention_multiplier replaces 1 / sqrt(head_dim)), Gemma's (its scores'
    # scale in place of 1 / sqrt(head_dim)), Gemma 2's soft caps (Gemma 3 has none).
    "embedding_multiplier": _other_than(1),
    "residual_multiplier": _other_than(1),
    "logits_scaling": _other_than(1),
    "attention_multiplier": _other_than(None),
    "query_pre_attn_scalar": _other_than(None),
    "attn_logit_softcapping": _other_than(None),
    "final_logit_softcapping": _other_than(None),
    # EmbeddingGemma's: every token sees its window both ways.
    "use_bidirectional_attention": lambda cfg, field: cfg.get(field) or None,
    # DeepSeek's own code makes every moe_layer_freq-th layer sparse, transformers every one (all
    # releases: 1).
    "moe_layer_freq": _other_than(1),
    # GLM-4.5's and DeepSeek's routers (layers/sigmoid_moe.py): their weights' scale, their
    # expert groups.
    "routed_scaling_factor": _other_than(1),
    "n_group": _other_than(1),
}
# The architectures whose GGUF weights are read from the file (models/gguf_file.py), by one
# process or by each tensor-parallel rank (its slices), kept quantized on the CPU where asked;
# the others are converted by transformers first.
GGUF_READ = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
             "Qwen2MoeForCausalLM", "GptOssForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM",
             "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Phi3ForCausalLM",
             "SmolLM3ForCausalLM")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    # HF folder the config and tokenizer came from (for a GGUF, a cache folder: its config folder,
    # or its float32 conversion; loader.weights_folder finds weights transformers can read)
    folder: Path
    name: str
    hf_config: dict
    eos_token_ids: list[int]
    max_model_len: int  # the model's own context
    device: torch.device
    dtype: torch.dtype  # of the weights and the KV pool

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size


def architecture(hf_config: dict) -> str:
    return (hf_config.get("architectures") or ["?"])[0]


def check_supported(hf_config: dict) -> None:
    """Refuse (ModelNotFound, one line) a config freetoken would not compute as transformers does:
    an architecture of no row of ARCHITECTURES, a rotary schedule its family lacks, or a field of
    QUIRKS in effect that it does not implement. Light (no family is imported): `freetoken serve`
    calls it before it starts the engine, load_model before it converts or loads anything."""
    arch = architecture(hf_config)
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise ModelNotFound(f"architecture {arch} is not supported; freetoken serves {', '.join(SERVED)}")
    cfg = text_config(hf_config)
    for layers in ("full_attention", "sliding_attention"):  # the same unless nested by layer type
        schedule = rope_type(rope_parameters(cfg, layers))
        if schedule not in family.rope_types:
            raise ModelNotFound(f"{arch} with rope_type {schedule!r} is not supported (its family computes "
                                f"{', '.join(family.rope_types)})")
    unsupported = [f"{field}={value!r}" for field, relied_on in QUIRKS.items()
                   if field not in family.implements and (value := relied_on(cfg, field)) is not None]
    if unsupported:
        raise ModelNotFound(f"{arch} with {', '.join(unsupported)} is not supported: freetoken's {arch} "
                            "does not implement it and would compute another model")


def model_class(arch: str) -> type:
    """The module class of an architecture of ARCHITECTURES (check_supported), its family
    imported now."""
    family = ARCHITECTURES[arch]
    return getattr(importlib.import_module(f"freetoken.models.{family.module}"), family.cls)


def find_model(model: str | os.PathLike | None, hub: HubOptions = HubOptions(), dtype: str = "auto",
               device: str = "auto") -> tuple[Path, str]:
    """(HF folder, served name) of a local path, a Hub name (its files found in the cache or
    downloaded, hub.py; served under the name as typed) or None (the default model);
    `dtype` and `device` as the model will load, for the memory check before a download (torch
    imported for it alone: the server's process finds a local model without it)."""
    itemsize = None
    if hub_name(model) is not None:
        dev = resolve_device(device)
        itemsize = resolve_dtype(dtype, dev).itemsize if dev.type == "cpu" else None
    local, typed = resolve_model(model, hub, itemsize)
    folder, name = model_folder(local)
    return folder, typed or name


def model_folder(model: str | os.PathLike | None) -> tuple[Path, str]:
    """(HF folder, model name) of a folder, a GGUF file (its config and tokenizer cached in a
    folder once, which links to the file) or, for None, the default model."""
    path = default_model_path() if model is None else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        folder = cached_config_folder(path)
        if folder is None:  # a first load: transformers or our reader parses the file
            from freetoken.models.loader import gguf_config_folder

            folder = gguf_config_folder(path, served=SERVED)
        return folder, path.stem
    if not path.is_dir():
        raise ModelNotFound(f"Model not found: {path} (pass an HF model folder, a GGUF file or a Hub "
                            "name, ORG/NAME or ORG/NAME:TAG)")
    gguf = gguf_source(path)
    return path, path.name if gguf is None else gguf.stem


def load_model(model: str | os.PathLike | None = None, dtype: str = "auto", device: str = "auto",
               group=None, kv_slots: int = 0, weights: WeightsConfig = WeightsConfig()) -> LoadedModel:
    """The model ready to run; with `group` (distributed.group.Group) only that tensor-parallel
    rank's slices of it, read from the checkpoint as such (distributed/tensor_parallel.py).
    `kv_slots`: the KV pool to be allocated, counted in a GGUF's memory check; `weights`: how
    the weights are held and multiplied (config.WeightsConfig; unset fields from envs.py)."""
    import torch

    from freetoken.layers.linear import head_for_columns
    from freetoken.models.loader import build, build_gguf, eos_ids, gguf_to_folder

    folder, name = model_folder(model)
    dev = resolve_device(device)
    hf_config = read_config(folder)
    check_supported(hf_config)
    gguf = gguf_source(folder)
    if gguf is not None and not _reads_gguf(architecture(hf_config)):
        folder = gguf_to_folder(gguf, served=SERVED)
        hf_config, gguf = read_config(folder), None
    arch = architecture(hf_config)
    cls = model_class(arch)
    if group is not None and ARCHITECTURES[arch].tensor_parallel:
        raise ModelNotFound(f"{arch}: {ARCHITECTURES[arch].tensor_parallel}")
    tokenizer = load_tokenizer(folder)
    weights_dtype = resolve_dtype(dtype, dev)
    weights = weights.resolved()
    # One CPU process computes its sliced layers as two tensor-parallel ranks would, so that its
    # results are theirs bit for bit: always, never, or (None) where that costs about nothing
    # (parts.free_in_parts: a GGUF's quantized layers; docs/engine/tensor-parallel.md).
    splittable = group is None and dev.type == "cpu" and ARCHITECTURES[arch].tensor_parallel is None
    in_parts = weights.exact_tp if splittable else False
    with head_for_columns(weights.head_for_columns):
        if gguf is None:
            module = build(cls, folder, hf_config, tokenizer, weights_dtype, dev, group, in_parts,
                           weights.linear_kernel)
        else:
            stored = weights.gguf_weights or ("quantized" if weights_dtype == torch.float32 else "float32")
            module = build_gguf(cls, gguf, hf_config, tokenizer, weights_dtype, dev,
                                stored == "quantized" and dev.type == "cpu", kv_slots, in_parts, group,
                                weights.linear_kernel, weights.huge_pages, weights.quantized_arithmetic)
    # The mode asked for, as /v1/stats reports it (and the frontend's system_fingerprint):
    # linear_kernels says which layers run it (none where nothing is kept quantized).
    module.quantized_arithmetic = weights.quantized_arithmetic
    return LoadedModel(
        model=module.eval(),
        tokenizer=tokenizer,
        folder=folder,
        name=name,
        hf_config=hf_config,
        eos_token_ids=eos_ids(folder, hf_config, tokenizer),
        max_model_len=native_context(hf_config),
        device=dev,
        dtype=weights_dtype,
    )


def read_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{folder} has no config.json: not an HF model folder")
    return json.loads(config_file.read_text())


def _reads_gguf(arch: str) -> bool:
    """Are a GGUF's weights of `arch` read from the file? If not (transformers converts them to
    a float32 folder), why, in the log."""
    if arch not in GGUF_READ:
        log.info("GGUF of %s: dequantized to float32 by transformers (its architecture is read "
                 "through transformers' conversion)", arch)
        return False
    return True


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        # float32 on CPU keeps greedy results exact and batch-invariant.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def progress_bars_wanted() -> bool:
    """Progress bars only on a terminal: in a log file or a pipe they are noise."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def quiet_progress_bars() -> None:
    """Turn off transformers' and huggingface_hub's tqdm bars when stderr is not a terminal."""
    if progress_bars_wanted():
        return
    envs.quiet_hub_progress_bars()
    try:  # both heavy, and optional to this function: imported by the processes that load
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass
