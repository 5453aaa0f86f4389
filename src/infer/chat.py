"""``infer chat``: an interactive terminal chat with any model and any speculator.

Each turn renders the whole conversation with the model's chat template and streams the reply.
``/reset`` starts over, ``/exit`` or Ctrl-D leaves, and Ctrl-C stops the reply being written
(the partial reply stays in the conversation) without leaving. After each reply one line on
stderr gives its speed and, with speculation, the acceptance. With piped input (stdin not a
terminal) each message is echoed after the prompt, so the transcript reads question, then answer.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

from infer.cli import TextStreamer, load_llm, metrics_summary, model_sampling
from infer.engine.options import add_engine_args
from infer.sampling.options import add_sampling_args

if TYPE_CHECKING:
    from infer.engine.llm import LLM, RequestOutput
    from infer.sampling.params import SamplingParams

COMMANDS = "/reset starts over, /exit or Ctrl-D leaves, Ctrl-C stops a reply"


class ChatSession:
    """A conversation: the messages so far, and one streamed reply per user message."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None) -> None:
        self.llm = llm
        self.params = params
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str, out: TextIO, stop: threading.Event | None = None) -> RequestOutput:
        """Stream the answer to ``text`` to ``out``. Setting ``stop`` ends it after the current engine
        step (the request is aborted and its KV freed); what was written so far is kept as the reply.
        A conversation too long for the context raises ValueError and leaves the history unchanged."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.llm.tokenizer.encode_chat(messages)
        streamer = TextStreamer(self.params.stop, out)
        output = self.llm.generate([ids], self.params, on_token=streamer,
                                   should_stop=None if stop is None else stop.is_set)[0]
        self.messages = [*messages, {"role": "assistant", "content": output.text}]
        return output


@contextlib.contextmanager
def ctrl_c_sets(event: threading.Event) -> Iterator[None]:
    """Inside, Ctrl-C sets ``event`` instead of raising, so an engine step is never cut in half."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def chat_loop(session: ChatSession, read: Any = input, out: TextIO | None = None,
              err: TextIO | None = None, echo: bool = False) -> int:
    """Read messages until /exit or end of input; ``read(prompt)`` is ``input`` in a terminal.
    ``echo`` writes each line read after the prompt (piped input, which no terminal shows)."""
    out = out or sys.stdout
    err = err or sys.stderr
    while True:
        try:
            line = read("> ")
            if echo:
                out.write(line + "\n")
                out.flush()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as in a shell
            out.write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            print("[infer] conversation reset", file=err, flush=True)
            continue
        if text.startswith("/") and " " not in text:
            print(f"[infer] unknown command {text}: {COMMANDS}", file=err, flush=True)
            continue
        stop = threading.Event()
        try:
            with ctrl_c_sets(stop):
                output = session.reply(text, out, stop)
        except ValueError as error:  # the conversation outgrew the context, or a template error
            print(f"[infer] {error}; /reset starts a new conversation", file=err, flush=True)
            continue
        out.write("\n")
        out.flush()
        stopped = " (stopped)" if output.finish_reason == "abort" else ""
        print(f"[infer] {metrics_summary(output)}{stopped}", file=err, flush=True)


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal (streaming, multi-turn)",
                       description=f"Chat with a model using its chat template. {COMMANDS}.")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="system message at the start of the conversation")
    add_sampling_args(p, from_model=True, max_tokens=512)
    p.set_defaults(func=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    params, how = model_sampling(args)

    def progress(msg: str) -> None:
        print(f"[infer] {msg}", file=sys.stderr, flush=True)

    # One conversation at a time; prefix caching (the paged pool's default) keeps earlier turns' KV.
    llm = load_llm(args, progress, max_batch_size=1)
    if not llm.tokenizer.chat_template:
        raise ValueError(f"{args.model} has no chat template; use infer generate for plain prompts")
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 (line editing and history for input())
    print(f"[infer] {how}", file=sys.stderr, flush=True)
    print(f"[infer] chatting with {args.model}: {COMMANDS}", file=sys.stderr, flush=True)
    return chat_loop(ChatSession(llm, params, args.system), echo=not sys.stdin.isatty())
