"""The architectures freetoken serves, and loading one: the interface of models/ to the rest.

`ARCHITECTURES` is the one table: a config.json's architecture names its family's module and
class, imported by name when a model of that family loads (a server imports one family).
A new family is a module of models/ with a `CausalLM` subclass (models/causal_lm.py) and a
row here.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.config import native_context
from freetoken.models.loader import build, default_model_path, eos_ids, gguf_to_folder
from freetoken.paths import ModelNotFound


@dataclass(frozen=True)
class Family:
    module: str  # under freetoken.models
    cls: str
    tensor_parallel: str | None = None  # why tensor parallelism is refused; None: supported


_HYBRID = Family("qwen3_5", "Qwen3_5ForCausalLM", tensor_parallel=(
    "tensor parallelism splits the attention-only decoders, not the hybrid (linear-attention) models"))
ARCHITECTURES = {
    "LlamaForCausalLM": Family("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Family("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": Family("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": Family("qwen3_moe", "Qwen2MoeForCausalLM"),
    "GptOssForCausalLM": Family("gpt_oss", "GptOssForCausalLM"),
    "ScriptedForCausalLM": Family("scripted", "ScriptedForCausalLM", tensor_parallel=(
        "the scripted test model does not support tensor parallelism")),
    "Qwen3_5ForCausalLM": _HYBRID,
    "Qwen3_5ForConditionalGeneration": _HYBRID,
    "Qwen3_5MoeForCausalLM": _HYBRID,
    "Qwen3_5MoeForConditionalGeneration": _HYBRID,
    "Qwen3NextForCausalLM": _HYBRID,
}


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


def architecture(hf_config: dict) -> str:
    return (hf_config.get("architectures") or ["?"])[0]


def model_class(arch: str) -> type:
    """The module class of an architecture of ARCHITECTURES, its family imported now."""
    if arch not in ARCHITECTURES:
        raise ModelNotFound(f"Architecture {arch} is not supported ({', '.join(ARCHITECTURES)})")
    family = ARCHITECTURES[arch]
    return getattr(importlib.import_module(f"freetoken.models.{family.module}"), family.cls)


def model_folder(model: str | os.PathLike | None) -> tuple[Path, str]:
    """(HF folder, model name) of a folder, a GGUF file (converted once into the cache) or, for
    None, the default model."""
    path = default_model_path() if model is None else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_folder(path, served=tuple(ARCHITECTURES)), path.stem
    if not path.is_dir():
        raise ModelNotFound(f"Model not found: {path} (pass an HF model folder or a GGUF file)")
    return path, path.name


def load_model(model: str | os.PathLike | None = None, dtype: str = "auto", device: str = "auto",
               group=None) -> LoadedModel:
    """The model ready to run; with `group` (engine.parallel.Group) only that tensor-parallel
    rank's slices of it, read from the checkpoint as such (models/layers/tensor_parallel.py)."""
    from transformers import AutoTokenizer  # heavy: imported by the processes that load a model

    folder, name = model_folder(model)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{folder} has no config.json: not an HF model folder")
    hf_config = json.loads(config_file.read_text())
    arch = architecture(hf_config)
    cls = model_class(arch)
    if group is not None and ARCHITECTURES[arch].tensor_parallel:
        raise ModelNotFound(f"{arch}: {ARCHITECTURES[arch].tensor_parallel}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dev = resolve_device(device)
    weights_dtype = resolve_dtype(dtype, dev)
    # One CPU process computes as tensor-parallel ranks would, so that their results agree.
    in_parts = group is None and dev.type == "cpu" and ARCHITECTURES[arch].tensor_parallel is None
    module = build(cls, folder, hf_config, tokenizer, weights_dtype, dev, group, in_parts)
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


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # float32 on CPU keeps greedy results exact and batch-invariant.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolve_device(device: str) -> torch.device:
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
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by spawned processes too
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
