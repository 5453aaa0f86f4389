"""The ``infer generate`` command: JSON output, streaming, chat, flag validation, console entry."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from infer import LLM, SamplingParams
from infer.cli import HelpFormatter, build_parser, main, model_sampling
from infer.engine.config import EngineConfig
from infer.engine.options import engine_options

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPT = "class Foo:\n    def __init__(self, x):"
MAX_TOKENS = 12


def generate_args(model: Path, *extra: str, prompt: str = PROMPT) -> list[str]:
    return ["generate", "--model", str(model), "--prompt", prompt, "--dtype", "float32", "--device", "cpu",
            "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--ignore-eos", *extra]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu")


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_json_output(tiny_llama: Path, llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(generate_args(tiny_llama, "--json")) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1, captured.out
    result = json.loads(lines[0])
    assert {"text", "token_ids", "finish_reason", "metrics"} <= set(result)
    expected = llm.generate(PROMPT, greedy())[0]
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == expected.text
    assert result["finish_reason"] == "length"
    assert result["metrics"]["generated_tokens"] == MAX_TOKENS
    assert result["metrics"]["prompt_tokens"] == len(llm.tokenizer.encode(PROMPT))


def test_streaming_output(tiny_llama: Path, llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(generate_args(tiny_llama)) == 0
    captured = capsys.readouterr()
    expected = llm.generate(PROMPT, greedy())[0]
    assert captured.out == expected.text
    summary = [line for line in captured.err.splitlines() if line.startswith("[infer]") and "tokens" in line]
    assert summary, captured.err
    assert f"{MAX_TOKENS} tokens" in summary[-1] and "finish=length" in summary[-1]


def test_stop_string(tiny_llama: Path, llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    full = llm.generate(PROMPT, greedy())[0].text
    stop = full[4:7]
    assert main(generate_args(tiny_llama, "--json", "--stop", stop)) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["finish_reason"] == "stop"
    assert result["text"] == full[: full.find(stop)]


def test_streamed_text_never_shows_part_of_a_stop_string(tiny_llama: Path, llm: LLM,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Streaming must print exactly the final text, even when a stop string spans tokens."""
    prompt_ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate([prompt_ids], greedy())[0]
    texts = [llm.tokenizer.decode(out.token_ids[:k]) for k in range(len(out.token_ids) + 1)]
    candidates = []
    for k in range(1, len(texts) - 1):  # the last char of token k-1's text + the first char of token k's
        cut = len(texts[k])
        stop = texts[k + 1][cut - 1: cut + 1]
        if (cut > len(texts[k - 1]) and len(texts[k + 1]) > cut and stop.isascii() and stop.isprintable()
                and texts[k + 1].find(stop) == cut - 1):
            candidates.append(stop)
    assert candidates, texts
    stop = candidates[0]
    stopped = llm.generate([prompt_ids], greedy(stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert main(generate_args(tiny_llama, "--stop", stop)) == 0
    assert capsys.readouterr().out == stopped.text


def test_chat_flag(tiny_llama: Path, llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(generate_args(tiny_llama, "--json", "--chat", prompt="Hello there")) == 0
    result = json.loads(capsys.readouterr().out)
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
    assert result["metrics"]["prompt_tokens"] == len(ids)
    assert result["token_ids"] == llm.generate([ids], greedy())[0].token_ids


def test_slotted_backend_flag(tiny_llama: Path, llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(generate_args(tiny_llama, "--json", "--kv-cache-backend", "slotted")) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == llm.generate(PROMPT, greedy())[0].token_ids


def test_exact_greedy_flag(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--exact-greedy sets EngineConfig.exact_greedy, and a bfloat16 n-gram run with it works."""
    def config(*extra: str) -> EngineConfig:
        return EngineConfig.from_options(**engine_options(build_parser().parse_args(generate_args(tiny_llama, *extra))))

    assert config("--exact-greedy").exact_greedy and not config().exact_greedy
    args = generate_args(tiny_llama, "--json", "--exact-greedy", "--speculator", "ngram", "--dtype", "bfloat16")
    assert main(args) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == MAX_TOKENS


@pytest.mark.parametrize(("flag", "value", "field"), [
    ("--top-p", "2", "top_p"),
    ("--temperature", "-1", "temperature"),
    ("--max-tokens", "0", "max_tokens"),
    ("--top-k", "-3", "top_k"),
])
def test_bad_flag_value_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  flag: str, value: str, field: str) -> None:
    # A model path that does not exist: the flag must be rejected before any model load.
    args = generate_args(tmp_path / "no_model", flag, value)
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert field in err and "no_model" not in err


def test_unparsable_flag_exits_2(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(generate_args(tiny_llama, "--top-p", "high"))
    assert exit_.value.code == 2
    assert "--top-p" in capsys.readouterr().err


def test_missing_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(generate_args(tmp_path / "no_model")) == 2
    assert "no_model" in capsys.readouterr().err


def test_console_entry_subprocess(tiny_llama: Path, llm: LLM) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "infer.cli", *generate_args(tiny_llama, "--json")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["token_ids"] == llm.generate(PROMPT, greedy())[0].token_ids


def test_every_command_takes_the_engine_options_with_the_engines_defaults() -> None:
    """The option registry: each command that loads a model declares every model flag, and with no flags
    given each builds the engine's default config (a flag's default can never drift from EngineConfig's)."""
    from infer.engine.options import MODEL_OPTIONS, OPTIONS, SERVING_OPTIONS, engine_config
    from infer.loader.hub import DEFAULT_MODEL

    default = EngineConfig.from_options(model=DEFAULT_MODEL)
    commands = {"generate": ["--prompt", "x"], "chat": [], "audit": [], "serve": []}
    for command, required in commands.items():
        args = build_parser().parse_args([command, *required])
        assert set(MODEL_OPTIONS) <= set(vars(args)), command
        assert engine_config(args) == default, command
    serve = build_parser().parse_args(["serve", "--max-batch-size", "3", "--no-chunked-prefill", "--speculator",
                                       "ngram", "--spec-length", "7"])
    config = engine_config(serve)
    assert (config.max_batch_size, config.chunked_prefill) == (3, False)
    assert config.speculative is not None and (config.speculative.speculator, config.speculative.spec_length) == ("ngram", 7)
    assert set(SERVING_OPTIONS) <= set(vars(serve))
    # Every registered option is something EngineConfig.from_options takes.
    for name in OPTIONS:
        EngineConfig.from_options(**{"model": "m", name: OPTIONS[name].default()})


def test_every_config_field_is_a_flag() -> None:
    """SpeculativeConfig's and EngineConfig's docstrings promise each field is the flat option of the
    same name: each is registered and declared by every command that loads a model or serves."""
    from dataclasses import fields

    from infer.engine.config import SpeculativeConfig
    from infer.engine.options import MODEL_OPTIONS, OPTIONS, SERVING_OPTIONS, engine_config

    names = {f.name for f in (*fields(SpeculativeConfig), *fields(EngineConfig))} - {"speculative"}
    assert names <= set(OPTIONS), names - set(OPTIONS)
    assert names <= set(MODEL_OPTIONS) | set(SERVING_OPTIONS)
    serve = build_parser().parse_args(["serve", "--ngram-max", "6", "--entropy-threshold", "0.3",
                                       "--speculator", "ngram"])
    config = engine_config(serve)
    assert config.speculative is not None
    assert (config.speculative.ngram_max, config.speculative.entropy_threshold) == (6, 0.3)


def test_renamed_flag_still_works_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="--speculative-decoding is now --speculate"):
        args = build_parser().parse_args(["serve", "--speculative-decoding", "--speculator", "ngram"])
    assert args.speculate
    assert not build_parser().parse_args(["serve"]).speculate


def test_structured_output_flags(tiny_llama: Path, llm: LLM, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json-schema (text or @file), --regex: the same tokens as SamplingParams.structured_output."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    for flag, value, spec in (("--json-schema", "@" + str(tmp_path / "schema.json"), {"json": schema}),
                              ("--regex", "[ab]+c", {"regex": "[ab]+c"})):
        assert main(generate_args(tiny_llama, "--json", flag, value, "--presence-penalty", "0.5")) == 0
        result = json.loads(capsys.readouterr().out)
        expected = llm.generate(PROMPT, greedy(structured_output=spec, presence_penalty=0.5))[0]
        assert result["token_ids"] == expected.token_ids
        if flag == "--regex" and expected.finish_reason == "stop":
            assert expected.text.rstrip("c").strip("ab") == ""


def test_invalid_grammar_flag_exits_2_naming_it(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(generate_args(tiny_llama, "--regex", "((")) == 2
    assert "structured_output.regex is invalid" in capsys.readouterr().err


def test_generate_and_chat_default_to_the_models_suggested_sampling_else_greedy(
        tiny_llama: Path, llm: LLM, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The tiny model's generation_config.json does not sample: greedy, for both commands.
    plain = ["generate", "--model", str(tiny_llama), "--prompt", PROMPT, "--dtype", "float32", "--device", "cpu",
             "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    assert main([*plain, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == llm.generate(PROMPT, greedy())[0].token_ids
    for command in (["generate", "--prompt", "x"], ["chat"]):
        params, how = model_sampling(build_parser().parse_args([*command, "--model", str(tiny_llama)]))
        assert params.greedy and "suggests none: its generation_config.json does not sample" in how
    # A folder whose generation_config.json samples: its keys, the rest SamplingParams' own; a flag wins.
    sampled = tmp_path / "sampled"
    shutil.copytree(tiny_llama, sampled)
    config = json.loads((sampled / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=20)
    (sampled / "generation_config.json").write_text(json.dumps(config))
    params, how = model_sampling(build_parser().parse_args(["chat", "--model", str(sampled)]))
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.9, 20, 0.0)
    assert "temperature=0.6, top_k=20, top_p=0.9 from its generation_config.json" in how
    params, how = model_sampling(build_parser().parse_args(["generate", "--prompt", "x", "--model", str(sampled),
                                                            "--temperature", "0"]))
    assert params.greedy and params.top_p == 0.9 and how.startswith("sampling: greedy (top_k=20, top_p=0.9")
    # A GGUF file's general.sampling.* keys (llama.cpp's), read from its metadata.
    path = tmp_path / "sampled.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value("general.sampling.temp", 0.8, gguf.GGUFValueType.FLOAT32)
    writer.add_key_value("general.sampling.min_p", 0.05, gguf.GGUFValueType.FLOAT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params, how = model_sampling(build_parser().parse_args(["chat", "--model", str(path)]))
    assert (params.temperature, round(params.min_p, 6), params.top_p) == (pytest.approx(0.8), 0.05, 1.0)
    assert "from its GGUF general.sampling.* keys" in how


def test_help_shows_every_default_and_no_rest_literals(capsys: pytest.CaptureFixture[str]) -> None:
    def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    found += parsers(child)
        return found

    for parser in parsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text, parser.prog
        formatter = parser._get_formatter()
        assert isinstance(formatter, HelpFormatter), parser.prog
        for action in parser._actions:
            if action.option_strings and action.default is not argparse.SUPPRESS and not action.required:
                shown = formatter._format_action(action)
                assert "default" in shown.lower(), (parser.prog, action.option_strings, shown)
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()  # type: ignore[union-attr]
    assert "--temperature TEMPERATURE" in help_text and "else 0: greedy)" in help_text.replace("\n", " ")
