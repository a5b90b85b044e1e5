"""`freetoken serve`: resolve the model, start the engine process, then serve HTTP."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from freetoken.server.args import ServerArgs, parse_args, resolve_parsers

log = logging.getLogger("freetoken")


def _model_folder(model: str | None) -> tuple[Path, str]:
    from freetoken.models.loader import default_model_path, gguf_to_folder

    path = default_model_path() if model is None else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_folder(path), path.stem
    if not path.is_dir():
        from freetoken.models.loader import ModelNotFound

        raise ModelNotFound(f"Model not found: {path} (pass an HF model folder or a GGUF file)")
    return path, path.name


def start_engine(args: ServerArgs):
    """Spawn the engine process; returns (process, frontend config pieces) once it is ready."""
    tag = f"{os.getpid()}-{id(args)}"
    in_addr = f"ipc://{tempfile.gettempdir()}/freetoken-{tag}-in"
    out_addr = f"ipc://{tempfile.gettempdir()}/freetoken-{tag}-out"
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    from freetoken.scheduler.worker import engine_main

    proc = ctx.Process(target=engine_main, args=(args, in_addr, out_addr, ready), daemon=True)
    proc.start()
    status = ready.get()
    if status != "ok":
        proc.join(timeout=5)
        raise RuntimeError(status.removeprefix("error: "))
    return proc, in_addr, out_addr


def build_frontend(args: ServerArgs):
    """Load the model's tokenizer and config, start the engine, and return the frontend."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from freetoken.server.api_server import FrontendConfig, FrontendManager

    with tqdm(total=3, desc="Loading model", unit="step", file=sys.stderr) as bar:
        folder, name = _model_folder(args.model)
        bar.update()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        hf_config = json.loads((folder / "config.json").read_text())
        bar.update()
        args = replace(args, model_folder=str(folder))
        proc, in_addr, out_addr = start_engine(args)
        bar.update()
    reasoning, tool = resolve_parsers(args, tokenizer)
    native_len = hf_config.get("max_position_embeddings", 4096)
    config = FrontendConfig(
        served_model_name=args.served_model_name or name,
        max_model_len=min(args.max_model_len or native_len, native_len),
        vocab_size=hf_config["vocab_size"],
        max_output_tokens=args.max_output_tokens,
        max_logprobs=args.max_logprobs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        reasoning_parser=reasoning,
        tool_call_parser=tool,
        api_key=args.api_key,
    )
    return FrontendManager(config, tokenizer, in_addr, out_addr, engine_alive=proc.is_alive), proc


def launch_server(argv: list[str] | None = None, prog: str = "freetoken serve") -> int:
    import uvicorn

    from freetoken.models.loader import ModelNotFound
    from freetoken.server.api_server import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv, prog)
    try:
        frontend, proc = build_frontend(args)
    except (ModelNotFound, RuntimeError) as exc:
        print(f"freetoken: {exc}", file=sys.stderr)
        return 1
    app = create_app(lambda: frontend)
    cfg = frontend.config
    log.info("FreeToken ready at http://%s:%d/v1 serving %s (reasoning parser: %s, tool parser: %s)",
             args.host, args.port, cfg.served_model_name, cfg.reasoning_parser, cfg.tool_call_parser)
    try:
        # A bounded graceful shutdown: an open stream must not keep a stopped server alive.
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=5)
    finally:
        proc.terminate()
    return 0
