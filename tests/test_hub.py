"""Models by Hub name (hub.py): which files a name picks, and resolve_model run by the real
huggingface_hub client against a Hub on 127.0.0.1 (tests/support/fake_hub.py), in a process of
its own (huggingface_hub reads HF_ENDPOINT and HF_HOME when it is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from freetoken.hub import choose_files, hub_name, quant_tag
from freetoken.paths import ModelNotFound
from tests.support.fake_hub import FakeHub
from tests.support.servers import ROOT

# File lists as released repos have them (sizes made up).
UNSLOTH = {"README.md": 1, "Qwen3-8B-Q4_K_M.gguf": 5, "Qwen3-8B-UD-Q4_K_XL.gguf": 5, "Qwen3-8B-Q8_0.gguf": 9,
           "Qwen3-8B-BF16.gguf": 16, "mmproj-F16.gguf": 1,
           **{f"Q4_K_M/Qwen3-8B-Q4_K_M-0000{i}-of-00002.gguf": 3 for i in (1, 2)}}
SPLIT = {f"BF16/gpt-oss-120b-BF16-0000{i}-of-00003.gguf": 3 for i in (1, 2, 3)} | {
    "gpt-oss-120b-MXFP4_MOE.gguf": 7, "gpt-oss-120b-q4_k_m.gguf": 6}
SAFETENSORS = {"config.json": 1, "generation_config.json": 1, "tokenizer.json": 1, "tokenizer_config.json": 1,
               "merges.txt": 1, "vocab.json": 1, "chat_template.jinja": 1, "model.safetensors.index.json": 1,
               "model-00001-of-00002.safetensors": 9, "model-00002-of-00002.safetensors": 9, "README.md": 1,
               "original/consolidated.pth": 20, "original/params.json": 1, "pytorch_model.bin": 20,
               "onnx/model.onnx": 20, "1_Pooling/config.json": 1, "modules.json": 1, "LICENSE": 1}


def test_file_names_carry_their_quantization_tag():
    assert quant_tag("Qwen3-8B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_tag("Qwen3-8B-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert quant_tag("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert quant_tag("Q4_K_M/Qwen3-30B-A3B-Q4_K_M-00001-of-00003.gguf") == "Q4_K_M"
    assert quant_tag("qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf") == "Q4_K_M"
    assert quant_tag("gpt-oss-20b-MXFP4.gguf") == "MXFP4"
    assert quant_tag("Qwen3-30B-A3B-IQ4_XS.gguf") == "IQ4_XS"
    assert quant_tag("model.gguf") == "model"


def test_a_tag_picks_its_file_any_case_and_no_tag_picks_q4_k_m():
    assert choose_files("u/Qwen3-8B-GGUF", UNSLOTH, "q8_0") == ["Qwen3-8B-Q8_0.gguf"]
    assert choose_files("u/Qwen3-8B-GGUF", UNSLOTH, "UD-Q4_K_XL") == ["Qwen3-8B-UD-Q4_K_XL.gguf"]
    with pytest.raises(ModelNotFound, match="tag Q4_K_M names several GGUF models"):
        choose_files("u/Qwen3-8B-GGUF", UNSLOTH, None)  # a whole file and a split one of that tag
    assert choose_files("u/r", {k: v for k, v in UNSLOTH.items() if "/" not in k}, None) == ["Qwen3-8B-Q4_K_M.gguf"]
    assert choose_files("u/r", {"tiny-F16.gguf": 1, "mmproj-F16.gguf": 1}, None) == ["tiny-F16.gguf"]


def test_a_split_model_is_all_its_parts_in_order():
    assert choose_files("u/gpt-oss", SPLIT, "bf16") == [f"BF16/gpt-oss-120b-BF16-0000{i}-of-00003.gguf"
                                                         for i in (1, 2, 3)]
    assert choose_files("u/gpt-oss", SPLIT, "MXFP4_MOE") == ["gpt-oss-120b-MXFP4_MOE.gguf"]
    assert choose_files("u/gpt-oss", SPLIT, None) == ["gpt-oss-120b-q4_k_m.gguf"]
    partial = {k: v for k, v in SPLIT.items() if "00002-of" not in k}
    with pytest.raises(ModelNotFound, match="lacks parts of its 3"):
        choose_files("u/gpt-oss", partial, "BF16")


def test_a_missing_tag_or_an_ambiguous_repo_lists_the_tags():
    with pytest.raises(ModelNotFound, match=r"u/gpt-oss has no GGUF of tag Q2_K: name one as u/gpt-oss:TAG, "
                       r"TAG one of BF16, MXFP4_MOE, Q4_K_M$"):
        choose_files("u/gpt-oss", SPLIT, "Q2_K")
    with pytest.raises(ModelNotFound, match="several GGUF models and none of tag Q4_K_M.*TAG one of F16, Q8_0"):
        choose_files("u/r", {"a-Q8_0.gguf": 1, "a-F16.gguf": 1}, None)
    with pytest.raises(ModelNotFound, match="no GGUF file and no safetensors weights"):
        choose_files("u/r", {"README.md": 1, "pytorch_model.bin": 1}, None)


def test_a_safetensors_repo_gives_what_serving_reads_and_nothing_else():
    assert choose_files("o/m", SAFETENSORS, None) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
         "vocab.json", "chat_template.jinja", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
         "model-00002-of-00002.safetensors", "1_Pooling/config.json", "modules.json"])


def test_a_local_path_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_name("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert hub_name("hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M") == ("unsloth/Qwen3-8B-GGUF", "Q4_K_M")
    (tmp_path / "Qwen").mkdir()
    (tmp_path / "Qwen" / "Qwen3-8B").mkdir()
    assert hub_name("Qwen/Qwen3-8B") is None
    assert hub_name("/models/x.gguf") is None and hub_name(None) is None


RESOLVE = """
import json, sys
from freetoken.hub import HubOptions, resolve_model
from freetoken.paths import ModelNotFound
try:
    print(json.dumps(resolve_model(sys.argv[1], HubOptions(**json.loads(sys.argv[2])), json.loads(sys.argv[3]))))
except ModelNotFound as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.fixture
def hub(tmp_path):
    hub = FakeHub()
    yield hub
    hub.close()


def resolve(hub: FakeHub, home, name: str, itemsize: int | None = 4, **options) -> list | dict:
    """resolve_model(name) in a new process whose huggingface_hub talks to `hub`, caching in `home`
    (`itemsize`: as a float32 model on the CPU; None, no memory check, as on CUDA)."""
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(home), PYTHONPATH=str(ROOT / "python"))
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    done = subprocess.run([sys.executable, "-c", RESOLVE, name, json.dumps(options), json.dumps(itemsize)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def repo_files() -> dict[str, bytes]:
    """A safetensors repo whose files are bytes of known content, beside files serving never reads
    (its weights also as Mistral's `consolidated.safetensors`, which the index does not name)."""
    files = {name: f"{name}:{i}".encode() * (1000 if name.endswith(".safetensors") else 1)
             for i, name in enumerate(SAFETENSORS)}
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    return files | {"config.json": json.dumps({"dtype": "bfloat16"}).encode(),
                    "model.safetensors.index.json": json.dumps(index).encode(),
                    "consolidated.safetensors": b"\0" * 4096}


def test_only_the_files_serving_reads_are_downloaded_then_read_from_the_cache(hub, tmp_path):
    files = repo_files()
    hub.add("o/m", files)
    path, name = resolve(hub, tmp_path, "o/m")
    assert name == "o/m" and hub.downloaded("o/m") == choose_files("o/m", SAFETENSORS, None)
    assert "consolidated.safetensors" in choose_files("o/m", {**SAFETENSORS, "consolidated.safetensors": 9}, None)
    for f in hub.downloaded("o/m"):
        assert (tmp_path / "hub" / "models--o--m").exists() and open(f"{path}/{f}", "rb").read() == files[f]
    hub.requests.clear()
    assert resolve(hub, tmp_path, "o/m") == [path, "o/m"]
    assert not hub.downloaded("o/m")  # the cache's files, the Hub asked only for the listing
    hub.close()
    assert resolve(hub, tmp_path, "o/m") == [path, "o/m"]  # the Hub gone: the cache alone


def test_a_revision_is_asked_for_and_kept_in_the_cache(hub, tmp_path):
    hub.add("o/m", repo_files())
    path, _ = resolve(hub, tmp_path, "o/m", revision="v1.0")
    assert ("GET", "/api/models/o/m/revision/v1.0") in hub.requests
    assert {p for m, p in hub.requests if m == "GET" and "/resolve/" in p} == {
        f"/o/m/resolve/v1.0/{f}" for f in hub.downloaded("o/m")}
    storage = tmp_path / "hub" / "models--o--m"
    assert (storage / "refs" / "v1.0").read_text() == hub.commit("o/m") and path.endswith(hub.commit("o/m"))
    hub.close()
    assert resolve(hub, tmp_path, "o/m", revision="v1.0")[0] == path  # the cache knows the revision
    assert "is not in the cache" in resolve(hub, tmp_path, "o/m", revision="v2")["error"]


def test_a_dropped_download_resumes_and_one_that_fails_leaves_no_part_behind(hub, tmp_path):
    files = repo_files()
    weights = "model-00002-of-00002.safetensors"
    files[weights] = bytes(range(256)) * (12 << 12)  # 12 MiB
    hub.add("o/m", files)
    # huggingface_hub writes in 10 MiB chunks and asks again from the last one it wrote.
    hub.cut(weights, after=11 << 20, times=1)
    path, _ = resolve(hub, tmp_path / "a", "o/m")
    assert hub.ranges[-2:] == [0, 10 << 20] and open(f"{path}/{weights}", "rb").read() == files[weights]
    hub.cut(weights, after=4000, times=100)  # a drop that outlasts its retries
    error = resolve(hub, tmp_path / "b", "o/m")["error"]
    assert error.startswith(f"o/m: downloading {weights} failed (") and error.endswith("start again to resume it")
    assert "\n" not in error
    assert not [p.name for p in (tmp_path / "b").rglob("*") if weights in p.name or p.suffix == ".incomplete"]
    hub.cuts.clear()
    path, _ = resolve(hub, tmp_path / "b", "o/m")
    assert open(f"{path}/{weights}", "rb").read() == files[weights]


def test_a_model_that_cannot_fit_is_refused_before_its_weights_download(hub, tmp_path):
    hub.add("o/m", repo_files(), sizes={"model-00001-of-00002.safetensors": 1 << 44})
    error = resolve(hub, tmp_path, "o/m")["error"]
    # bfloat16 weights held as float32: twice the 16 TiB the listing claims.
    assert error.startswith("o/m: its weights need at least 32768.00 GiB of memory once loaded, but ")
    assert "nothing was downloaded" in error and not any(f.endswith(".safetensors") for f in hub.downloaded("o/m"))


def test_a_download_the_disk_cannot_hold_is_refused_before_it_starts(hub, tmp_path):
    hub.add("o/m-GGUF", {"m-Q4_K_M.gguf": b"GGUF"}, sizes={"m-Q4_K_M.gguf": 1 << 60})
    error = resolve(hub, tmp_path, "o/m-GGUF", itemsize=None)["error"]
    assert error.startswith(f"o/m-GGUF: its files take {2**30:.2f} GiB but {tmp_path} has ")
    assert error.endswith(" GiB free (--download-dir picks another disk)") and not hub.downloaded("o/m-GGUF")


def test_refusals_by_the_hub_and_offline_misses_are_one_line_each(hub, tmp_path):
    hub.add("o/m", repo_files())
    hub.add("o/private", {"config.json": b"{}"})
    hub.private.add("o/private")
    assert resolve(hub, tmp_path, "o/private")["error"] == (
        "o/private: the Hub answered HTTP 401: a private or gated repo, or none of that name; pass a "
        "token that may read it (HF_TOKEN or --hf-token)")
    assert resolve(hub, tmp_path, "o/private", token="hf_wrong")["error"].startswith(
        "o/private: the Hub refused the token given (HTTP 401)")
    assert resolve(hub, tmp_path, "o/none")["error"] == (
        "Model not found: o/none is neither a local path nor a model on the Hub")
    assert resolve(hub, tmp_path, "o/m:Q4_K_M")["error"] == (
        "o/m has no GGUF file of tag Q4_K_M and no safetensors weights with a config.json")
    assert resolve(hub, tmp_path, "o/m", offline=True)["error"].startswith(
        f"o/m is not in the cache ({tmp_path / 'hub'}) and the Hub is not asked (offline) or cannot be reached")
    assert not hub.downloaded("o/m")
