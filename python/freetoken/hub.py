"""A model named as on the Hugging Face Hub, resolved to files in the Hub's cache by
huggingface_hub.

`ORG/NAME` serves a repo of safetensors weights (with its config, tokenizer and chat template);
`ORG/NAME:TAG` a GGUF repo's file of quantization TAG (`Q4_K_M`, `q8_0`, `UD-Q4_K_XL`: as the
file names spell it, any case), every part of a split one; with no tag a GGUF repo's Q4_K_M, else
its only model. `hf.co/ORG/NAME:TAG` (Ollama's spelling) is the same name.

Only what serving needs is downloaded, into the Hub's cache (HF_HOME / HF_HUB_CACHE, or
--download-dir), one file at a time by huggingface_hub: a file cut off is resumed by the next
start, and appears in the snapshot only whole. Each start asks the Hub for the repo's file list
(a moved branch is followed); where the Hub cannot be reached, or offline (HF_HUB_OFFLINE=1,
--offline), the files are chosen among those already cached. Before a byte of weights is
downloaded, their sizes from the listing are held against the memory available and the cache's
free disk. A local path always wins: a name is looked up only where no file or folder has it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from freetoken.paths import ModelNotFound

log = logging.getLogger(__name__)

NAME = re.compile(r"^(?:hf\.co/)?(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.-]+))?$")
DEFAULT_TAG = "Q4_K_M"  # llama.cpp's and Ollama's choice where a name has no tag
SPLIT_SUFFIX = re.compile(r"-(\d{5})-of-(\d{5})$")
# A quantization label as GGUF file names carry it (the last one in the name wins).
QUANT = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q|TQ)\d(?:_[A-Za-z0-9]+)*|BF16|F16|F32|MXFP4(?:_MOE)?)"
                   r"(?![A-Za-z0-9])", re.IGNORECASE)
# A safetensors repo's files serving reads: weights, config, tokenizer, chat template, and a
# sentence-transformers model's module configs (`1_Pooling/config.json`).
SERVED_SUFFIXES = (".json", ".safetensors", ".jinja", ".tiktoken")
SERVED_FILES = ("tokenizer.model", "merges.txt", "vocab.txt")
MODULE_FOLDER = re.compile(r"^\d+_\w+$")


@dataclass(frozen=True)
class HubOptions:
    revision: str | None = None  # branch, tag or commit (None: the repo's main branch)
    download_dir: str | None = None  # the cache (None: huggingface_hub's, from HF_HOME / HF_HUB_CACHE)
    token: str | None = None  # None: HF_TOKEN or the saved login, as huggingface_hub finds them
    offline: bool = False  # also set by HF_HUB_OFFLINE=1


def hub_name(model: str | os.PathLike | None) -> tuple[str, str | None] | None:
    """(repo id, tag) of a model named as on the Hub; None for a local path (one that exists,
    or that no repo id could spell) or no model."""
    if model is None or Path(model).exists():
        return None
    match = NAME.match(str(model))
    return None if match is None else (match["repo"], match["tag"])


def resolve_model(model: str | os.PathLike | None, options: HubOptions,
                  weight_itemsize: int | None = None) -> tuple[str | None, str | None]:
    """(local path, served name): the path as given (name None) unless `model` is a Hub name,
    whose files are then found in the cache or downloaded. `weight_itemsize`: the bytes a float
    weight takes once loaded, for the memory check before downloading (None: no check)."""
    named = hub_name(model)
    if named is None:
        return (None if model is None else str(model)), None
    repo, tag = named
    listing = _listing(repo, options)
    if listing is None:  # offline, or the Hub cannot be reached
        snapshot, files = _cached(repo, tag, options)
        try:
            chosen = choose_files(repo, files, tag)
        except ModelNotFound as exc:
            raise ModelNotFound(f"{exc} (of the files cached in {snapshot}: the Hub was not asked)") from None
    else:
        commit, files = listing
        chosen = choose_files(repo, files, tag)
        small = [f for f in chosen if not _is_weights(f)]
        snapshot = _download(repo, small, options, commit, files) if small else None
        weights = _indexed(snapshot, [f for f in chosen if _is_weights(f)])
        if weight_itemsize is not None:
            needed = sum(files[f] for f in weights) * _widening(snapshot, weights, weight_itemsize)
            _check_memory(str(model), needed)
        _check_disk(repo, options, sum(files[f] for f in weights if not _in_cache(repo, f, commit, options)))
        snapshot = _download(repo, weights, options, commit, files)
    gguf = [f for f in chosen if f.endswith(".gguf")]
    return str(snapshot / gguf[0] if gguf else snapshot), str(model)


def quant_tag(filename: str) -> str:
    """The quantization label a GGUF file's name carries (upper case), else its name."""
    stem = SPLIT_SUFFIX.sub("", PurePosixPath(filename).name.removesuffix(".gguf"))
    labels = QUANT.findall(stem)
    return labels[-1].upper() if labels else stem


def choose_files(repo: str, files: dict[str, int], tag: str | None) -> list[str]:
    """The files (of `files`, repo paths -> sizes) that serve `repo` at `tag`: a GGUF model's
    parts in order, or a safetensors repo's weights, config and tokenizer files."""
    ggufs = [f for f in files if f.endswith(".gguf") and not PurePosixPath(f).name.lower().startswith("mmproj")]
    if tag is None and "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return sorted(f for f in files if _served(f))
    if not ggufs:
        raise ModelNotFound(f"{repo} has no GGUF file{f' of tag {tag}' if tag else ''} and no safetensors "
                            "weights with a config.json")
    models: dict[str, list[str]] = {}  # a model's files by its name without the split suffix
    for f in sorted(ggufs):
        models.setdefault(SPLIT_SUFFIX.sub("", f.removesuffix(".gguf")), []).append(f)
    tags: dict[str, list[str]] = {}
    for name, parts in models.items():
        tags.setdefault(quant_tag(parts[0]), []).append(name)
    wanted = (tag or DEFAULT_TAG).upper()
    if wanted in tags:
        names = tags[wanted]
    elif tag is None and len(models) == 1:
        names = list(models)
    else:
        asked = f"no GGUF of tag {tag}" if tag else f"several GGUF models and none of tag {DEFAULT_TAG}"
        raise ModelNotFound(f"{repo} has {asked}: name one as {repo}:TAG, TAG one of "
                            f"{', '.join(sorted(tags))}")
    if len(names) > 1:
        raise ModelNotFound(f"{repo}: tag {wanted} names several GGUF models ({', '.join(names)})")
    parts = models[names[0]]
    split = SPLIT_SUFFIX.search(parts[0].removesuffix(".gguf"))
    if split and [SPLIT_SUFFIX.search(p.removesuffix(".gguf"))[1] for p in parts] != [
            f"{i:05d}" for i in range(1, int(split[2]) + 1)]:
        raise ModelNotFound(f"{repo}: the split GGUF {names[0]} lacks parts of its {int(split[2])}")
    return parts


def _served(path: str) -> bool:
    parts = PurePosixPath(path).parts
    name = parts[-1]
    if len(parts) == 2 and MODULE_FOLDER.match(parts[0]):
        return name.endswith(".json")
    return len(parts) == 1 and (name.endswith(SERVED_SUFFIXES) or name in SERVED_FILES)


def _is_weights(path: str) -> bool:
    return path.endswith((".safetensors", ".gguf"))


def _indexed(snapshot: Path | None, weights: list[str]) -> list[str]:
    """The safetensors files the repo's index names, where it has one: a repo may also hold the
    same weights in another layout (Mistral's `consolidated.safetensors`), twice the download."""
    index = None if snapshot is None else snapshot / "model.safetensors.index.json"
    if index is None or not index.is_file():
        return weights
    named = set(json.loads(index.read_text())["weight_map"].values())
    return [f for f in weights if f in named]


def _listing(repo: str, options: HubOptions) -> tuple[str, dict[str, int]] | None:
    """The repo's commit and files (paths -> sizes) as the Hub lists them; None offline or
    where the Hub cannot be reached."""
    import httpx2  # huggingface_hub 2's HTTP library: its transport errors say "unreachable"
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if options.offline or constants.HF_HUB_OFFLINE:
        return None
    try:
        info = HfApi(token=options.token).model_info(repo, revision=options.revision or "main",
                                                     files_metadata=True)
    except GatedRepoError:
        raise ModelNotFound(f"{repo} is gated: accept its terms on the Hub and pass a token that "
                            "may read it (HF_TOKEN or --hf-token)") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"{repo} has no revision {options.revision}") from None
    except RepositoryNotFoundError as exc:
        raise ModelNotFound(_not_found(repo, exc.response.status_code, options)) from None
    except HFValidationError:
        raise ModelNotFound(f"Model not found: {repo} is neither a local path nor a Hub repo id") from None
    except HfHubHTTPError as exc:
        raise ModelNotFound(f"{repo}: the Hub answered {_first_line(exc)}") from None
    except (httpx2.TransportError, OfflineModeIsEnabled) as exc:
        log.warning("The Hub (%s) cannot be reached (%s): serving %s from the cache",
                    constants.ENDPOINT, exc, repo)
        return None
    return info.sha, {s.rfilename: s.size or 0 for s in info.siblings or []}


def _not_found(repo: str, status: int, options: HubOptions) -> str:
    if status not in (401, 403):
        return f"Model not found: {repo} is neither a local path nor a model on the Hub"
    from huggingface_hub import get_token  # HF_TOKEN, else the saved login

    if options.token or get_token():
        return f"{repo}: the Hub refused the token given (HTTP {status}): a private repo it may not read?"
    return (f"{repo}: the Hub answered HTTP {status}: a private or gated repo, or none of that name; "
            "pass a token that may read it (HF_TOKEN or --hf-token)")


def _cached(repo: str, tag: str | None, options: HubOptions) -> tuple[Path, dict[str, int]]:
    """The repo's cached snapshot folder and the files in it (paths -> sizes)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, revision=options.revision, cache_dir=options.download_dir,
                                        local_files_only=True))
    except IncompleteSnapshotError as exc:  # some of the repo's files cached: choose among them
        folder = Path(exc.snapshot_path)
    except LocalEntryNotFoundError:
        raise ModelNotFound(f"{repo}{':' + tag if tag else ''} is not in the cache "
                            f"({options.download_dir or _cache_dir()}) and the Hub is not asked "
                            "(offline) or cannot be reached") from None
    return folder, {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def _download(repo: str, files: list[str], options: HubOptions, commit: str, sizes: dict[str, int]) -> Path:
    """The snapshot folder, once each of `files` is in it (fetched where the cache lacks it)."""
    import httpx2
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per request: our own say more
    path = None
    for name in files:
        if not _in_cache(repo, name, commit, options):
            log.info("Downloading %s from %s (%.1f MiB)", name, repo, sizes[name] / 2**20)
        try:
            path = hf_hub_download(repo, name, revision=options.revision, cache_dir=options.download_dir,
                                   token=options.token)
        except (HfHubHTTPError, httpx2.TransportError, OSError) as exc:
            raise ModelNotFound(f"{repo}: downloading {name} failed ({_first_line(exc)}); "
                                "start again to resume it") from None
    return Path(path).parents[len(PurePosixPath(files[-1]).parts) - 1]


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _widening(snapshot: Path | None, weights: list[str], itemsize: int) -> float:
    """How much larger than stored safetensors weights are once loaded as floats of `itemsize`
    bytes (their stored type from config.json); a GGUF's blocks are kept as stored."""
    if snapshot is None or not weights[0].endswith(".safetensors"):
        return 1.0
    config = json.loads((snapshot / "config.json").read_text())
    config = config.get("text_config") or config
    stored = {"float32": 4, "float16": 2, "bfloat16": 2}.get(config.get("dtype") or config.get("torch_dtype"), itemsize)
    return itemsize / stored


def _check_memory(name: str, needed: float) -> None:
    from freetoken.paths import available_memory

    available = available_memory()
    if available is not None and needed > available:
        raise ModelNotFound(f"{name}: its weights need at least {needed / 2**30:.2f} GiB of memory once loaded, "
                            f"but {available / 2**30:.2f} GiB is available; nothing was downloaded "
                            "(a smaller model or quantization?)")


def _in_cache(repo: str, path: str, commit: str, options: HubOptions) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, path, cache_dir=options.download_dir, revision=commit), str)


def _check_disk(repo: str, options: HubOptions, needed: int) -> None:
    """Refuse a download (`needed` bytes) the cache's disk cannot hold."""
    folder = Path(options.download_dir or _cache_dir())
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ModelNotFound(f"{repo}: its files take {needed / 2**30:.2f} GiB but {folder} has "
                            f"{free / 2**30:.2f} GiB free (--download-dir picks another disk)")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
