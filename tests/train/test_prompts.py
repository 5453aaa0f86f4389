"""The drafters' training prompts share no topic with the benchmark's prompt sets."""

from __future__ import annotations

import re

from infer.data.prompt_sets import PROMPT_SETS
from infer.train.prompts import GENERAL_TEMPLATES, TOPICS

STOP = {"the", "of", "a", "in", "for", "and"}


def mentions(topic: str, text: str) -> bool:
    """Every content word of ``topic`` (or its stem without a plural s) appears in ``text``."""
    words = [w for w in re.findall(r"[a-z]+", topic.lower()) if w not in STOP]
    return all(re.search(r"\b" + re.escape(w.rstrip("s")), text.lower()) for w in words)


def test_no_training_topic_is_a_benchmark_topic() -> None:
    shared = [(topic, kind) for topic in TOPICS for kind, prompts in PROMPT_SETS.items()
              if any(mentions(topic, p) for p in prompts)]
    assert shared == []


def test_the_topic_check_catches_a_shared_topic() -> None:
    # Negative control: a benchmark question built from a training template is caught.
    question = GENERAL_TEMPLATES[0].format(topic="public speaking")
    assert mentions("public speaking", question)
    assert mentions("honey bees", PROMPT_SETS["summary"][1])  # "Honeybees" in the bee passage
    assert not mentions("volcanoes", question)
