"""infer bench agent: the agent loop's conversations, as each API carries them, and an end-to-end run
through real `infer serve` processes on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpoints import make_tiny_checkpoint
from infer.bench.agent import (
    INSTRUCTIONS,
    SCENARIOS,
    TOOLS,
    agent_table,
    chat_body,
    make_conversation,
    responses_body,
    summarize,
)
from infer.cli import main
from infer.server.responses import _messages


def test_conversations_come_from_their_seed() -> None:
    convs = [make_conversation(seed) for seed in range(8)]
    assert [c.scenario for c in convs] == list(SCENARIOS) * 2  # the scenarios taken in turn
    assert make_conversation(5) == convs[5] and make_conversation(5, size=8) == convs[5]  # reproducible
    assert len({tuple(s.result for s in c.steps) for c in convs}) == 8  # every seed its own tool results
    names = {tool["function"]["name"] for tool in TOOLS}
    for conv in convs:
        assert len(conv.steps) == 4 and "Plan:\n1. " in conv.task
        assert all(step.name in names and step.result for step in conv.steps)
        if conv.scenario in ("config", "orders"):  # JSON documents, as a tool returns them
            assert all(isinstance(json.loads(step.result), dict) for step in conv.steps
                       if step.name != "run_command" and not step.arguments.get("path", "").endswith(".log"))
    config = convs[0]
    before, after = json.loads(config.steps[0].result), json.loads(config.steps[3].result)
    assert after["workers"] == 2 * before["workers"] and after["features"] != before["features"]
    small = make_conversation(0, size=1)
    assert sum(len(s.result) for s in small.steps) < sum(len(s.result) for s in config.steps)


def test_chat_turns_feed_each_tool_output_back() -> None:
    conv = make_conversation(3)
    body = chat_body(conv, ["first answer", "second answer"], 2)
    assert body["tool_choice"] == "none" and body["tools"] == TOOLS
    messages = body["messages"]
    assert messages[:2] == [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": conv.task}]
    assert [m["role"] for m in messages[2:]] == ["assistant", "tool", "assistant"] * 2 + ["assistant", "tool"]
    for turn in range(3):
        call, output = messages[2 + 3 * turn], messages[3 + 3 * turn]
        (tool_call,) = call["tool_calls"]
        assert tool_call["id"] == f"call_3_{turn}" == output["tool_call_id"]
        assert tool_call["function"] == {"name": conv.steps[turn].name,
                                         "arguments": json.dumps(conv.steps[turn].arguments)}
        assert output["content"] == conv.steps[turn].result
    assert messages[4]["content"] == "first answer" and messages[7]["content"] == "second answer"
    assert len(chat_body(conv, [], 0)["messages"]) == 4


def test_responses_turns_continue_the_stored_response_or_send_the_whole_input() -> None:
    conv = make_conversation(2)
    first = responses_body(conv, [], 0)
    assert first["store"] is True and first["instructions"] == INSTRUCTIONS and first["tool_choice"] == "none"
    assert [i["type"] for i in first["input"]] == ["message", "function_call", "function_call_output"]
    assert all(t["type"] == "function" and "name" in t and "parameters" in t for t in first["tools"])
    later = responses_body(conv, ["a", "b"], 2, previous_id="resp_1")
    assert later["previous_response_id"] == "resp_1" and "store" not in later
    assert later["input"] == [
        {"type": "function_call", "call_id": "call_2_2", "name": conv.steps[2].name,
         "arguments": json.dumps(conv.steps[2].arguments)},
        {"type": "function_call_output", "call_id": "call_2_2", "output": conv.steps[2].result}]
    whole = responses_body(conv, ["a", "b"], 2)
    kinds = [i["type"] if i["type"] != "message" else i["role"] for i in whole["input"]]
    assert kinds == ["user"] + ["function_call", "function_call_output", "assistant"] * 2 + \
        ["function_call", "function_call_output"]


def test_every_api_gives_the_server_the_chat_conversation() -> None:
    """What the Responses route makes of the whole input list, and of a stored response continued
    with the next call, is the chat route's conversation."""
    conv = make_conversation(1)
    answers = ["quoted the log", "edited the function"]
    chat = chat_body(conv, answers, 2)["messages"]
    whole = responses_body(conv, answers, 2)
    assert [{"role": "system", "content": whole["instructions"]}, *_messages(whole["input"])] == chat
    # previous_response_id: the stored conversation (inputs, then the answer as an assistant message),
    # turn after turn, as responses.py stores it.
    stored = _messages(responses_body(conv, [], 0)["input"]) + [{"role": "assistant", "content": answers[0]}]
    stored += _messages(responses_body(conv, answers[:1], 1, "resp_0")["input"])
    stored += [{"role": "assistant", "content": answers[1]}]
    stored += _messages(responses_body(conv, answers, 2, "resp_1")["input"])
    assert [chat[0], *stored] == chat


def _runs(texts: dict[str, list[str]]) -> list[dict[str, Any]]:
    return [{"repeat": 0, "api": "chat", "conversation": 0, "seed": 0, "scenario": "config", "mode": mode,
             "turns": [{"text": t, "tokens": 10, "seconds": 1.0 if mode == "plain" else 0.5, "finish": "stop",
                        "accepted": 0 if mode == "plain" else 6, "rounds": 0 if mode == "plain" else 4}
                       for t in turns]} for mode, turns in texts.items()]


def test_summary_reports_speed_and_any_text_that_differs() -> None:
    same = summarize(_runs({"plain": ["a", "b"], "suffix": ["a", "b"]}), ["plain", "suffix"], ["chat"])["chat"]
    assert same["plain"]["vs_plain"] == 1.0 and same["suffix"]["vs_plain"] == 2.0
    assert same["suffix"]["tokens_per_pass"] == pytest.approx(20 / 8) and same["plain"]["tokens_per_pass"] is None
    assert same["suffix"]["identical_to_plain"] and same["suffix"]["turns"] == 2
    # Negative control: one turn's text differs, and the summary (and the table) say so.
    differ = summarize(_runs({"plain": ["a", "bcd"], "suffix": ["a", "bxd"]}), ["plain", "suffix"], ["chat"])
    (mismatch,) = differ["chat"]["suffix"]["mismatches"]
    assert mismatch["turn"] == 1 and mismatch["first_difference"] == 1
    report = {"settings": {"model": "m", "conversations": 1, "repeats": 1, "scenarios": ["config"], "turns": 2,
                           "max_tokens": 6, "dtype": "float32", "threads": 2},
              "environment": {"cpu": "cpu"}, "summary": differ}
    table = agent_table(report)
    assert "identical to plain in every mode: NO" in table and "| chat | suffix | " in table
    assert "NO: 1 turns differ" in table


def test_bench_agent_through_infer_serve(tmp_path: Path) -> None:
    """Plain and suffix decoding servers, both APIs, two turns: the same greedy text in both modes."""
    # A tiny model with room for a tool result or two (the shared one holds 512 positions).
    model = make_tiny_checkpoint(tmp_path / "model", "llama", max_position_embeddings=4096, seed=0)
    code = main(["bench", "agent", "--model", str(model), "--speculator", "suffix", "--api", "chat", "responses",
                 "--scenarios", "orders", "--conversations", "1", "--repeats", "1", "--turns", "2", "--size", "1",
                 "--max-tokens", "8", "--threads", "1", "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "agent.json").read_text())
    assert set(report["modes"]) == {"plain", "suffix"} and "--speculator" in report["modes"]["suffix"]
    runs = report["runs"]
    assert len(runs) == 2 * 2  # an API each, a server each
    for run in runs:
        assert [t["tokens"] for t in run["turns"]] == [8, 8]
        # the second turn reads the first's KV from the prefix cache (on by default), its answer included
        first, second = run["turns"]
        assert second["cached_tokens"] >= first["prompt_tokens"] // 16 * 16 > 0
    for api in ("chat", "responses"):
        rows = report["summary"][api]
        assert rows["suffix"]["identical_to_plain"] and rows["suffix"]["turns"] == 2
        assert rows["plain"]["tok_s"] > 0 and rows["suffix"]["vs_plain"] > 0
    assert "Greedy text identical to plain in every mode: yes" in (tmp_path / "out" / "agent.md").read_text()
