"""The ``minivllm`` command line on a tiny model: generate, chat and help."""

from __future__ import annotations

import io

import pytest

from minivllm.cli import main


def test_help_lists_the_commands(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "chat", "bench", "download"):
        assert cmd in out


@pytest.mark.parametrize("name", ["latency", "throughput", "kernels", "prefill", "llamacpp"])
def test_every_documented_benchmark_is_a_bench_choice(name, capsys) -> None:
    """``minivllm bench NAME --help`` reaches NAME's own parser (the CLI once refused latency)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_generate_prints_text_and_throughput(tiny_model_dir, capsys) -> None:
    model = str(tiny_model_dir("llama"))
    assert main(["generate", "hello", "--model", model, "--device", "cpu", "--max-tokens", "4",
                 "--backend", "ref"]) == 0
    out = capsys.readouterr().out
    assert "### hello" in out and "output tokens/s" in out


def test_chat_streams_and_quits(tiny_model_dir, monkeypatch, capsys) -> None:
    model = str(tiny_model_dir("llama"))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n/quit\n"))
    assert main(["chat", "--model", model, "--device", "cpu", "--max-tokens", "5",
                 "--backend", "ref"]) == 0
    out = capsys.readouterr().out
    assert "[5 tokens" in out


def test_bad_sampling_value_is_a_clear_error(tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="top_p"):
        main(["generate", "x", "--model", model, "--device", "cpu", "--top-p", "2"])


def test_lora_modules_take_both_of_vllms_forms() -> None:
    from minivllm.entrypoints.openai.cli_args import parse_lora_module

    assert parse_lora_module("sql=/a/sql", "base") == ("sql", "/a/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a/sql"}', "base") == ("sql", "/a/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "base"}',
                             "base") == ("sql", "/a/sql")
    for bad, why in (("sql", "name=path"), ('{"name": "sql"}', "non-empty name and path"),
                     ('{"name": "s", "path": "p", "rank": 4}', "keys name, path"),
                     ('{"name": "s", "path": "p", "base_model_name": "other"}', "served model"),
                     ("{oops", "not JSON")):
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad, "base")


def test_serve_help_lists_the_tool_calling_flags(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    for flag in ("--enable-auto-tool-choice", "--tool-call-parser", "--tool-parser-plugin",
                 "--exclude-tools-when-tool-choice-none"):
        assert flag in out
    assert "hermes, llama3_json" in out


def test_tool_call_flags_are_checked_before_the_model_loads(tmp_path) -> None:
    """A bad parser name stops ``serve`` at once, naming the parsers (no model is read:
    the model path does not even exist)."""
    missing = str(tmp_path / "no-model")
    for flags, why in ((["--enable-auto-tool-choice", "--tool-call-parser", "x"],
                        "choose from hermes, llama3_json"),
                       (["--enable-auto-tool-choice"], "requires --tool-call-parser"),
                       (["--tool-parser-plugin", "p.py"], "needs --tool-call-parser")):
        with pytest.raises(SystemExit, match=why):
            main(["serve", missing, "--device", "cpu", *flags])


def test_logits_processors_flag_reaches_the_engine(tiny_model_dir, capsys) -> None:
    """``--logits-processors pkg.module:Class`` is loaded by the engine; a bad path is an
    error naming logits_processors, and serve's --help documents the flag."""
    model = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="logits_processors"):
        main(["generate", "hello", "--model", model, "--device", "cpu", "--max-tokens", "2",
              "--backend", "ref", "--logits-processors", "math:pi"])
    assert main(["generate", "hello", "--model", model, "--device", "cpu", "--max-tokens", "2",
                 "--backend", "ref", "--logits-processors",
                 "test_logits_processors:Recorder"]) == 0
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--logits-processors" in capsys.readouterr().out
