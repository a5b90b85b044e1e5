"""What vLLM's pooling flags and a folder's sentence-transformers files make of a model
(serving/pooling/config.py)."""

from __future__ import annotations

import json

import pytest

from freetoken.serving.launch.args import parse_args
from freetoken.config import PoolingConfig
from freetoken.serving.pooling.config import pooling_config

HF = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}
RERANKER = json.dumps({"architectures": ["Qwen3ForSequenceClassification"],
                       "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True})


def _st_folder(tmp_path, mode: str, normalize: bool):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": mode == "cls",
         "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_lasttoken": mode == "last"}))
    return tmp_path


def test_a_plain_model_generates(tmp_path):
    assert pooling_config("auto", "auto", None, None, HF, tmp_path) is None


def test_the_qwen3_reranker_overrides_make_a_reranker(tmp_path):
    for runner in ("auto", "pooling"):
        got = pooling_config(runner, "auto", RERANKER, "T", HF, tmp_path)
        assert got == PoolingConfig("classify", ("no", "yes"), "T")


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_embedding_pooling_is_read_from_the_folder(tmp_path, mode):
    got = pooling_config("pooling", "auto", None, None, HF, _st_folder(tmp_path, mode, mode != "cls"))
    assert (got.task, got.pooling, got.normalize, got.hidden_size) == ("embed", mode, mode != "cls", 64)
    assert got.matryoshka_dimensions is None


def test_matryoshka_is_declared_by_the_config(tmp_path):
    assert pooling_config("pooling", "embed", '{"is_matryoshka": true}', None, HF,
                          tmp_path).matryoshka_dimensions == ()
    got = pooling_config("pooling", "embed", None, None, {**HF, "matryoshka_dimensions": [32, 64]},
                         tmp_path)
    assert got.matryoshka_dimensions == (32, 64)


@pytest.mark.parametrize("runner,convert,overrides", [
    ("pooling", "classify", None),  # no label tokens
    ("pooling", "classify", '{"classifier_from_token": ["yes"]}'),
    ("generate", "embed", None),
])
def test_flags_that_do_not_fit_are_refused(tmp_path, runner, convert, overrides):
    with pytest.raises(ValueError):
        pooling_config(runner, convert, overrides, None, HF, tmp_path)


def test_flags_parse():
    args = parse_args(["--runner", "pooling", "--convert", "classify", "--hf-overrides", RERANKER,
                       "--chat-template", "x.jinja"])
    assert (args.runner, args.convert, args.hf_overrides, args.chat_template) == \
        ("pooling", "classify", RERANKER, "x.jinja")
    for bad in (["--hf-overrides", "[1]"], ["--hf-overrides", "{"],
                ["--runner", "generate", "--chat-template", "x"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
