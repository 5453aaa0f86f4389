"""The base install (no extras) generates and serves; training and plots say which extra they need.

A subprocess stands in for an environment without the extras: it marks their packages (and the dev
ones) as not installed before infer is imported, so any import of them fails as it would there.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers import wait_serving
from infer import LLM, SamplingParams
from infer.bench.serving import write_serving_report

NOT_INSTALLED = ("tqdm", "matplotlib", "transformers", "scipy", "accelerate", "pytest")
RUN_WITHOUT_EXTRAS = ("import sys\n"
                      f"for name in {NOT_INSTALLED!r}:\n    sys.modules[name] = None\n"
                      "from infer.cli import main\nsys.exit(main(sys.argv[1:]))\n")
PROMPT = "def add(a, b):"


def without_extras(*argv: str) -> list[str]:
    return [sys.executable, "-c", RUN_WITHOUT_EXTRAS, *argv]


def test_the_stand_in_really_hides_a_package() -> None:
    """Negative control: under the stand-in, importing a hidden package fails."""
    proc = subprocess.run([sys.executable, "-c", RUN_WITHOUT_EXTRAS.replace("from infer.cli import main\n", "import tqdm\n")
                           .replace("sys.exit(main(sys.argv[1:]))\n", "")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_generate_without_extras(tiny_llama: Path) -> None:
    proc = subprocess.run(without_extras("generate", "--model", str(tiny_llama), "--prompt", PROMPT, "--dtype",
                                         "float32", "--device", "cpu", "--max-tokens", "8", "--temperature", "0",
                                         "--ignore-eos", "--json"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    expected = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert json.loads(proc.stdout)["token_ids"] == expected.token_ids


def test_serve_without_extras(tiny_llama: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(without_extras("serve", "--model", str(tiny_llama), "--dtype", "float32", "--device",
                                           "cpu", "--port", str(port)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(proc, port)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_train_without_its_extra_names_it(tmp_path: Path) -> None:
    proc = subprocess.run(without_extras("train", "pretrain", "--out", str(tmp_path / "m"), "--max-steps", "1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'infer[train]'" in proc.stderr


def test_bench_report_without_plotting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON and the table are written without matplotlib; the plot is left out, saying why."""
    level = {"concurrency": 1, "throughput_tok_s": 10.0, "ttft_ms": {}, "itl_ms": {}, "tpot_ms": {}, "errors": 0}
    report = {"runs": [{"label": "speculation off", "levels": [level]}]}
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = write_serving_report(report, tmp_path)
    assert [p.name for p in paths] == ["serving.json", "serving.md"]
    assert json.loads(paths[0].read_text()) == report
    assert "pip install 'infer[bench]'" in capsys.readouterr().err
