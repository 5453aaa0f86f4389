"""Fixed evaluation windows of a token stream (the trainers' held-out evaluation, ``infer bench quality``)."""

from __future__ import annotations

import numpy as np
import torch


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Up to ``max_windows`` non-overlapping windows of ``seq_len + 1`` tokens, evenly spread over the stream.

    Returns ``[N, W]`` int64 (N may be 0). A stream shorter than one window gives one shorter window.
    """
    n = int(tokens.shape[0])
    width = min(seq_len + 1, n)
    if width < 2 or max_windows <= 0:
        return torch.zeros((0, max(width, 0)), dtype=torch.long)
    count = min(max_windows, n // width)
    # Evenly spaced starts over the whole stream (not just its beginning), so every document can appear.
    starts = np.linspace(0, n - width, num=count).astype(np.int64) if count > 1 else np.array([0])
    data = torch.from_numpy(tokens.astype(np.int64))
    return torch.stack([data[s:s + width] for s in starts.tolist()])
