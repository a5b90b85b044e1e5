"""A GGUF file read as it is stored: its config and tokenizer (parsed by transformers, cached as
a folder without weights) and its tensors under our HF names, from the memory-mapped file.
A split file (llama.cpp's gguf-split: `NAME-00001-of-0000N.gguf`, the metadata in the first
part, the tensors spread over all) is read as one, named by its first part.

Asked for quantized weights, tensors in a block format kernels/quant.py runs on this CPU
stay as the file stores them (a QuantizedWeight whose data is a view on the map: no copy; pages
are read as the matmuls touch them); else they are dequantized at load. F32/F16/BF16 tensors come out as tensors; other block formats are dequantized at load,
with one log line. llama.cpp's converter permutes a llama's q/k rows (rotary pairs
interleaved); the permutation is over whole output rows, so it is undone by gathering rows,
quantized or not (a copy of those two tensors only). The Llama-family decoders (models/llama.py),
the Qwen MoE ones (models/qwen3_moe.py: a sparse layer's experts stacked [E, out, in], kept
quantized by layers/moe.py's take_stacked_experts) and gpt-oss (models/gpt_oss.py: its experts
so too, MXFP4, with biases), and Granite, GLM-4.5, DeepSeek-V2/V3, Phi-3/4 and SmolLM3, whose
configs our code builds (models/gguf_families.py; where their tensors go: gguf_layouts.py),
are read here; the others go through transformers' conversion (loader.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import struct
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from freetoken.kernels.quant import FORMATS, QuantizedWeight, dequantize, supported
from freetoken.models import gguf_families as families
from freetoken.models import gguf_layouts as layouts
from freetoken.paths import ModelNotFound

log = logging.getLogger(__name__)

DEQUANTIZE_ROWS = 4096  # rows of a tensor dequantized at load at a time
FLOATS = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
          GGMLQuantizationType.BF16: torch.bfloat16}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         # A sparse layer (models/qwen3_moe.py): the router, the experts stacked [E, out, in] (as
         # named here, before layers/moe.py's take_stacked_experts), a Qwen2-MoE's shared expert.
         "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
         "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
         "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
         "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# gpt-oss (models/gpt_oss.py): its router, its second norm, its sinks (a parameter of the
# attention, [heads]); its experts' biases are ffn_{gate,up,down}_exps.bias ([E, I], [E, H]).
GPT_OSS_LAYER = {**LAYER, "ffn_gate_inp": "mlp.router", "post_attention_norm": "post_attention_layernorm",
                 "attn_sinks": "self_attn"}
# Gemma 3 (models/gemma3.py): four norms a layer. llama.cpp's converter adds 1 to each of its
# norms (transformers scales by 1 + weight), which read_tensors takes off again.
GEMMA3_LAYER = {**LAYER, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
LAYERS = {"gpt-oss": GPT_OSS_LAYER, "gemma3": GEMMA3_LAYER, "glm4moe": {**LAYER, **layouts.GLM4MOE_LAYER},
          "deepseek2": {**LAYER, **layouts.DEEPSEEK2_LAYER}, "phi3": {**LAYER, **layouts.PHI3_LAYER}}
# Leaves named otherwise: gpt-oss's sinks (a parameter of the attention), a sigmoid router's
# correction bias (`exp_probs_b.bias`).
LEAVES = {"attn_sinks": "sinks", "exp_probs_b": "e_score_correction_bias"}
# llama.cpp's converter permutes the q/k rows of these architectures (LlamaModel.permute).
PERMUTED = ("llama", "granite", "smollm3")
# A tokenizer's end-of-generation tokens beyond the one a GGUF names, by model type (the HF
# release's generation config names them): a gpt-oss reply ends in <|return|>, or <|call|>
# before a tool runs; a GLM-4.5 turn in <|user|>, or <|observation|> before a tool runs; a
# Phi-3 or Phi-4-mini turn in <|end|>.
STOP_TOKENS = {"gpt_oss": ("<|return|>", "<|call|>"), "glm4_moe": ("<|user|>", "<|observation|>"),
               "phi3": ("<|end|>",)}


def config_folder(gguf: Path, cache: Path, link: str) -> Path:
    """`cache`: config.json, the tokenizer's files and a link `link` to `gguf` (no weights),
    written (files.cached_config_folder finds it later); transformers parses the file's
    metadata (its tensors are not read), once our reader has found every tensor's type and
    extent sound (a bad file names its tensor)."""
    reader = open_gguf(gguf)
    arch = architecture(reader)
    # transformers' parse gives such a file the default schedule: served so, it is another model.
    scaled = sorted(t.name for t in reader.tensors if t.name in families.LONGROPE)
    if scaled and arch not in families.CONFIGS:
        raise ModelNotFound(f"{gguf.name}: its rotary frequencies are scaled ({', '.join(scaled)}: "
                            f"longrope) in a {arch} file, whose config transformers' GGUF parse builds without "
                            "them; load the model's HF folder")
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if arch in families.CONFIGS:  # the tokenizer alone from transformers, whose config lacks them
        config = families.config_from_metadata(reader, arch, gguf.name)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        with _hidden(YARN_PREFIX):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
        config.pop("quantization_config", None)
        # transformers ties the head where its parse saw no `output.weight`: in the first part's
        # tensors alone, for a split file.
        config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"], "?")]
        fill_dropped_fields(reader, config)
    vocab = tokenizer.get_vocab()
    stops = [vocab[t] for t in STOP_TOKENS.get(config["model_type"], ()) if t in vocab]
    if stops:
        named = config.get("eos_token_id")
        config["eos_token_id"] = sorted({*stops, *(named if isinstance(named, list) else [named])} - {None})
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    # The path as given, not its target: a Hub cache's file links to a blob named by its hash,
    # and a split file's parts are found beside the first by name.
    (tmp / link).symlink_to(os.path.abspath(gguf))
    try:
        tmp.replace(cache)  # atomic: a half-written folder is never picked up
    except OSError:  # another process finished first
        if not (cache / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


# llama.cpp writes a scaled rotary schedule as tensors of a factor per frequency: longrope's two
# sets (gguf_families.LONGROPE, read into a phi3's config), and Llama 3.1-3.3's llama3 as the
# divisor of each (ROPE_FREQS, read into the model).
ROPE_FREQS = "rope_freqs.weight"


# transformers (5.24) reads a gpt-oss file's `rope.scaling.*` fields as their key's length (a
# TypeError): they are hidden from its parse, and read here into the config's YaRN parameters.
YARN_PREFIX = "gpt-oss.rope.scaling."
YARN_KEYS = {"factor": "factor", "original_context_length": "original_max_position_embeddings"}


def fill_dropped_fields(reader: GGUFModel, config: dict) -> None:
    """What llama.cpp reads from the file (or assumes) that transformers' parse of it leaves out
    of `config`, put in: gpt-oss's YaRN parameters; Gemma 3's linear scaling of its global
    layers' frequencies, its window (none where the file has none), its sliding layers' rotary
    base (10000 unless the file says), its attention scale (llama.cpp's rule: 1 / sqrt(hidden /
    heads) at 62 layers, the 27B, else 1 / sqrt(head width); transformers' default is 256
    whatever the model) and a final soft cap (refused: registry.QUIRKS)."""
    if config["model_type"] == "gpt_oss":
        yarn = {name: _value(reader, YARN_PREFIX + key) for key, name in YARN_KEYS.items()}
        config["rope_parameters"] |= {name: value for name, value in yarn.items() if value is not None}
    elif config["model_type"] == "gemma3_text":
        rope = config["rope_parameters"]
        scaling = _string(reader, "gemma3.rope.scaling.type")
        if scaling not in (None, "none"):
            rope["full_attention"] |= {"rope_type": scaling, "factor": _value(reader, "gemma3.rope.scaling.factor")}
        rope["sliding_attention"]["rope_theta"] = _value(reader, "gemma3.rope.freq_base_swa") or 10000.0
        heads = config["num_attention_heads"]
        config |= {"sliding_window": _value(reader, "gemma3.attention.sliding_window"),
                   "final_logit_softcapping": _value(reader, "gemma3.final_logit_softcapping"),
                   "query_pre_attn_scalar": (config["hidden_size"] // heads if config["num_hidden_layers"] == 62
                                             else config["head_dim"])}


@contextmanager
def _hidden(prefix: str):
    """transformers' GGUF parse (which opens the gguf package's GGUFReader) without the fields
    whose key starts with `prefix`."""
    import gguf

    original = gguf.GGUFReader

    class Reader(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith(prefix)]:
                del self.fields[key]

    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _value(reader: GGUFModel, key: str) -> int | float | None:
    """A scalar metadata field's value (None where the file has no such field)."""
    field = reader.fields.get(key)
    return None if field is None else field.parts[field.data[0]].tolist()[0]


def _string(reader: GGUFModel, key: str) -> str | None:
    """A string metadata field's value (None where the file has no such field)."""
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def hf_name(gguf_name: str, arch: str = "") -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for a name that has
    no place in a decoder of the GGUF architecture `arch`."""
    parts = gguf_name.split(".")
    layer = LAYERS.get(arch, LAYER)
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer:
        leaf = LEAVES.get(parts[2], parts[3])
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{leaf}"
    if len(parts) == 2 and parts[0] in TOP:
        return f"{TOP[parts[0]]}.{parts[1]}"
    return None


def expected_shapes(cfg, arch: str = "", tensors: frozenset[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """Each HF tensor of a models/llama.py ModelConfig `cfg` (models/qwen3_moe.py's, or for GGUF
    architecture `arch` "gpt-oss" models/gpt_oss.py's; gguf_layouts.SHAPES' of a file of GGUF
    names `tensors`), by name: its shape; a sparse layer's experts stacked as a GGUF stores them."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter)}
    if arch in layouts.SHAPES:
        return shapes | layouts.SHAPES[arch](cfg, tensors)
    if cfg.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if cfg.o_proj_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if cfg.qk_norm:
        layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    if arch == "gemma3":
        layer |= {"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}
    sparse = dict(layer)
    sparse_layers = getattr(cfg, "sparse_layers", frozenset())
    if sparse_layers:
        e, moe, shared = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        sparse = {k: v for k, v in layer.items() if not k.startswith("mlp.")}
        sparse |= {"mlp.gate.weight": (e, h), "mlp.experts.gate_proj.weight": (e, moe, h),
                   "mlp.experts.up_proj.weight": (e, moe, h), "mlp.experts.down_proj.weight": (e, h, moe)}
        if shared:
            sparse |= {"mlp.shared_expert.gate_proj.weight": (shared, h),
                       "mlp.shared_expert.up_proj.weight": (shared, h),
                       "mlp.shared_expert.down_proj.weight": (h, shared), "mlp.shared_expert_gate.weight": (1, h)}
    if arch == "gpt-oss":  # every layer sparse, experts of intermediate_size with biases
        e = cfg.num_experts
        sparse = {k: v for k, v in layer.items() if not k.startswith("mlp.")}
        sparse |= {"self_attn.sinks": (cfg.num_heads,), "mlp.router.weight": (e, h), "mlp.router.bias": (e,)}
        for proj, shape in (("gate", (e, inter, h)), ("up", (e, inter, h)), ("down", (e, h, inter))):
            sparse |= {f"mlp.experts.{proj}_proj.weight": shape, f"mlp.experts.{proj}_proj.bias": shape[:2]}
        sparse_layers = range(cfg.num_layers)
    for i in range(cfg.num_layers):
        names = sparse if i in sparse_layers else layer
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in names.items()}
    return shapes


class _CheckedReader(GGUFReader):
    """GGUFReader, each tensor's type and extent checked first, so that a bad file names the
    tensor (the reader's own errors do not); metadata arrays are stepped over, not read (the
    reader parses each of a vocabulary's strings as a numpy view: 20 s for 150k of them)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        view = memoryview(self.data)
        item, count = struct.unpack_from("<IQ", view, orig_offs)
        offs = orig_offs + 12
        if item == GGUFValueType.STRING:
            for _ in range(count):
                offs += 8 + struct.unpack_from("<Q", view, offs)[0]
        elif item in self.gguf_scalar_to_np:
            offs += count * np.dtype(self.gguf_scalar_to_np[GGUFValueType(item)]).itemsize
        else:  # nested arrays
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, [], [], [GGUFValueType.ARRAY, GGUFValueType(item)]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode(errors="replace")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise ModelNotFound(f"tensor {name} has an unknown tensor type {int(raw_type[0])}") from None
            block, size = GGML_QUANT_SIZES[qtype]
            end = start_offs + int(offset[0]) + math.prod(dims.tolist()) // block * size
            if end > len(self.data):
                raise ModelNotFound(f"the file ends inside tensor {name} (truncated: {len(self.data)} "
                                    f"bytes, the tensor ends at {end})")
        super()._build_tensors(start_offs, fields)


SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass
class GGUFModel:
    """A model's GGUF as one reader: `fields`, the metadata (a split file's first part's);
    `tensors`, every part's in order; `maps`, each part's memory map."""

    fields: dict
    tensors: list
    maps: list[np.memmap]


def gguf_parts(path: Path) -> list[Path]:
    """The files of the model `path` names: itself, or every part of the split file whose first
    part it is (a ModelNotFound for a later part, or a part missing)."""
    match = SPLIT_PART.search(path.name)
    if match is None or match[2] == "00001":
        return [path]
    if match[1] != "00001":
        raise ModelNotFound(f"{path.name} is part {int(match[1])} of a split GGUF: pass its first part, "
                            f"{path.name[:match.start()]}-00001-of-{match[2]}.gguf")
    parts = [path.with_name(f"{path.name[:match.start()]}-{i:05d}-of-{match[2]}.gguf")
             for i in range(1, int(match[2]) + 1)]
    if missing := [p.name for p in parts if not p.is_file()]:
        raise ModelNotFound(f"{path.name}: the split GGUF's {', '.join(missing)} not found beside it")
    return parts


def open_gguf(path: Path) -> GGUFModel:
    readers = [_open_part(part) for part in gguf_parts(path)]
    model = GGUFModel(readers[0].fields, [t for r in readers for t in r.tensors], [r.data for r in readers])
    count, tensors = _value(model, "split.count"), _value(model, "split.tensors.count")
    if (count or 1) != len(readers) or tensors not in (None, len(model.tensors)):
        raise ModelNotFound(f"{path.name}: its split.count {count} and split.tensors.count {tensors} do "
                            f"not match its {len(readers)} parts of {len(model.tensors)} tensors")
    return model


def _open_part(path: Path) -> GGUFReader:
    try:
        return _CheckedReader(path)
    except ModelNotFound as exc:
        raise ModelNotFound(f"{path.name}: {exc}") from None
    except (ValueError, KeyError, OSError) as exc:
        raise ModelNotFound(f"{path.name}: not a readable GGUF file ({exc})") from None


def architecture(reader: GGUFModel) -> str:
    """The file's `general.architecture` ("llama", "qwen3moe", "gpt-oss", ...)."""
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field else "?"


def kept_as_stored(qtype: GGMLQuantizationType, quantized: bool) -> bool:
    """Is a tensor of `qtype` kept as stored (`quantized`: block formats are kept where a kernel
    runs them)?"""
    return quantized and qtype in FORMATS and supported(qtype)


def planned_bytes(reader: GGUFModel, dtype: torch.dtype, quantized: bool) -> dict[str, int]:
    """The bytes each tensor format will hold once loaded (by format name), as `_held` says."""
    sizes: dict[str, int] = {}
    for t, held in _held(reader, dtype, quantized):
        key = t.tensor_type.name if held is None else str(held).removeprefix("torch.")
        sizes[key] = sizes.get(key, 0) + (int(t.n_bytes) if held is None else int(t.n_elements) * held.itemsize)
    return sizes


def working_bytes(reader: GGUFModel, dtype: torch.dtype, quantized: bool) -> int:
    """The memory a load needs for a moment beyond its weights: experts dequantized at load are
    concatenated (gate with up) and repacked for the grouped kernel a layer at a time, each a
    second copy of that layer's experts (as `dtype`) while it is made."""
    widened = _widened_experts(reader, quantized)
    layers: dict[str, int] = {}
    for t in reader.tensors:
        if _EXPERTS in t.name and (layer := _layer(t.name)) in widened:
            layers[layer] = layers.get(layer, 0) + int(t.n_elements) * dtype.itemsize
    return 2 * max(layers.values(), default=0)


_EXPERTS = "_exps."  # a sparse layer's stacked experts: ffn_{gate,up,down}_exps, weights and biases


def experts_block(reader: GGUFModel, quantized: bool) -> int:
    """The block along K of the experts' down projections kept as stored (the largest, if the
    layers differ; 1 if none): tensor parallelism splits the experts' intermediate size in
    whole blocks of it."""
    widened = _widened_experts(reader, quantized)
    return max((GGML_QUANT_SIZES[t.tensor_type][0] for t in reader.tensors
                if "ffn_down_exps.weight" in t.name and _layer(t.name) not in widened), default=1)


def _held(reader: GGUFModel, dtype: torch.dtype, quantized: bool) -> list[tuple[object, torch.dtype | None]]:
    """Each tensor read, and the dtype the loader holds it as (None: its blocks as stored): those
    gguf_layouts.FLOAT32 names float32; a layer's experts kept as stored only where all three
    weights are (`_widened_experts`), their biases then float32 (Experts.use_quantized adds them
    to the kernel's float32 sums); any other tensor kept where `_kept` says, else cast to `dtype`."""
    widened = _widened_experts(reader, quantized)
    arch = architecture(reader)
    skipped = layouts.skipped(reader, arch)
    held: list[tuple[object, torch.dtype | None]] = []
    for t in reader.tensors:
        if t.name in skipped:
            continue
        if t.name.split(".")[-2] in layouts.FLOAT32.get(arch, ()):
            held.append((t, torch.float32))
        elif _EXPERTS in t.name and _layer(t.name) not in widened:
            held.append((t, None if t.name.endswith(".weight") else torch.float32))
        elif _EXPERTS not in t.name and _kept(t, arch, quantized):
            held.append((t, None))
        else:
            held.append((t, dtype))
    return held


def _kept(t, arch: str, quantized: bool) -> bool:
    """kept_as_stored, but for the tensors gguf_layouts.DEQUANTIZED names, which their layers hold
    as floats."""
    return kept_as_stored(t.tensor_type, quantized) and t.name.split(".")[-2] not in layouts.DEQUANTIZED.get(arch, ())


def _widened_experts(reader: GGUFModel, quantized: bool) -> set[str]:
    """The layers whose experts are dequantized at load: those with an expert weight not kept as
    stored (layers/moe.py's take_stacked_experts widens its partners with it). Weights only: a
    gpt-oss layer's F32 expert biases are held beside its kept MXFP4 blocks."""
    return {_layer(t.name) for t in reader.tensors if _EXPERTS in t.name and t.name.endswith(".weight")
            and not kept_as_stored(t.tensor_type, quantized)}


def _layer(name: str) -> str:
    """A layer tensor's layer number (`blk.N....`)."""
    return name.split(".")[1]


def read_tensors(path: Path, reader: GGUFModel, cfg, quantized: bool) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The file's tensors by HF name, each checked against `cfg`'s shapes (a ModelNotFound
    naming the first that does not fit, or is missing), and under ROPE_FREQS the frequencies'
    divisors where the file has them; rows llama.cpp reordered put back (`_row_order`);
    `quantized`: block formats kept as stored where a kernel runs them, else all dequantized
    (float32, as transformers' conversion gives them)."""
    arch = architecture(reader)
    expected = expected_shapes(cfg, arch, frozenset(t.name for t in reader.tensors))
    state: dict[str, torch.Tensor | QuantizedWeight] = {}
    widened: dict[str, list[str]] = {}
    skipped = layouts.skipped(reader, arch)
    for t in reader.tensors:
        if t.name in skipped:
            continue
        if t.name == ROPE_FREQS and t.tensor_type == GGMLQuantizationType.F32 and t.n_elements == cfg.rotary_dim // 2:
            state[ROPE_FREQS] = _float(t, None)
            continue
        name = hf_name(t.name, arch)
        shape = tuple(reversed([int(n) for n in t.shape]))
        if name is None or name not in expected:
            raise ModelNotFound(f"{path.name}: tensor {t.name} has no place in this model")
        if (1, *shape) == expected[name]:  # llama.cpp stores a [1, H] gate as [H]
            shape = expected[name]
        if shape != expected[name]:
            raise ModelNotFound(f"{path.name}: tensor {t.name} is {list(shape)}, the config says "
                                f"{list(expected[name])}")
        rows = _row_order(arch, name, cfg, shape[0])
        if t.tensor_type in FLOATS:
            state[name] = _float(t, rows).reshape(shape)
            if arch == "gemma3" and name.endswith("norm.weight"):
                state[name] = state[name].float() - 1  # as transformers' GGUF conversion takes it off
        elif _kept(t, arch, quantized):
            data = _view(t.data) if rows is None else torch.from_numpy(t.data[rows])
            state[name] = QuantizedWeight(t.tensor_type, data.reshape(*shape[:-1], -1), shape)
        else:
            why = ("quantized weights not asked for" if not quantized
                   else "its layer holds floats" if kept_as_stored(t.tensor_type, quantized)
                   else "no kernel for it on this CPU" if t.tensor_type in FORMATS
                   else "a format kept quantized only as " + ", ".join(f.name for f in FORMATS))
            widened.setdefault(f"{t.tensor_type.name} ({why})", []).append(t.name)
            try:
                values = _dequantized(t, shape)
            except NotImplementedError:
                raise ModelNotFound(f"{path.name}: tensor {t.name}: the gguf package cannot read "
                                    f"type {t.tensor_type.name}") from None
            state[name] = values if rows is None else values[torch.from_numpy(rows)]
    if missing := sorted(set(expected) - set(state)):
        raise ModelNotFound(f"{path.name}: no tensor for {len(missing)} weights ({', '.join(missing[:3])}"
                            f"{', ...' if len(missing) > 3 else ''})")
    if arch == "deepseek2":
        layouts.join_kv_b(state, cfg)
    for kind, names in widened.items():
        log.info("%s: dequantized at load, %s: %d tensors (%s%s)", path.name, kind, len(names),
                 ", ".join(names[:3]), ", ..." if len(names) > 3 else "")
    return state


def _dequantized(t, shape: tuple[int, ...]) -> torch.Tensor:
    """A block-format tensor's float32 values, DEQUANTIZE_ROWS rows at a time: gguf's numpy
    dequantizer holds several temporaries of its input's full size (an expert tensor's: GBs),
    and quant.py's kernel, where it runs, is the same values ~100x faster."""
    data = _view(t.data).reshape(-1, t.data.shape[-1])
    out = torch.empty(data.shape[0], shape[-1])
    for start in range(0, data.shape[0], DEQUANTIZE_ROWS):
        chunk = data[start:start + DEQUANTIZE_ROWS]
        weight = QuantizedWeight(t.tensor_type, chunk, (chunk.shape[0], shape[-1]))
        out[start:start + chunk.shape[0]] = dequantize(weight)
    return out.view(shape)


def _float(t, rows: np.ndarray | None) -> torch.Tensor:
    """A float tensor, copied off the map (it is cast to the model's dtype next)."""
    data = np.asarray(t.data)
    if t.tensor_type == GGMLQuantizationType.BF16:  # the reader leaves it as bytes
        tensor = torch.from_numpy(np.array(data)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.array(data))
    return tensor if rows is None else tensor[torch.from_numpy(rows)]


def _view(array: np.ndarray) -> torch.Tensor:
    """A tensor on the read-only map, without a copy (nothing writes to a weight)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _row_order(arch: str, name: str, cfg, n: int) -> np.ndarray | None:
    """The order of the `n` rows of HF tensor `name` that undoes llama.cpp's (None: as stored):
    a llama's or granite's q/k permutation, deepseek2's interleaved rope (put in halves)."""
    if arch in PERMUTED:
        return _unpermute(name, cfg, n)
    return layouts.rope_rows(name, cfg, n) if arch == "deepseek2" else None


def _unpermute(name: str, cfg, n: int) -> np.ndarray | None:
    """The row order that undoes llama.cpp's q/k permutation (transformers'
    LlamaTensorProcessor), or None for a tensor it leaves alone: within each head, the rows
    come as (pair, half) and go back to (half, pair)."""
    if ".q_proj." in name:
        heads = cfg.num_heads
    elif ".k_proj." in name:
        heads = cfg.num_kv_heads
    else:
        return None
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(-1)
