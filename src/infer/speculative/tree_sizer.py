"""How many tree nodes to verify per round, chosen by measured tokens per second.

A bigger candidate tree accepts a little more per round but costs more per verification pass,
and where the balance lies depends on the hardware: on a GPU a 64-node pass costs about what a
1-token step does, on a CPU it costs several. Rather than model that, the sizer treats each size
on a ladder (0 = a plain step, 1, 2, 3, 4, 6, 9, ... up to the tree) as an arm and measures it: an
exponential moving average of tokens emitted and of seconds per round, per arm. It first tries
every arm a few times, then plays the arm with the best tokens/second, and every ``probe_every``
rounds tries a neighbour of the best one so the estimates follow changes in batch size or text.

Any prefix of the best-first tree is itself a tree (see ``CandidateTree.subtree``), and
verification is exact for every tree, so the choice changes only the speed, never the output.
"""

from __future__ import annotations


def size_ladder(max_nodes: int) -> list[int]:
    """0, 1, 2, 3, 4, 6, 9, 13, 19, ... (about x1.5 apart), ending with ``max_nodes`` itself."""
    sizes, n = [0], 1
    while n < max_nodes:
        sizes.append(n)
        n = max(n + 1, int(n * 1.5))
    sizes.append(max_nodes)
    return sizes


class TreeSizer:
    """A small bandit over tree sizes whose reward is tokens per second."""

    def __init__(self, max_nodes: int, warmup_rounds: int = 2, probe_every: int = 16, ema: float = 0.2) -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes={max_nodes} must be >= 1")
        self.sizes = size_ladder(max_nodes)
        self.warmup_rounds = warmup_rounds
        self.probe_every = probe_every
        self.ema = ema
        self.tokens = [0.0] * len(self.sizes)
        self.seconds = [0.0] * len(self.sizes)
        self.counts = [0] * len(self.sizes)
        self._arm = len(self.sizes) - 1
        self._probe_up = True

    def choose(self) -> int:
        """The node budget of the next round."""
        untried = [i for i, n in enumerate(self.counts) if n < self.warmup_rounds]
        if untried:
            self._arm = untried[-1]  # largest first: the heads' own tree is the prior favourite
        elif self.rounds % self.probe_every == self.probe_every - 1:
            step = 1 if self._probe_up else -1
            self._probe_up = not self._probe_up
            self._arm = min(max(self.best_arm() + step, 0), len(self.sizes) - 1)
        else:
            self._arm = self.best_arm()
        return self.sizes[self._arm]

    def observe(self, tokens: int, seconds: float) -> None:
        """The round that used the last chosen size emitted ``tokens`` in ``seconds``."""
        arm = self._arm
        if self.counts[arm] == 0:
            self.tokens[arm], self.seconds[arm] = float(tokens), seconds
        else:
            self.tokens[arm] += self.ema * (tokens - self.tokens[arm])
            self.seconds[arm] += self.ema * (seconds - self.seconds[arm])
        self.counts[arm] += 1

    @property
    def rounds(self) -> int:
        return sum(self.counts)

    def rate(self, arm: int) -> float:
        return self.tokens[arm] / self.seconds[arm] if self.counts[arm] and self.seconds[arm] > 0 else 0.0

    def best_arm(self) -> int:
        measured = [i for i, n in enumerate(self.counts) if n]
        return max(measured, key=self.rate) if measured else len(self.sizes) - 1

    @property
    def best_size(self) -> int:
        return self.sizes[self.best_arm()]
