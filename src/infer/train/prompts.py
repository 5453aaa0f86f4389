"""Varied instructions for self-distillation: what a chat model is asked, so its own answers can
be the training text of its drafters (as in Medusa-2), with no corpus to download.

Three kinds, mixed: open questions and writing tasks over a list of everyday topics, passages to
summarise or explain (module docstrings of the standard library: real English prose present on
every machine), and code to rewrite, document or explain (standard-library functions). The list
is a pure function of ``count`` and ``seed``. No topic here is a topic of the benchmark's prompt sets
(``infer.data.prompt_sets``): a drafter trained on these answers is timed on text it never saw.
"""

from __future__ import annotations

import ast
import random

from infer.data.corpus import split_files, stdlib_source_files

TOPICS = (
    "staying healthy", "learning a new language", "saving money", "growing tomatoes", "the water cycle",
    "photosynthesis", "black holes", "the Roman Empire", "climate change", "electric cars", "wind turbines",
    "origami", "time management", "the human heart", "volcanoes", "lighthouses", "the internet",
    "recycling", "knitting", "chess", "the moon landing", "vaccines", "earthquakes", "baking bread",
    "renewable energy", "the printing press", "octopuses", "rainbows", "friendship", "job interviews",
    "running a marathon", "meditation", "the French Revolution", "machine learning", "ocean tides",
    "writing a resume", "dinosaurs", "the stock market", "camping", "first aid", "music practice",
    "birdwatching", "the solar system", "democracy", "bicycles", "tea ceremonies", "desert animals",
    "the Silk Road", "cloud computing", "the immune system", "gardening in winter", "airplanes",
    "mountain climbing", "password security", "the Great Wall of China", "glaciers", "team sports",
    "mobile phones", "kindness", "the Olympic Games",
)

GENERAL_TEMPLATES = (
    "What are three tips for {topic}?",
    "Explain {topic} in simple terms.",
    "Write a short paragraph about {topic}.",
    "Give me five facts about {topic}.",
    "Why is {topic} important?",
    "Write a haiku about {topic}.",
    "What are common mistakes people make with {topic}?",
    "Describe {topic} to a ten-year-old.",
    "List the pros and cons of {topic}.",
    "Write a short story that involves {topic}.",
    "What questions should I ask an expert about {topic}?",
    "Summarize the history of {topic} in a few sentences.",
    "How would you teach a beginner about {topic}?",
    "Write a tweet about {topic}.",
    "Compare {topic} and {other}.",
)

PASSAGE_TEMPLATES = (
    "Summarize the following passage in two sentences.\n\n{text}",
    "What is the main idea of this text?\n\n{text}",
    "Rewrite this passage in plain, simple English.\n\n{text}",
    "List the key points of the following text.\n\n{text}",
)

CODE_TEMPLATES = (
    "Rewrite this Python function to make it more readable.\n\n```python\n{text}```",
    "Explain what this code does.\n\n```python\n{text}```",
    "Add a docstring and type hints to this function.\n\n```python\n{text}```",
    "Find possible bugs in this function.\n\n```python\n{text}```",
    "Rename the variables in this function to clearer names.\n\n```python\n{text}```",
)


def _stdlib_pieces(want: int, max_chars: int, rng: random.Random) -> tuple[list[str], list[str]]:
    """Up to ``want`` docstring passages and ``want`` functions from the standard library's training
    split, reading files in a seeded order only until both are found (parsing every file takes a minute)."""
    train, _ = split_files(stdlib_source_files())
    rng.shuffle(train)
    passages: list[str] = []
    functions: list[str] = []
    for path in train:
        if len(passages) >= want and len(functions) >= want:
            break
        text = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) >= 300 and "\n\n" in doc and len(passages) < want:
            passages.append(doc[:max_chars].rsplit("\n\n", 1)[0] if len(doc) > max_chars else doc)
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None and len(functions) < want:
                body = lines[node.lineno - 1: node.end_lineno]
                if 4 <= len(body) <= 20 and sum(map(len, body)) <= max_chars:
                    functions.append("".join(body))
                    break  # one per file, for variety
    return passages, functions


def varied_prompts(count: int, seed: int = 0, max_chars: int = 900) -> list[str]:
    """``count`` distinct instructions: 3/5 general, 1/5 passages, 1/5 code (seeded shuffle)."""
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    rng = random.Random(seed)
    passages, functions = _stdlib_pieces(count // 5, max_chars, rng)
    general = [t.format(topic=topic, other=rng.choice([o for o in TOPICS if o != topic]))
               for t in GENERAL_TEMPLATES for topic in TOPICS]
    grounded = [PASSAGE_TEMPLATES[i % len(PASSAGE_TEMPLATES)].format(text=p) for i, p in enumerate(passages)]
    code = [CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(text=f) for i, f in enumerate(functions)]
    for pool in (general, grounded, code):
        rng.shuffle(pool)
    want_grounded = min(len(grounded), count // 5)
    want_code = min(len(code), count // 5)
    picked = grounded[:want_grounded] + code[:want_code] + general[:count - want_grounded - want_code]
    if len(picked) < count:
        raise ValueError(f"only {len(picked)} distinct prompts available, asked for {count}")
    rng.shuffle(picked)
    return picked
