"""Command-line flags of `freetoken serve`, parsed into one frozen `ServerArgs`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from freetoken.config import GGUF_WEIGHTS, LINEAR_KERNELS, QUANTIZED_ARITHMETIC, SpeculativeConfig, WeightsConfig
from freetoken.hub import HubOptions
from freetoken.parsing import registry
from freetoken.serving.pooling.config import parse_overrides


@dataclass(frozen=True)
class ServerArgs:
    model: str | None
    host: str
    port: int
    served_model_name: str | None
    max_output_tokens: int | None
    max_model_len: int | None
    max_running_requests: int
    max_prefill_tokens: int
    max_logprobs: int
    kv_slots: int
    no_prefix_cache: bool
    reasoning_parser: str
    tool_call_parser: str
    return_tokens_as_token_ids: bool
    dtype: str
    device: str
    api_key: str | None
    shutdown_timeout: float = 30.0
    max_request_bytes: int = 32 * 1024 * 1024
    max_prompts_per_request: int = 1024
    max_labels: int = 64
    state_snapshots: int = 32
    speculative_config: str | None = None
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    distributed_backend: str = "auto"
    distributed_timeout: float = 30.0
    no_playground: bool = False
    runner: str = "auto"
    convert: str = "auto"
    hf_overrides: str | None = None
    chat_template: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    hf_token: str | None = None
    offline: bool = False
    gguf_weights: str | None = None
    linear_kernel: str | None = None
    exact_tp: str = "auto"
    huge_pages: str = "auto"
    quantized_arithmetic: str = "exact"

    @property
    def hub(self) -> HubOptions:
        return HubOptions(self.revision, self.download_dir, self.hf_token, self.offline)

    @property
    def weights(self) -> WeightsConfig:
        return WeightsConfig(gguf_weights=self.gguf_weights, linear_kernel=self.linear_kernel,
                             exact_tp={"on": True, "off": False}.get(self.exact_tp),
                             huge_pages=False if self.huge_pages == "off" else None,
                             quantized_arithmetic=self.quantized_arithmetic)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" where X says something; flags and unset options explain
    themselves in their own help text."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "%(default)" in help_text or "(default:" in help_text or action.default in (
                None, False, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action)


def build_parser(prog: str = "freetoken serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=_HelpFormatter,
                                description="Serve a model over the OpenAI API (/v1/completions, "
                                "/v1/chat/completions, /v1/models, /health).")
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="HF model folder, GGUF file (the first part of a split one), or a Hugging "
                   "Face Hub name: ORG/NAME (safetensors) or ORG/NAME:TAG (a GGUF repo's "
                   "quantization, Q4_K_M by default) (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", "--model-path", dest="model", metavar="MODEL",
                   help="the model, as a flag instead of the positional MODEL (default: the "
                   "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=1919,
                   help="TCP port to listen on (bound before the model loads; 0 picks a free one)")
    p.add_argument("--served-model-name",
                   help="model name reported by /v1/models and accepted in requests (default: "
                   "a Hub name as typed, else the model folder or GGUF file name)")
    p.add_argument("--max-output-tokens", type=int,
                   help="cap on the max_tokens of any request (default: no cap beyond the "
                   "context length)")
    p.add_argument("--max-model-len", type=int,
                   help="context length, prompt plus output, in tokens (default: the model's "
                   "max_position_embeddings)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="most requests decoded together in one batch; more wait in a queue")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="token budget of one prefill step (longer prompts are chunked)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most alternatives a request may ask for with logprobs / top_logprobs")
    p.add_argument("--kv-cache-tokens", dest="kv_slots", metavar="KV_CACHE_TOKENS", type=int,
                   default=16384,
                   help="size of the preallocated KV pool, in tokens")
    p.add_argument("--state-snapshots", type=int, default=32,
                   help="hybrid (linear-attention) models: recurrent-state snapshots the prefix "
                   "cache may keep, each the size of one request's state (see /v1/stats)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, as vLLM spells it: {"method": "ngram", '
                   '"num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 4}, or '
                   '{"method": "mtp", "num_speculative_tokens": K} for a checkpoint with an MTP '
                   "head (Qwen3.5, Qwen3-Next); outputs stay bit-identical to plain decoding "
                   "(default: off)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse the KV of shared prompt prefixes across requests "
                   "(default: reuse them)")
    p.add_argument("--reasoning-parser", default="auto", metavar="NAME",
                   choices=[*registry.REASONING_PARSERS, "auto", "off"],
                   help="how reasoning is split from the answer: "
                   f"{', '.join(registry.REASONING_PARSERS)}, auto (from the vocabulary) or off")
    p.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                   choices=[*registry.TOOL_CALL_PARSERS, "auto", "off"],
                   help="how tool calls are parsed: "
                   f"{', '.join(registry.TOOL_CALL_PARSERS)}, auto (from the vocabulary and chat "
                   "template) or off")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="write logprob tokens as 'token_id:N' for every request (default: off)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation type; auto is float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or auto (cuda when available)")
    p.add_argument("--api-key",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: no key)")
    p.add_argument("--no-playground", action="store_true",
                   help="do not serve the browser playground at / and /playground (default: "
                   "served; its API calls need the --api-key like any other client)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM/SIGINT before they "
                   "are ended with a 503")
    p.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024,
                   help="largest request body accepted; larger bodies get 413")
    p.add_argument("--max-prompts-per-request", type=int, default=1024,
                   help="most prompts one /v1/completions request may carry")
    p.add_argument("--max-labels", type=int, default=64,
                   help="most labels one request may score (/generative_scoring, completions' "
                   "labels)")
    hub = p.add_argument_group("models by Hub name (huggingface_hub; HF_HOME, HF_HUB_CACHE, HF_TOKEN, "
                               "HF_HUB_OFFLINE, HF_ENDPOINT honoured)")
    hub.add_argument("--revision", help="branch, tag or commit of a Hub model (default: main)")
    hub.add_argument("--download-dir", metavar="DIR",
                     help="the cache a Hub model is downloaded into and read from (default: "
                     "huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub)")
    hub.add_argument("--hf-token", metavar="TOKEN",
                     help="token for a private or gated Hub model (default: $HF_TOKEN or the saved "
                     "login)")
    hub.add_argument("--offline", action="store_true",
                     help="never ask the Hub: a Hub model is served from the cache, as "
                     "HF_HUB_OFFLINE=1 (default: ask it, the cache where it cannot be reached)")
    pool = p.add_argument_group("pooling models (vLLM's flags; docs/scoring.md)")
    pool.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                      help="pooling serves /v1/embeddings or /rerank and /score instead of "
                      "generation; auto is pooling when --hf-overrides names a classifier")
    pool.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "classify"],
                      help="with --runner pooling: embed (hidden states pooled as the folder's "
                      "sentence-transformers files say) or classify (a causal-LM reranker); auto "
                      "is classify when --hf-overrides gives classifier_from_token, else embed")
    pool.add_argument("--hf-overrides", metavar="JSON",
                      help='config.json values to override, e.g. {"architectures": '
                      '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
                      '"is_original_qwen3_reranker": true} for Qwen3-Reranker, or {"is_matryoshka": '
                      "true} to allow embedding dimensions (default: none)")
    pool.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                      help="a reranker's score template (jinja over messages of role query and "
                      "document, as examples/qwen3_reranker.jinja) "
                      "(default: the query and document as a tokenizer text pair)")
    dist = p.add_argument_group("tensor parallelism (torch.distributed, torchrun's conventions)")
    dist.add_argument("--tensor-parallel-size", "--tp-size", "-tp", dest="tensor_parallel_size",
                      type=int, default=1, metavar="N",
                      help="engine processes (ranks) that split every layer of the model")
    dist.add_argument("--nnodes", type=int, default=1,
                      help="machines the ranks are spread over, tensor-parallel-size / nnodes "
                      "each; every machine runs the same command with its own --node-rank")
    dist.add_argument("--node-rank", type=int, default=0,
                      help="this machine's index; node 0 serves HTTP, the others run their ranks "
                      "and wait for the group (default: 0)")
    dist.add_argument("--master-addr", default="127.0.0.1",
                      help="address of node 0, where the ranks meet (torch.distributed's store)")
    dist.add_argument("--master-port", type=int, default=29500,
                      help="port of the store on node 0")
    dist.add_argument("--distributed-backend", default="auto", choices=["auto", "gloo", "nccl"],
                      help="collectives backend; auto is nccl on CUDA, gloo on CPU")
    dist.add_argument("--distributed-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="longest wait of one collective in a step before the group is taken "
                      "down (a dead rank is seen at once; this bounds a hung one)")
    kernels = p.add_argument_group("weights and kernels (docs/engine/kernels.md; unset, the variables "
                                    "of docs/server.md's \"Environment variables\" apply)")
    kernels.add_argument("--gguf-weights", choices=GGUF_WEIGHTS,
                         help="a GGUF's block formats kept as stored (quantized kernels) or dequantized "
                         "at load (default: quantized for float32, float32 for bfloat16 and float16)")
    kernels.add_argument("--linear-kernel", choices=LINEAR_KERNELS,
                         help="the one kernel the load-time probe may choose for float and bfloat16 "
                         "linear layers (default: the fastest batch-invariant one per shape)")
    kernels.add_argument("--exact-tp", choices=["auto", "on", "off"], default="auto",
                         help="one process computes its sliced layers as two tensor-parallel ranks "
                         "would, so its results equal theirs bit for bit (auto: where that costs "
                         "about nothing)")
    kernels.add_argument("--huge-pages", choices=["auto", "off"], default="auto",
                         help="copy a GGUF's quantized blocks into transparent huge pages where the "
                         "kernel gives them (off: they stay on the file's map)")
    kernels.add_argument("--quantized-arithmetic", choices=QUANTIZED_ARITHMETIC, default="exact",
                         help="how a GGUF's kept blocks multiply: exact (float32 on the dequantized "
                         "weights) or int8 (rows quantized to int8 per block of 32, integer dot "
                         "products: faster prefill, less exact, still batch-invariant; Q8_0, Q4_K, "
                         "Q5_K and Q6_K layers and MoE experts)")
    return p


def parse_args(argv: list[str] | None = None, prog: str = "freetoken serve") -> ServerArgs:
    p = build_parser(prog)
    ns = p.parse_args(argv)
    if ns.model_pos and ns.model:
        p.error("give the model once, as MODEL or --model")
    if ns.tensor_parallel_size < 1 or ns.nnodes < 1 or ns.tensor_parallel_size % ns.nnodes:
        p.error("--tensor-parallel-size must be a positive multiple of --nnodes")
    if not 0 <= ns.node_rank < ns.nnodes:
        p.error("--node-rank must be in [0, --nnodes)")
    if ns.chat_template is not None and ns.runner == "generate":
        p.error("--chat-template is a reranker's score template: it needs --runner pooling")
    try:
        parse_overrides(ns.hf_overrides)
    except ValueError as exc:
        p.error(str(exc))
    if ns.speculative_config:
        try:
            SpeculativeConfig.parse(ns.speculative_config)
        except ValueError as exc:
            p.error(str(exc))
    return ServerArgs(
        model=ns.model or ns.model_pos,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        max_output_tokens=ns.max_output_tokens,
        max_model_len=ns.max_model_len,
        max_running_requests=ns.max_running_requests,
        max_prefill_tokens=ns.max_prefill_tokens,
        max_logprobs=ns.max_logprobs,
        kv_slots=ns.kv_slots,
        no_prefix_cache=ns.no_prefix_cache,
        reasoning_parser=ns.reasoning_parser,
        tool_call_parser=ns.tool_call_parser,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        dtype=ns.dtype,
        device=ns.device,
        api_key=ns.api_key,
        shutdown_timeout=ns.shutdown_timeout,
        max_request_bytes=ns.max_request_bytes,
        max_prompts_per_request=ns.max_prompts_per_request,
        max_labels=ns.max_labels,
        state_snapshots=ns.state_snapshots,
        speculative_config=ns.speculative_config,
        tensor_parallel_size=ns.tensor_parallel_size,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        distributed_backend=ns.distributed_backend,
        distributed_timeout=ns.distributed_timeout,
        no_playground=ns.no_playground,
        runner=ns.runner,
        convert=ns.convert,
        hf_overrides=ns.hf_overrides,
        chat_template=ns.chat_template,
        revision=ns.revision,
        download_dir=ns.download_dir,
        hf_token=ns.hf_token,
        offline=ns.offline,
        gguf_weights=ns.gguf_weights,
        linear_kernel=ns.linear_kernel,
        exact_tp=ns.exact_tp,
        huge_pages=ns.huge_pages,
        quantized_arithmetic=ns.quantized_arithmetic,
    )


def resolve_parsers(args: ServerArgs, tokenizer) -> tuple[str | None, str | None]:
    """`auto` picks a parser family from the vocabulary and the chat template; `off` is none."""
    return registry.resolve(args.reasoning_parser, args.tool_call_parser, tokenizer)
