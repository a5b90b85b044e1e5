"""A model folder's tokenizer, loaded without transformers' model registry where it can be.

`AutoTokenizer.from_pretrained` chooses the tokenizer's class from the folder's files and its
config's model type, and to do so imports transformers' whole `models` package (a scan of its
~570 model folders) and, through the family's config class, transformers' model-loading stack
with torch's distributed tensors: seconds of every start, in the server's process and the
engine's alike. So its choice is asked once per folder content and transformers version and
kept in the cache folder; where it chose the tokenizers-library class that most folders declare
(`TokenizersBackend`), later loads build that class directly. Any other choice goes through
`AutoTokenizer` every time, handed a config of the base class carrying the folder's model type,
which leads it to the same class without importing the family's config module.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from freetoken.paths import cache_root

BACKEND = "TokenizersBackend"


def load_tokenizer(folder: str | Path):
    """The HF tokenizer of `folder` (a model folder with a config.json), the class
    `AutoTokenizer` would choose."""
    folder = Path(folder)
    key = _choice_key(folder)
    if key is not None and _choices().get(key) == BACKEND:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    tokenizer = _auto_tokenizer(folder)
    if key is not None:
        _remember(key, type(tokenizer).__name__)
    return tokenizer


def _auto_tokenizer(folder: Path):
    from transformers import AutoTokenizer, PreTrainedConfig

    config = json.loads((folder / "config.json").read_text())
    model_type = config.get("model_type")
    if not isinstance(model_type, str):  # not a transformers config: its own way
        return AutoTokenizer.from_pretrained(folder)
    typed = type("TokenizerConfig", (PreTrainedConfig,), {"model_type": model_type})
    return AutoTokenizer.from_pretrained(folder, config=typed.from_dict(config))


def _choice_key(folder: Path) -> str | None:
    """What AutoTokenizer's choice depends on: the configs' text, the folder's file names (a
    Mistral folder's tekken.json), transformers' version. None where the folder brings its own
    tokenizer code (`auto_map`): never bypassed."""
    import transformers

    tokenizer_config = folder / "tokenizer_config.json"
    declared = tokenizer_config.read_bytes() if tokenizer_config.is_file() else b""
    if b'"auto_map"' in declared:
        return None
    digest = hashlib.sha256()
    for part in (transformers.__version__.encode(), (folder / "config.json").read_bytes(), declared,
                 "\0".join(sorted(p.name for p in folder.iterdir())).encode()):
        digest.update(part + b"\0\0")
    return digest.hexdigest()[:24]


def _store() -> Path:
    return cache_root() / "tokenizer-classes.json"


def _choices() -> dict[str, str]:
    try:
        return json.loads(_store().read_text())
    except (OSError, ValueError):
        return {}


def _remember(key: str, chosen: str) -> None:
    """Kept with a rename: concurrent starts each write a whole file (the last one wins, and
    every writer holds the same choice for its key)."""
    store = _store()
    store.parent.mkdir(parents=True, exist_ok=True)
    tmp = store.with_name(f"{store.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**_choices(), key: chosen}, indent=1, sort_keys=True))
    os.replace(tmp, store)
