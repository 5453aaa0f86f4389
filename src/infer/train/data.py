"""Token streams for training: encode a corpus once, cache the ids, sample random windows.

Every document is encoded on its own and followed by EOS, then all documents are concatenated
into one stream (train and held-out separately). Training samples windows of ``seq_len + 1``
tokens at random offsets; evaluation uses fixed, evenly spaced windows of the held-out stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from infer.data.corpus import Corpus
from infer.data.windows import eval_windows  # noqa: F401 (re-exported: the trainers' evaluation windows)

TOKENS_FILE = "tokens.npz"


def texts_fingerprint(texts: list[str]) -> str:
    """sha256 over the texts (length-prefixed, so document boundaries count)."""
    h = hashlib.sha256()
    for t in texts:
        data = t.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def cap_texts(texts: list[str], max_chars: int | None, seed: int = 0) -> list[str]:
    """A random (seeded) subset of whole texts of at most ``max_chars`` characters, the last one cut.

    Files are shuffled first so that a cap does not favour alphabetically early packages.
    """
    if max_chars is None or sum(len(t) for t in texts) <= max_chars:
        return list(texts)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    out: list[str] = []
    remaining = max_chars
    for i in order:
        if remaining <= 0:
            break
        piece = texts[i][:remaining]
        out.append(piece)
        remaining -= len(piece)
    return out


def _encode_stream(tokenizer: Tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.int32
    pieces: list[np.ndarray] = []
    eos = np.array([eos_id], dtype=dtype)
    # Batches keep memory bounded; encode_batch parallelises over the batch.
    for start in range(0, len(texts), 64):
        for enc in tokenizer.encode_batch(texts[start:start + 64], add_special_tokens=False):
            pieces.append(np.asarray(enc.ids, dtype=dtype))
            pieces.append(eos)
    if not pieces:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(pieces)


@dataclass
class TokenData:
    """Train and held-out token streams plus the key they were built for."""

    train: np.ndarray
    heldout: np.ndarray
    key: str
    origin: Path | None = None  # the cache file it was read from (None: freshly encoded)

    @property
    def num_train_tokens(self) -> int:
        return int(self.train.shape[0])

    @property
    def num_heldout_tokens(self) -> int:
        return int(self.heldout.shape[0])

    def save(self, path: Path) -> None:
        """Write atomically (temporary file, then rename)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, train=self.train, heldout=self.heldout, key=np.array(self.key))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> TokenData | None:
        """The cached streams, or None if the file is missing or unreadable."""
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls(train=z["train"], heldout=z["heldout"], key=str(z["key"]), origin=path)
        except (OSError, ValueError, KeyError):
            return None


def data_key(tokenizer: Tokenizer, train_texts: list[str], heldout_texts: list[str], eos_id: int) -> str:
    raw = json.dumps({"tok": tokenizer_fingerprint(tokenizer), "train": texts_fingerprint(train_texts),
                      "heldout": texts_fingerprint(heldout_texts), "eos": eos_id, "format": 1})
    return hashlib.sha256(raw.encode()).hexdigest()


def tokenize_corpus(tokenizer: Tokenizer, corpus: Corpus, eos_id: int, *, max_train_chars: int | None = None,
                    seed: int = 0, cache: list[Path] | None = None, save_to: Path | None = None) -> TokenData:
    """Encode ``corpus`` (train capped to ``max_train_chars``), reusing the first matching cache file.

    ``cache`` lists files that may already hold the streams (checked by key: tokenizer, texts, EOS);
    the result is written to ``save_to`` unless it was read from exactly there; ``origin`` tells
    which cache file it came from.
    """
    train_texts = cap_texts(corpus.train_texts, max_train_chars, seed)
    key = data_key(tokenizer, train_texts, corpus.heldout_texts, eos_id)
    for path in cache or []:
        found = TokenData.load(path)
        if found is not None and found.key == key:
            if save_to is not None and path.resolve() != save_to.resolve():
                found.save(save_to)
            return found
    data = TokenData(train=_encode_stream(tokenizer, train_texts, eos_id),
                     heldout=_encode_stream(tokenizer, corpus.heldout_texts, eos_id), key=key)
    if data.num_train_tokens < 2:
        raise ValueError("the corpus encodes to fewer than 2 training tokens")
    if save_to is not None:
        data.save(save_to)
    return data


class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens from one stream (shorter if the stream is shorter)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        if tokens.shape[0] < 2:
            raise ValueError("need at least 2 tokens to sample training windows")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.window = min(seq_len + 1, int(self.tokens.shape[0]))
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(self.window)

    def sample(self) -> torch.Tensor:
        """``[batch_size, window]`` int64 token ids."""
        high = int(self.tokens.shape[0]) - self.window + 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        return self.tokens[starts.unsqueeze(1) + self._offsets]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
