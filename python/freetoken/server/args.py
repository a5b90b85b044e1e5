"""Command-line flags of `freetoken serve`, parsed into one frozen `ServerArgs`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


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
    model_folder: str | None = None  # filled by the launcher: the HF folder actually loaded


def parse_args(argv: list[str] | None = None, prog: str = "freetoken serve") -> ServerArgs:
    p = argparse.ArgumentParser(prog=prog, description="Serve a model over the OpenAI API.")
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="HF model folder or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", "--model-path", dest="model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument("--served-model-name")
    p.add_argument("--max-output-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="token budget of one prefill step (longer prompts are chunked)")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--kv-cache-tokens", dest="kv_slots", type=int, default=16384,
                   help="size of the preallocated KV pool, in tokens")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--reasoning-parser", default="auto", help="qwen3, gpt_oss, auto or off")
    p.add_argument("--tool-call-parser", default="auto",
                   help="qwen3_coder, hermes, qwen25, gpt_oss, auto or off")
    p.add_argument("--return-tokens-as-token-ids", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--api-key")
    ns = p.parse_args(argv)
    if ns.model_pos and ns.model:
        p.error("give the model once, as MODEL or --model")
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
    )


def _single_id(tokenizer, marker: str) -> bool:
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.decode(ids) == marker


def resolve_parsers(args: ServerArgs, tokenizer) -> tuple[str | None, str | None]:
    """`auto` picks a parser family from the vocabulary and the chat template; `off` is none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    harmony = _single_id(tokenizer, "<|channel|>") and _single_id(tokenizer, "<|message|>")
    reasoning = args.reasoning_parser
    if reasoning == "auto":
        reasoning = "gpt_oss" if harmony else "qwen3" if _single_id(tokenizer, "</think>") else None
    tool = args.tool_call_parser
    if tool == "auto":
        if harmony:
            tool = "gpt_oss"
        elif _single_id(tokenizer, "<tool_call>"):
            tool = "qwen3_coder" if "<function=" in template else "hermes"
        else:
            tool = None
    return (None if reasoning == "off" else reasoning), (None if tool == "off" else tool)
