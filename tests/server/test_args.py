"""Flags, and `auto` parser resolution from a model's vocabulary and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from freetoken.server.args import parse_args, resolve_parsers


def test_defaults_and_positional_model():
    args = parse_args(["/models/x"])
    assert (args.model, args.host, args.port, args.max_logprobs) == ("/models/x", "127.0.0.1", 1919, 20)
    assert parse_args([]).model is None
    with pytest.raises(SystemExit):
        parse_args(["a", "--model", "b"])


def test_auto_picks_qwen3_and_hermes_on_the_qwen_vocabulary(qwen35_tokenizer):
    assert resolve_parsers(parse_args([]), qwen35_tokenizer) == ("qwen3", "hermes")
    off = parse_args(["--reasoning-parser", "off", "--tool-call-parser", "qwen3_coder"])
    assert resolve_parsers(off, qwen35_tokenizer) == (None, "qwen3_coder")


def test_auto_picks_gpt_oss_for_harmony(tiny_harmony_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_harmony_path)
    assert resolve_parsers(parse_args([]), tok) == ("gpt_oss", "gpt_oss")


def test_auto_picks_nothing_without_single_id_markers():
    from tests.model_fixtures import default_folder

    tok = AutoTokenizer.from_pretrained(default_folder())
    assert resolve_parsers(parse_args([]), tok) == (None, None)
