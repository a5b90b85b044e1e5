"""Configuration, each value derived once: the flags (`ServerArgs`) and the model's config.json
become an `EngineConfig` (what the engine process builds) and a `FrontendConfig` (what the HTTP
side enforces). The offline `LLM` builds its `EngineConfig` directly."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from freetoken import envs


def context_length(requested: int | None, native: int) -> int:
    """The context the server enforces: the model's own, or a shorter one asked for."""
    return min(requested or native, native)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism over torch.distributed, with torchrun's names: `tp_size` ranks spread
    evenly over `nnodes` machines; this machine runs ranks node_rank * per_node onwards."""

    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "auto"  # gloo on CPU, nccl on CUDA
    timeout_s: float = 30.0  # longest wait of one collective within a step
    # Joining the group and loading: every rank waits this long for the slowest (a big model's
    # load, a node started late).
    setup_timeout_s: float = 600.0

    @property
    def per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)


def json_object_flag(flag: str, text: str) -> dict:
    """A flag's JSON object value; a ValueError naming the flag otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` as vLLM spells it: its `ngram` method (prompt lookup) and its `mtp`
    method (the checkpoint's multi-token-prediction head drafts)."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    method: str = "ngram"

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        raw = json_object_flag("--speculative-config", text)
        method = raw.pop("method", "ngram")
        fields = {"ngram": {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
                  "mtp": {"num_speculative_tokens"}}
        if method not in fields:
            raise ValueError(f"--speculative-config: method {method!r} is not supported "
                             "(supported: 'ngram', 'mtp')")
        known = fields[method]
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown field(s) {', '.join(unknown)} "
                             f"for method {method!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config: 'num_speculative_tokens' is required")
        values = {k: raw[k] for k in known if k in raw}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
            raise ValueError("--speculative-config: its sizes must be integers")
        config = cls(method=method, **values)
        if not (1 <= config.num_speculative_tokens <= 64):
            raise ValueError("--speculative-config: 'num_speculative_tokens' must be in [1, 64]")
        if not (1 <= config.prompt_lookup_min <= config.prompt_lookup_max):
            raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return config


# What a GGUF's block formats become: "quantized" keeps them as stored, "float32" dequantizes them
# at load (the weights HF transformers computes with, at 5x the memory; cast to the dtype asked
# for). Unset: quantized for float32; dequantized for bfloat16 and float16, which the quantized
# kernels would compute in float32 (a bfloat16 model then runs on the CPU's bfloat16 units, AMX
# where it has them, at 2.5-3x the memory of a 4-bit file).
GGUF_WEIGHTS = ("quantized", "float32")
# The kernels a linear layer's load-time probe chooses among (layers/linear.py; the last
# two are the bfloat16 units of kernels/bf16_linear.py).
LINEAR_KERNELS = ("onednn", "torch", "grouped", "amx", "avx512_bf16")
# How the quantized kernels multiply: "exact" in float32 on the exactly dequantized weights (the
# scoring contract), "int8" on integer dot products with the rows quantized to int8 per block of
# 32 (kernels/int8.py: llama.cpp's arithmetic, still batch-invariant, less exact).
QUANTIZED_ARITHMETIC = ("exact", "int8")


@dataclass(frozen=True)
class WeightsConfig:
    """How a model's weights are held and multiplied: `--gguf-weights`, `--linear-kernel`,
    `--exact-tp`, `--huge-pages` (None: the envs.py variable of the same name where set,
    `resolved`, else automatic) and `--quantized-arithmetic`."""

    gguf_weights: str | None = None  # one of GGUF_WEIGHTS; automatic: by the dtype
    linear_kernel: str | None = None  # the one LINEAR_KERNELS member the probe may choose
    # One process computes its sliced layers as two tensor-parallel ranks would (results equal to
    # theirs bit for bit); automatic: where that costs about nothing (parts.free_in_parts).
    exact_tp: bool | None = None
    huge_pages: bool | None = None  # a GGUF's blocks copied into huge pages; automatic: where given
    quantized_arithmetic: str = "exact"  # one of QUANTIZED_ARITHMETIC
    # The LM head on a kernel that computes chosen columns alone (layers/linear.py): set for
    # --runner pooling, whose logit rows read a reranker's two labels or nothing.
    head_for_columns: bool = False

    def __post_init__(self):
        _check("gguf_weights", self.gguf_weights, GGUF_WEIGHTS)
        _check("quantized_arithmetic", self.quantized_arithmetic, QUANTIZED_ARITHMETIC)
        _check("linear_kernel", self.linear_kernel, LINEAR_KERNELS)

    def resolved(self) -> WeightsConfig:
        """Each unset field from its variable (checked, naming it)."""
        gguf_weights = self.gguf_weights or envs.GGUF_WEIGHTS.get()
        linear_kernel = self.linear_kernel or envs.LINEAR_KERNEL.get()
        _check(envs.GGUF_WEIGHTS.name, gguf_weights, GGUF_WEIGHTS)
        _check(envs.LINEAR_KERNEL.name, linear_kernel, LINEAR_KERNELS)
        exact, huge = envs.EXACT_TP.get(), envs.HUGE_PAGES.get()
        return WeightsConfig(
            gguf_weights=gguf_weights,
            linear_kernel=linear_kernel,
            exact_tp=self.exact_tp if self.exact_tp is not None else {"1": True, "0": False}.get(exact or ""),
            huge_pages=self.huge_pages if self.huge_pages is not None else (False if huge == "0" else None),
            quantized_arithmetic=self.quantized_arithmetic,
            head_for_columns=self.head_for_columns,
        )


def _check(name: str, value: str | None, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"{name}={value}: not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class EngineConfig:
    model_folder: str | None = None  # an HF folder; None: the default model
    dtype: str = "auto"
    device: str = "auto"
    kv_slots: int = 16384
    max_model_len: int | None = None  # requested; clamped by `context_length` against the model
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048
    prefix_cache: bool = True
    # Hybrid models: recurrent-state snapshots the prefix cache may hold (kvcache/state_pool.py).
    state_snapshots: int = 32
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None  # None: plain decoding
    weights: WeightsConfig = WeightsConfig()


@dataclass(frozen=True)
class PoolingConfig:
    """What a model is served as beyond generation (serving/pooling/config.py builds it)."""

    task: str  # "classify" or "embed"
    label_tokens: tuple[str, ...] = ()  # classify: [false, true]
    score_template: str | None = None  # classify: jinja over messages of role query / document
    pooling: str = "last"  # embed: "last", "mean" or "cls"
    normalize: bool = True
    hidden_size: int = 0
    # Matryoshka: None refuses `dimensions`; () allows any up to hidden_size; else these only.
    matryoshka_dimensions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class FrontendConfig:
    served_model_name: str
    max_model_len: int
    vocab_size: int
    max_output_tokens: int | None = None
    max_logprobs: int = 20
    return_tokens_as_token_ids: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    api_key: str | None = None
    max_running_requests: int = 64
    max_request_bytes: int = 32 * 1024 * 1024
    max_prompts_per_request: int = 1024
    max_labels: int = 64
    playground: bool = True
    pooling: PoolingConfig | None = None  # None: a generation model (serving/pooling/config.py)
    system_fingerprint: str | None = None  # set on an int8-arithmetic server (serving/handling.py)


def engine_config(args, model_folder: str, pooling: PoolingConfig | None = None) -> EngineConfig:
    """`args` is a `ServerArgs`; `pooling` what the model is served as beyond generation."""
    return EngineConfig(
        model_folder=model_folder,
        dtype=args.dtype,
        device=args.device,
        kv_slots=args.kv_slots,
        max_model_len=args.max_model_len,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        prefix_cache=not args.no_prefix_cache,
        state_snapshots=args.state_snapshots,
        speculative=SpeculativeConfig.parse(args.speculative_config) if args.speculative_config else None,
        parallel=ParallelConfig(
            tp_size=args.tensor_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
            master_addr=args.master_addr, master_port=args.master_port,
            backend=args.distributed_backend, timeout_s=args.distributed_timeout),
        weights=replace(args.weights, head_for_columns=pooling is not None),
    )


def frontend_config(args, hf_config: dict, name: str, parsers: tuple[str | None, str | None],
                    pooling: PoolingConfig | None = None) -> FrontendConfig:
    """`args` is a `ServerArgs`; `parsers` the resolved (reasoning, tool call) families;
    `pooling` what the model is served as beyond generation."""
    return FrontendConfig(
        served_model_name=args.served_model_name or name,
        max_model_len=context_length(args.max_model_len, native_context(hf_config)),
        vocab_size=text_config(hf_config)["vocab_size"],
        max_output_tokens=args.max_output_tokens,
        max_logprobs=args.max_logprobs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        reasoning_parser=parsers[0],
        tool_call_parser=parsers[1],
        api_key=args.api_key,
        max_running_requests=args.max_running_requests,
        max_request_bytes=args.max_request_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        max_labels=args.max_labels,
        playground=not args.no_playground,
        pooling=pooling,
        system_fingerprint=("quantized-arithmetic:int8" if args.quantized_arithmetic == "int8" else None),
    )


def text_config(hf_config: dict) -> dict:
    """The language model's config: nested under `text_config` in image-text layouts."""
    return hf_config.get("text_config") or hf_config


def native_context(hf_config: dict) -> int:
    """The longest sequence served: the config's, or for `longrope` the original context, past
    which transformers recomputes a sequence on other frequencies (layers/rotary.py)."""
    cfg = text_config(hf_config)
    if rope_type(rope_parameters(cfg)) == "longrope":
        return original_context(cfg)
    return cfg.get("max_position_embeddings", 4096)


def original_context(hf_config: dict) -> int:
    """The context a scaled rotary schedule was trained on, where transformers finds it: beside
    the rotary parameters (Phi-3's), in them, else the config's context."""
    cfg = text_config(hf_config)
    return (cfg.get("original_max_position_embeddings")
            or rope_parameters(cfg).get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 4096))


def rope_parameters(hf_config: dict, layer_type: str = "full_attention") -> dict:
    """The rotary embedding's parameters: transformers 5's `rope_parameters`, or the
    `rope_scaling` of configs written before it. Where transformers 5 nests them by layer type
    (Gemma 3's local and global layers), those of `layer_type`."""
    cfg = text_config(hf_config)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope[layer_type] if isinstance(rope.get(layer_type), dict) else rope


def rope_type(rope: dict) -> str:
    """The schedule `rope_parameters` names ("default", "yarn", "llama3", ...)."""
    return rope.get("rope_type") or rope.get("type") or "default"
