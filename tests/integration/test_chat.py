"""``infer chat``: streamed multi-turn replies, /reset, stopping a reply (Ctrl-C), the command loop,
piped stdin through ``python -m infer``, and Ctrl-C in a real pseudo-terminal."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.chat import ChatSession, chat_loop

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", max_batch_size=1, prefix_caching=True)


def test_reply_streams_the_answer_and_keeps_the_conversation(llm: LLM) -> None:
    session = ChatSession(llm, PARAMS, system=SYSTEM["content"])
    out = io.StringIO()
    first = session.reply("Write a function.", out)
    user = {"role": "user", "content": "Write a function."}
    assert out.getvalue() == first.text == llm.chat([SYSTEM, user], PARAMS).text
    assert session.messages == [SYSTEM, user, {"role": "assistant", "content": first.text}]
    second = session.reply("Shorter.", io.StringIO())
    assert second.prompt_token_ids == llm.tokenizer.encode_chat(session.messages[:-1])  # the whole conversation
    assert len(session.messages) == 5
    session.reset()
    assert session.messages == [SYSTEM]


class StopOnFirstText(io.StringIO):
    """An output that presses 'Ctrl-C' (sets the stop event) as soon as any reply text arrives."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__()
        self.stop = stop

    def write(self, text: str) -> int:
        if text:
            self.stop.set()
        return super().write(text)


def test_stopping_a_reply_aborts_it_frees_its_kv_and_keeps_the_chat(llm: LLM) -> None:
    session = ChatSession(llm, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    free_before = llm.engine.pool.free_kv_tokens()
    stop = threading.Event()
    out = StopOnFirstText(stop)
    stopped = session.reply("Tell me everything.", out, stop)
    assert stopped.finish_reason == "abort"
    assert 0 < len(stopped.token_ids) < 64
    assert out.getvalue() == stopped.text
    assert session.messages[-1] == {"role": "assistant", "content": stopped.text}  # what was shown is kept
    assert not llm.engine.has_unfinished()
    assert llm.engine.pool.free_kv_tokens() == free_before  # nothing leaked
    following = session.reply("Go on.", io.StringIO())
    assert following.finish_reason == "length" and len(following.token_ids) == 64


def scripted(*lines: str | type[BaseException]):  # type: ignore[no-untyped-def]
    """A ``read`` that returns each line (or raises each exception class) in turn."""
    queue = list(lines)

    def read(_prompt: str) -> str:
        item = queue.pop(0)
        if isinstance(item, type):
            raise item
        return item

    read.remaining = queue  # type: ignore[attr-defined]
    return read


def test_loop_commands_reset_and_ctrl_c_at_the_prompt(llm: LLM) -> None:
    read = scripted("hello", "", "/bogus", "/reset", KeyboardInterrupt, "hello", "/exit", "never read")
    out, err = io.StringIO(), io.StringIO()
    assert chat_loop(ChatSession(llm, PARAMS), read, out, err) == 0
    assert read.remaining == ["never read"]  # type: ignore[attr-defined]
    answer = llm.chat([{"role": "user", "content": "hello"}], PARAMS).text
    assert out.getvalue().count(answer) == 2  # after /reset the same question gets the same first answer
    log = err.getvalue()
    assert "unknown command /bogus" in log and "conversation reset" in log
    assert log.count("12 tokens, finish=length") == 2 and "decode=" in log


def test_loop_ends_on_end_of_input_and_survives_a_too_long_conversation(tiny_llama: Path) -> None:
    short = LLM(str(tiny_llama), dtype="float32", device="cpu", max_batch_size=1, max_seq_len=40)
    session = ChatSession(short, PARAMS)
    out, err = io.StringIO(), io.StringIO()
    assert chat_loop(session, scripted("hi", "word " * 60, EOFError), out, err) == 0
    assert "context holds 40" in err.getvalue() and "/reset" in err.getvalue()
    assert [m["role"] for m in session.messages] == ["user", "assistant"]  # the too-long turn left no trace


def chat_command(model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "infer", "chat", "--model", str(model), "--dtype", "float32", "--device", "cpu",
            "--temperature", "0", "--ignore-eos", *extra]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}


def test_python_m_infer_chat_with_piped_stdin_and_a_speculator(tiny_llama: Path, llm: LLM) -> None:
    proc = subprocess.run(chat_command(tiny_llama, "--max-tokens", "12", "--speculator", "ngram"),
                          input="hello\nand more\n/exit\n", capture_output=True, text=True, timeout=300,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr
    first = llm.chat([{"role": "user", "content": "hello"}], PARAMS).text
    assert first in proc.stdout  # greedy n-gram speculation gives the plain greedy answer
    assert "> hello\n" in proc.stdout and "> and more\n" in proc.stdout  # piped input is echoed
    assert proc.stdout.index("> hello\n") < proc.stdout.index(first)
    assert proc.stderr.count("acceptance=") == 2 and "tokens/target pass=" in proc.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_ctrl_c_in_a_terminal_stops_the_reply_not_the_chat(tiny_llama: Path) -> None:
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat, with the pseudo-terminal as its controlling terminal
        command = chat_command(tiny_llama, "--max-tokens", "480", "--max-seq-len", "512")
        os.execve(sys.executable, command, child_env())
    seen = b""

    def read_until(marker: bytes, since: int = 0, timeout: float = 240.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen[since:]:
            assert time.monotonic() < deadline, f"no {marker!r} in {seen.decode(errors='replace')[-2000:]}"
            if select.select([fd], [], [], 1.0)[0]:
                try:
                    seen += os.read(fd, 65536)
                except OSError:  # the child closed the terminal
                    break

    def wait_for_exit(timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            time.sleep(0.1)
        raise AssertionError("the chat did not exit after /exit")

    try:
        read_until(b"> ")
        os.write(fd, b"hello\n")
        read_until(b"hello\r\n")  # the terminal's echo; the reply follows
        echoed, deadline = len(seen), time.monotonic() + 240
        while len(seen) == echoed and time.monotonic() < deadline:  # the first reply text
            if select.select([fd], [], [], 0.5)[0]:
                seen += os.read(fd, 65536)
        interrupted = len(seen)
        os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the chat
        read_until(b"finish=", interrupted)
        read_until(b"\n> ", seen.index(b"finish=", interrupted))  # a fresh prompt: the chat goes on
        os.write(fd, b"/exit\n")
        status = wait_for_exit()
    finally:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):  # already gone: nothing to do
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    text = seen.decode(errors="replace")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, text[-2000:]
    assert "(stopped)" in text or "480 tokens, finish=length" in text, text[-2000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
