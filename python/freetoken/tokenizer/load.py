"""A model folder's tokenizer, loaded without its model's transformers config class.

`AutoTokenizer.from_pretrained` reads the folder's config for the model type (its choice of
tokenizer class keys on it) through `AutoConfig`, which imports the family's configuration
module, and with it transformers' model-loading stack and torch's distributed tensors: seconds
of every start, in the server's process and the engine's alike, for two fields. Handing it a
config of the base class that carries the same `model_type` and fields gives the same choice.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(folder: str | Path):
    """The HF tokenizer of `folder` (a model folder with a config.json)."""
    from transformers import AutoTokenizer, PreTrainedConfig

    config = json.loads((Path(folder) / "config.json").read_text())
    model_type = config.get("model_type")
    if not isinstance(model_type, str):  # not a transformers config: its own way
        return AutoTokenizer.from_pretrained(folder)
    typed = type("TokenizerConfig", (PreTrainedConfig,), {"model_type": model_type})
    return AutoTokenizer.from_pretrained(folder, config=typed.from_dict(config))
