"""Flags, and `auto` parser resolution from a model's vocabulary and chat template."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from freetoken.config import SpeculativeConfig, engine_config
from freetoken.serving.launch.args import build_parser, parse_args, resolve_parsers


def test_defaults_and_positional_model():
    args = parse_args(["/models/x"])
    assert (args.model, args.host, args.port, args.max_logprobs) == ("/models/x", "127.0.0.1", 1919, 20)
    assert parse_args([]).model is None
    with pytest.raises(SystemExit):
        parse_args(["a", "--model", "b"])


def test_shutdown_and_request_limits():
    args = parse_args([])
    assert (args.shutdown_timeout, args.max_request_bytes, args.max_prompts_per_request) == (
        30.0, 32 * 1024 * 1024, 1024)
    args = parse_args(["--shutdown-timeout", "2.5", "--max-request-bytes", "1000",
                       "--max-prompts-per-request", "8"])
    assert (args.shutdown_timeout, args.max_request_bytes, args.max_prompts_per_request) == (
        2.5, 1000, 8)


def test_every_option_has_a_help_sentence_and_a_default():
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"{name} has no help text"
        # What --help prints: "(default: ...)" from the formatter, or spelled out in the text.
        assert "(default: " in formatter._get_help_string(action), f"{name} shows no default"


def test_auto_picks_qwen3_and_hermes_on_the_qwen_vocabulary(qwen35_tokenizer):
    assert resolve_parsers(parse_args([]), qwen35_tokenizer) == ("qwen3", "hermes")
    off = parse_args(["--reasoning-parser", "off", "--tool-call-parser", "qwen3_coder"])
    assert resolve_parsers(off, qwen35_tokenizer) == (None, "qwen3_coder")


def test_auto_picks_gpt_oss_for_harmony(tiny_harmony_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_harmony_path)
    assert resolve_parsers(parse_args([]), tok) == ("gpt_oss", "gpt_oss")


@pytest.mark.slow
def test_auto_picks_nothing_without_single_id_markers():
    from tests.model_fixtures import default_folder

    tok = AutoTokenizer.from_pretrained(default_folder())
    assert resolve_parsers(parse_args([]), tok) == (None, None)


def test_tensor_parallel_flags_and_their_checks(capsys):
    args = parse_args(["-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                       "--master-port", "29600", "--distributed-backend", "gloo"])
    assert (args.tensor_parallel_size, args.nnodes, args.node_rank) == (4, 2, 1)
    assert (args.master_addr, args.master_port, args.distributed_backend) == ("10.0.0.1", 29600, "gloo")
    assert parse_args(["--tp-size", "2"]).tensor_parallel_size == 2
    assert parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    for bad in (["-tp", "3", "--nnodes", "2"], ["--nnodes", "2", "--node-rank", "2", "-tp", "2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "multiple of --nnodes" in capsys.readouterr().err


def test_speculative_config_is_checked_at_start_up(capsys):
    args = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config(args, "/m").speculative == SpeculativeConfig(num_speculative_tokens=3)
    assert engine_config(parse_args([]), "/m").speculative is None
    mtp = parse_args(["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
    assert engine_config(mtp, "/m").speculative == SpeculativeConfig(1, method="mtp")
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1}'])
    assert "method 'eagle' is not supported" in capsys.readouterr().err
