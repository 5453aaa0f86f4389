"""Helpers shared by several test modules (the checkpoints they run on live in ``checkpoints.py``).

* The exactness harness of the speculative paths (draft model, n-gram, Medusa, suffix): the exact
  target distribution of a short continuation of ``PROMPT`` on the V = 10 ``small_target`` (conftest),
  enumerated with plain transformers forward passes and the engine's own sampling transform, and the
  pooled chi-square tests that compare engine samples with it.
* Settings several drafters' end-to-end tests share: prompts, KV-cache backends, sampling configs.
* ``wait_serving``: wait for an ``infer serve`` subprocess to come up; ``slow_steps``: slow an engine's
  steps so a long request outlasts what a test does while it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import torch
from scipy.stats import chi2

from checkpoints import load_hf_model
from infer import SamplingParams
from infer.sampling.transforms import SamplingBatch, probs_from_logits, token_counts, token_presence

# ----------------------------------------------------------------------------- exactness harness

V = 10  # the vocabulary of the small_target / small_draft pair (conftest.py)
# Only four of the ten tokens, repeated: n-gram lookup finds a match whenever x1 is one of them,
# and the repetition penalty's context differs between continuations.
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
P_THRESHOLD = 1e-3  # a correct sampler fails a test at about this rate
P_CONTROL = 1e-6  # a broken one (negative controls) must score below this
MIN_EXPECTED = 5.0

# The sampling configs the exactness tests run; the tree drafters' (Medusa, suffix) run all but top-p,
# with fewer samples.
SAMPLING_CONFIGS: dict[str, dict[str, float | int]] = {
    "temperature_1": {"temperature": 1.0},
    "temperature_0.7_top_k_3": {"temperature": 0.7, "top_k": 3},
    "top_p_0.8": {"temperature": 1.0, "top_p": 0.8},
    "repetition_penalty_1.5": {"temperature": 1.0, "repetition_penalty": 1.5},
}
TREE_CONFIGS = {name: config for name, config in SAMPLING_CONFIGS.items() if name != "top_p_0.8"}
# OpenAI's presence/frequency penalties and a logit bias, strong enough to move the distribution.
PENALTY_CONFIG: dict[str, Any] = {"temperature": 1.0, "presence_penalty": 0.7, "frequency_penalty": 0.5,
                                  "logit_bias": {5: 1.0, 8: -0.8}}
TREE_NUM_SAMPLES = 4000


@dataclass
class Reference:
    """Exact target distributions after the sampling transform."""

    p1: np.ndarray  # [V]       P(x1 | prompt)
    p23: np.ndarray  # [V, V, V] P(x2, x3 | prompt, x1), indexed [x1, x2, x3]




@torch.no_grad()
def reference(model_path: Path, prompt: list[int], params: SamplingParams) -> Reference:
    """Enumerate every (x1, x2) continuation with plain transformers forward passes (no KV cache)."""
    model = load_hf_model(model_path)
    return reference_from(lambda contexts: model(torch.tensor(contexts)).logits[:, -1].float(), prompt, params)


@torch.no_grad()
def reference_from(last_logits: Callable[[list[list[int]]], torch.Tensor], prompt: list[int],
                   params: SamplingParams) -> Reference:
    """``reference`` for any model: ``last_logits(contexts)`` gives each context's next-token logits
    [N, V] (cache-free forward passes of equal-length contexts)."""

    def next_probs(contexts: list[list[int]]) -> torch.Tensor:
        logits = last_logits(contexts)
        batch = SamplingBatch.from_params([params] * len(contexts), "cpu")
        presence = token_presence(contexts, V, "cpu") if batch.use_penalty else None
        counts = token_counts([c[len(prompt):] for c in contexts], V, "cpu") if batch.use_counts else None
        probs = probs_from_logits(logits, batch, presence, counts=counts).double()
        return probs / probs.sum(dim=-1, keepdim=True)

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(V)])  # [x1, x2]
    p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)  # [x1, x2, x3]
    return Reference(p1.numpy(), (p2[:, :, None] * p3).numpy())


# ----------------------------------------------------------------------------- statistics


@dataclass
class ChiSquare:
    statistic: float
    dof: int
    impossible: int  # samples that fell on a zero-probability cell

    @property
    def pvalue(self) -> float:
        if self.impossible:
            return 0.0
        return float(chi2.sf(self.statistic, self.dof)) if self.dof else 1.0

    def __add__(self, other: ChiSquare) -> ChiSquare:
        return ChiSquare(self.statistic + other.statistic, self.dof + other.dof, self.impossible + other.impossible)


def chisquare_cells(counts: np.ndarray, probs: np.ndarray) -> ChiSquare:
    """Goodness of fit of ``counts`` to ``probs`` (same shape, any); cells expected < 5 are pooled."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    total = counts.sum()
    support = probs > 0
    impossible = int(counts[~support].sum())
    if total == 0:
        return ChiSquare(0.0, 0, impossible)
    observed = counts[support]
    expected = total * probs[support] / probs[support].sum()
    big = expected >= MIN_EXPECTED
    cells_o, cells_e = list(observed[big]), list(expected[big])
    small_o, small_e = observed[~big].sum(), expected[~big].sum()
    if small_e > 0:
        if small_e >= MIN_EXPECTED or not cells_e:
            cells_o.append(small_o)
            cells_e.append(small_e)
        else:  # too little mass for a cell of its own: fold into the smallest big cell
            i = int(np.argmin(cells_e))
            cells_o[i] += small_o
            cells_e[i] += small_e
    o, e = np.array(cells_o), np.array(cells_e)
    return ChiSquare(float(((o - e) ** 2 / e).sum()), len(cells_e) - 1, impossible)


def grouped_chisquare(samples: np.ndarray, ref: Reference) -> ChiSquare:
    """Sum over x1 groups of the (x2, x3) goodness of fit to P(x2, x3 | x1)."""
    result = ChiSquare(0.0, 0, 0)
    for x1 in range(V):
        group = samples[samples[:, 0] == x1]
        counts = np.zeros((V, V))
        np.add.at(counts, (group[:, 1], group[:, 2]), 1)
        result = result + chisquare_cells(counts, ref.p23[x1])
    return result


def first_token_chisquare(samples: np.ndarray, ref: Reference) -> ChiSquare:
    return chisquare_cells(np.bincount(samples[:, 0], minlength=V), ref.p1)


def generate_unseeded(llm: Any, prompts: list[Any], params: SamplingParams, seed: int) -> list[Any]:
    """``llm.generate`` with unseeded requests (the rejection sampler's path: a seeded request draws
    plain decoding's tokens) made reproducible: each request's generator is seeded from the global
    RNG, seeded here with ``seed`` (and restored after)."""
    assert params.seed is None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return list(llm.generate(prompts, params))


def assert_follows_reference(samples: np.ndarray, ref: Reference) -> None:
    """x1 and (x2, x3 | x1) both fit the exact distributions, and no sample is impossible."""
    first = first_token_chisquare(samples, ref)
    assert first.impossible == 0
    assert first.pvalue > P_THRESHOLD, f"x1: chi2={first.statistic:.1f}, dof={first.dof}"
    joint = grouped_chisquare(samples, ref)
    assert joint.impossible == 0, f"{joint.impossible} samples fell on zero-probability (x2, x3) cells"
    assert joint.dof >= 20  # enough cells for the test to mean something
    assert joint.pvalue > P_THRESHOLD, f"(x2, x3 | x1): chi2={joint.statistic:.1f}, dof={joint.dof}"


# ----------------------------------------------------------------------------- drafters end to end

# Prompts for the drafters' greedy token-identity tests on the tiny_llama checkpoint.
DRAFTER_PROMPTS = [
    "def parse(self, text):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def push(self, item):",
    "The quick brown fox",
    "for i in range(10):\n    print(",
]
KV_BACKENDS = {"paged": dict(kv_cache_backend="paged", block_size=4), "slotted": dict(kv_cache_backend="slotted")}


# ----------------------------------------------------------------------------- serving


def patched_python(patch: str, directory: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment (``env``, default this one) whose Python processes run ``patch`` at startup, as a
    ``sitecustomize`` module in ``directory``: how a test patches `infer serve`'s engine, which runs in
    a process of its own."""
    (directory / "sitecustomize.py").write_text(patch)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory), env.get("PYTHONPATH")) if p)
    return env


def slow_steps(engine: Any, monkeypatch: Any, delay: float = 0.01) -> None:
    """Make every ``engine.step`` sleep ``delay`` seconds first (undone with ``monkeypatch``): a tiny
    model decodes hundreds of tokens in a fraction of a second, so without it a "long" request may
    finish before a test has acted on it while it runs (queued behind it, disconnected, shut down)."""
    step = engine.step

    def slow_step() -> Any:
        time.sleep(delay)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def wait_serving(proc: subprocess.Popen[str], port: int, timeout: float = 120.0) -> None:
    """Wait until the ``infer serve`` process ``proc`` answers /health on ``port``; fail with its stderr
    if it exits first, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "infer serve did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # refused, or 503 while the model loads


def read_one_response(sock: socket.socket) -> bytes:
    """One whole HTTP response (head and its Content-Length of body) read off ``sock``, which may stay
    open after it: how a raw-socket test reads an answer that comes before its request is finished."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a whole response head: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed inside a response body: {data[:200]!r}"
        body += chunk
    assert len(body) == length, f"more than one response: {data[:200]!r}"
    return head + b"\r\n\r\n" + body


@contextlib.contextmanager
def served_models(model: Path, kinds: dict[str, dict[str, Any]], max_batch_size: int = 8,
                  served_name: str = "tiny") -> Iterator[dict[str, str]]:
    """One float32 CPU server on a background thread per entry of ``kinds`` (name -> engine
    options: a drafter, its length, ...), all serving ``model`` as ``served_name``; yields name -> URL
    and stops them all."""
    from infer import Engine, EngineConfig
    from infer.server.app import create_app
    from infer.server.background import BackgroundServer

    servers: dict[str, BackgroundServer] = {}
    try:
        for name, options in kinds.items():
            engine = Engine(EngineConfig.from_options(model=str(model), dtype="float32", device="cpu",
                                                      max_batch_size=max_batch_size, **options))
            servers[name] = BackgroundServer(create_app(engine, served_name, None)).start()
        yield {name: server.url for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


# Grammars and schemas nested n deep: the shapes that once overflowed the grammar library's stack.
def lark_chain(n: int) -> str:
    return "start: r1\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(1, n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r1\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(1, n)) + f'r{n} ::= "x"\n'


def ref_chain(n: int) -> dict[str, Any]:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1, n)}
    return {"$ref": "#/$defs/d1", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def run_interpreted_half(test_file: str) -> None:
    """Run ``test_file``'s Triton tests marked ``triton_interpreted`` in a child pytest under
    ``TRITON_INTERPRET=1`` (tests/conftest.py deselects each half in the other process), and fail
    with its output unless they all pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-m", "not cuda"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def secret_code_agent(url: str, model: str, responses_api: bool, max_tokens: int) -> tuple[Any, list[str],
                                                                                        list[dict[str, Any]]]:
    """An OpenAI Agents SDK agent on the server at ``url`` (chat completions, or the Responses API with
    ``responses_api``) with one function tool, ``secret_code(city)``, and ``tool_choice`` required (the
    SDK resets it to auto after a call). Returns the agent, the cities the tool was called with and
    the request bodies the SDK sent, both filled as the agent runs."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []
    sent: list[dict[str, Any]] = []

    @function_tool
    def secret_code(city: Literal["Paris", "Rome"]) -> str:
        """The secret code of a city."""
        calls.append(city)
        return f"The secret code of {city} is 4217."

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                         http_client=httpx.AsyncClient(timeout=120, event_hooks={"request": [record]}))
    model_class = OpenAIResponsesModel if responses_api else OpenAIChatCompletionsModel
    agent = Agent(name="assistant", instructions="Answer with the tool's result.", tools=[secret_code],
                  model=model_class(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=max_tokens))
    return agent, calls, sent


# -- matrix-tile primitives (tests/kernels: the emulation, AMX, and I8MM under qemu) ---------------
TILE_SHAPES = [(16, 64, 16), (16, 32, 16), (1, 4, 1), (5, 12, 7), (16, 16, 16), (9, 64, 3), (2, 32, 16)]


def vnni_unpack(b: Any, signed: bool) -> Any:
    """B in VNNI layout [K / 4, 4n] -> the [K, n] matrix it holds: B[kk, 4j + i] is element (4kk + i, j)."""
    k4, n4 = b.shape
    values = b.view(np.int8) if signed else b.view(np.uint8)
    return values.reshape(k4, n4 // 4, 4).transpose(0, 2, 1).reshape(k4 * 4, n4 // 4).astype(np.int64)


def tile_dot_cases(shapes: list[tuple[int, int, int]]) -> Iterator[tuple[str, Any, Any, Any, Any]]:
    """(op, A, B, C, C + A @ B in int64) for every shape (rows, K bytes, columns) and every signedness
    of tdpbsud / tdpbssd / tdpbusd ("su": A signed, B unsigned; ...), seeded: what a tile dot product
    must give, on top of C's old values."""
    rng = np.random.default_rng(0)
    for m, kbytes, n in shapes:
        for op in ("su", "ss", "us"):
            a = rng.integers(0, 256, (m, kbytes), dtype=np.uint8)
            b = rng.integers(0, 256, (kbytes // 4, 4 * n), dtype=np.uint8)
            c = rng.integers(-2 ** 20, 2 ** 20, (m, n), dtype=np.int32)
            want = c.astype(np.int64) + (a.view(np.int8) if op[0] == "s" else a).astype(np.int64) @ \
                vnni_unpack(b, signed=op[1] == "s")
            yield op, a, b, c, want


def counting_stack(monkeypatch: Any) -> list[int]:
    """Counts the passes the C decoder stack computes (``CpuStack.__call__``)."""
    from infer.backends.cpu_kernels import CpuStack

    calls = [0]
    real = CpuStack.__call__

    def counted(self: CpuStack, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CpuStack, "__call__", counted)
    return calls
