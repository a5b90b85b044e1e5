"""What the model is served as beyond generation, from vLLM's flags (`--runner`, `--convert`,
`--hf-overrides`, `--chat-template`) and the sentence-transformers files of its folder:

- `classify`: a causal-LM reranker (Qwen3-Reranker). `classifier_from_token` names the
  [false, true] label tokens; a pair's score is p(true) / (p(true) + p(false)) at the last
  position of the score template, which /rerank and /score compute as a one-token completion
  renormalised over the two labels.
- `embed`: an embedding model (Qwen3-Embedding): the final-norm hidden states pooled as the
  folder's `modules.json` / `1_Pooling/config.json` say (last token, mean or CLS), normalised
  when a `Normalize` module follows.
"""

from __future__ import annotations

import json
from pathlib import Path

from freetoken.config import PoolingConfig, json_object_flag, text_config
from freetoken.serving.errors import RequestError

# sentence-transformers' pooling modes, as the engine names them.
POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_cls_token": "cls"}


def parse_overrides(text: str | None) -> dict:
    if not text:
        return {}
    return json_object_flag("--hf-overrides", text)


def read_template(value: str | None) -> str | None:
    """`--chat-template`: a file's path, or the template itself (as vLLM takes it)."""
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value


def _sentence_transformers_pooling(folder: Path) -> tuple[str, bool] | None:
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    mode, normalize = None, False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            cfg = json.loads((folder / module["path"] / "config.json").read_text())
            modes = [name for key, name in POOLING_MODES.items() if cfg.get(key)]
            if len(modes) != 1:
                raise ValueError(f"{module['path']}/config.json: supported pooling modes are "
                                 f"{', '.join(POOLING_MODES)}, one at a time")
            mode = modes[0]
        normalize |= kind.endswith("Normalize")
    return (mode, normalize) if mode else None


def pooling_config(runner: str, convert: str, overrides_text: str | None,
                   template: str | None, hf_config: dict, folder: Path) -> PoolingConfig | None:
    """None for a generation model. Raises ValueError, naming the flag, on flags that do not
    fit the model."""
    overrides = parse_overrides(overrides_text)
    config = {**text_config(hf_config), **overrides}
    architectures = config.get("architectures") or []
    labels = config.get("classifier_from_token")
    classifies = bool(labels) or any(a.endswith("ForSequenceClassification") for a in architectures)
    if runner == "auto":
        runner = "pooling" if classifies else "generate"
    if runner == "generate":
        if convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert} needs --runner pooling")
        return None
    if convert == "auto":
        convert = "classify" if classifies else "embed"
    if convert == "classify":
        if not labels or len(labels) != 2:
            raise ValueError('--convert classify serves a causal-LM reranker: --hf-overrides must '
                             'give "classifier_from_token" as its [false, true] label tokens, '
                             'e.g. ["no", "yes"] (sequence-classification heads are not '
                             "supported)")
        return PoolingConfig("classify", tuple(labels), read_template(template))
    if convert != "embed":
        raise ValueError(f"--convert {convert} is not supported (embed, classify)")
    found = _sentence_transformers_pooling(folder)
    mode, normalize = found if found else ("last", True)  # vLLM's default for decoder models
    if "pooling_type" in overrides:
        mode = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}.get(str(overrides["pooling_type"]).upper())
        if mode is None:
            raise ValueError("--hf-overrides pooling_type must be LAST, MEAN or CLS")
    normalize = bool(overrides.get("normalize", normalize))
    dims = config.get("matryoshka_dimensions")
    matryoshka = tuple(dims) if dims else (() if config.get("is_matryoshka") else None)
    return PoolingConfig("embed", pooling=mode, normalize=normalize,
                         hidden_size=config["hidden_size"], matryoshka_dimensions=matryoshka)


def served_for(config, task: str) -> PoolingConfig:
    """The served model's `PoolingConfig` (`config` a FrontendConfig), or a 400 naming `model`
    when the model is not served for `task`."""
    pooling = getattr(config, "pooling", None)
    if pooling is None or pooling.task != task:
        what = {"classify": "a reranker: start the server with --runner pooling --convert "
                "classify and --hf-overrides giving classifier_from_token",
                "embed": "an embedding model: start the server with --runner pooling "
                "--convert embed"}[task]
        raise RequestError(f"The served model is not {what}.", param="model")
    return pooling
