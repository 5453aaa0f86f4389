"""How much each speculative round drafts: one controller, one model of cost and acceptance.

A *budget* is, per request, the most draft nodes a round may verify: a chain's length (draft
model, n-gram) or a tree's node count (Medusa). ``BudgetController`` decides it every round for
every drafter. Fixed, it returns a constant. Adaptive, it picks the budget ``n`` that maximises the
expected tokens per unit of time of the round, ``sum_b E_b(n) / T(B, n)``:

* **Cost** ``T``, in plain decode steps, from the runner's timings: a target pass over ``m`` token
  rows takes about ``a + b·m`` (a least-squares fit that forgets; a verification pass is ragged, so
  ``m`` is the rows the requests drafted, ``Σ_b (1 + k_b)``), a draft call about ``D(B)`` for a
  batch of ``B``. A chain's rows are priced from the passes of each row count (``PassTimes``: the
  cost of a row grows with the pass's rows, so the line alone prices short chains too high); the
  line's ``per_row`` below stands for that where the formulas say it. A drafter that runs one step
  per drafted token (a draft model) pays ``D`` per step of its longest chain, one that drafts a
  round in one call (n-gram, Medusa) pays it once, so a chain round costs
  ``T = 1 + overhead·[any k_b > 0] + per_step·max_b k_b + per_row·Σ_b k_b``, ``per_row = b / (a + b·B)``: each request's chain is chosen for what its own rows cost. With
  every request at ``n``, a draft model's ``per_step + B·per_row`` is Leviathan et al.'s ``c``
  grown by the batch, ``(D + b·B) / (a + b·B)``, which tends to 1 as the batch fills: under load
  speculation stops paying.
* **Acceptance** ``E_b(n)``, the tokens a round emits for request ``b``. For a chain it is
  ``1 + α·(1 + γ + ... + γ^(n-1))``, Theorem 3.8's ``1 + α + ... + α^n`` with the first draft's
  acceptance ``α`` apart from the continuation's ``γ`` (a draft's acceptance once the one before it
  was accepted): model-free drafts copy, and the first draft after a match is often wrong where,
  once it is right, the copy mostly goes on, which one α for every draft would call a short chain.
  Each is the request's successes over trials of its last rounds (α one trial a round, γ the drafts
  after an accepted first up to the first rejection; older rounds weigh less, at most
  ``alpha_window`` trials in all, starting from the drafter's recent figures), so a request whose
  text stops repeating backs off within a round or two and one copying a passage drafts long. A
  drafter that classes its drafts before a round (``Drafter.match_classes``: prompt lookup's
  matched length) gets ``α`` (and ``γ``) learned per request and class, starting from the class's
  recent figures over every request: a draft after a one-token match is mostly wrong and one after
  a four-token match mostly right, so a request drafts long the round its match turns long, not
  rounds later. For a tree, whose extra
  width a single ``α`` does not describe, it is measured: the mean tokens per request and round at
  each size on a ladder 0, 1, 2, 3, 4, 6, 9, ... up to the whole tree, each tried a few times
  first, smallest first while the sizes keep paying more (two in a row below the best end the
  climb: a weak head never pays for a 64-node tree), then a neighbour of the best every
  ``probe_every`` rounds. A tree (and a round of chains) must promise ``min_gain`` more tokens per
  unit of time than plain decoding to be played at all: near break-even the estimates' noise
  decides, and a round that loses a little every time is what the default must never do. A chain
  request left at ``n = 0`` drafts two tokens after ``first_probe`` plain rounds (a new one: its α
  is only its predecessors'), then after ``probe_every``, so one whose text turns predictable can
  win speculation back. When one request is due, every request at 0 probes with it, because a
  round that verifies anything pays the drafter's call (or its steps) once: eight requests probing
  in eight rounds would pay it eight times. Each probe that does not win speculation back doubles
  the request's wait (up to ``max_probe_every``), so where speculation never pays (a full batch on
  a compute-bound CPU) it pays for ever fewer probes. A round of class 0 (nothing matched) neither
  drafts nor probes.

Every budget gives the same output (verification is exact), so this only changes the speed.

``EntropyStop`` (EGAG) is a stopping rule inside a chain drafter's own loop: it ends a request's
chain early when the draft distribution turns flat.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable

import torch

from infer.core.request import Request


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round emits on average with ``k`` drafts of acceptance ``α`` each: 1 + α + ... + α^k."""
    return k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost: float) -> float:
    """Leviathan et al. Theorem 3.8: (1 - α^(K+1)) / ((1 - α)(cK + 1)); K = 0 is plain decoding (1.0)."""
    if k == 0:
        return 1.0
    return expected_tokens(alpha, k) / (cost * k + 1)


def expected_speedup_over_rounds(alpha: float, rounds_by_length: list[int], cost_per_draft: float = 0.0,
                                 cost_per_round: float = 0.0) -> float:
    """Theorem 3.8 applied round by round: ``rounds_by_length[k]`` rounds drafted ``k`` tokens.

    Expected tokens over the same rounds, each costing one target step (its verification pass) plus
    ``cost_per_draft`` per draft (a draft model's step: Leviathan et al.'s c) plus ``cost_per_round``
    (a drafter that drafts a round in one call, n-gram lookup, pays its call whatever it finds), all
    in target decode steps. With every round drafting K and no per-round cost this is exactly
    ``expected_speedup(alpha, K, cost_per_draft)``; a drafter whose proposals are often shorter than
    K (n-gram lookup finds no match, or a shorter one) is judged on the rounds it actually ran.
    """
    tokens = sum(n * expected_tokens(alpha, k) for k, n in enumerate(rounds_by_length))
    steps = sum(n * (1 + cost_per_draft * k + cost_per_round) for k, n in enumerate(rounds_by_length))
    return tokens / steps if steps else 1.0


def size_ladder(max_nodes: int) -> list[int]:
    """0, 1, 2, 3, 4, 6, 9, 13, 19, ... (about x1.5 apart), ending with ``max_nodes`` itself."""
    sizes, n = [0], 1
    while n < max_nodes:
        sizes.append(n)
        n = max(n + 1, int(n * 1.5))
    sizes.append(max_nodes)
    return sizes


class LinearFit:
    """Exponentially forgetting least squares for ``time ≈ a + b * x``."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self._coefficients: tuple[float, float] | None = None  # until the next observation

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.n = d * self.n + 1
        self.sx, self.sy = d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        self._coefficients = None

    @property
    def ready(self) -> bool:
        return self.n > 0

    def coefficients(self) -> tuple[float, float]:
        # A round's decision prices every draft row from them: computed once per observation.
        if self._coefficients is None:
            self._coefficients = self._fit()
        return self._coefficients

    def _fit(self) -> tuple[float, float]:
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x**2
        slope = 0.0
        if var > 1e-9 * max(1.0, mean_x**2):
            slope = max(0.0, (self.sxy / self.n - mean_x * mean_y) / var)
        return max(mean_y - slope * mean_x, 1e-9), slope

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class PassTimes:
    """A target pass's seconds by its rows: each row count's recent mean where measured (at least
    ``min_samples`` passes), straight lines between measured counts, the fit's slope past the last.

    One straight line over every pass misprices chains: a pass's cost per extra row grows with its
    rows (a verification pass also pays rejection and bookkeeping once, and wider passes leave the
    kernels' few-row tiles), so a line fitted through 1-row and 33-row passes prices a 4-row chain
    too high and a 30-row one too low."""

    def __init__(self, ema: float = 0.2, min_samples: int = 2) -> None:
        self.ema = ema
        self.min_samples = min_samples
        self.fit = LinearFit()
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._known: list[int] = []  # row counts with min_samples passes, ascending

    def observe(self, rows: int, seconds: float) -> None:
        self.fit.observe(rows, seconds)
        n = self._count[rows] = self._count.get(rows, 0) + 1
        prev = self._mean.get(rows, seconds)
        self._mean[rows] = prev + max(self.ema, 1.0 / n) * (seconds - prev)
        if n == self.min_samples:
            bisect.insort(self._known, rows)

    def predict(self, rows: int) -> float:
        if self._count.get(rows, 0) >= self.min_samples:
            return self._mean[rows]
        known = self._known
        if not known:
            return self.fit.predict(rows)
        i = bisect.bisect_left(known, rows)
        if i == 0:  # below every measured count: the fit's line through the first
            return max(self._mean[known[0]] - self.fit.coefficients()[1] * (known[0] - rows), 1e-9)
        lo = known[i - 1]
        if i == len(known):
            return self._mean[lo] + self.fit.coefficients()[1] * (rows - lo)
        hi = known[i]
        t_lo, t_hi = self._mean[lo], self._mean[hi]
        return max(t_lo, t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo))


class BudgetController:
    """Each round's budget per request; learns from the runner's timings and verification results.

    Args:
        max_draft_tokens: the round's draft limit per request: the constant budget when not ``adaptive``,
            otherwise the largest one tried.
        adaptive: choose by expected tokens per second (see the module docstring).
        tree: budgets are tree sizes (measured acceptance on a ladder) rather than chain lengths.
        cost_per_token: drafting costs one step per node (a draft model) rather than one call per round.
        prior_cost: one draft step (or call) over one target decode step, until measured.
    """

    def __init__(self, max_draft_tokens: int, *, adaptive: bool = False, tree: bool = False, cost_per_token: bool = True,
                 prior_cost: float = 0.0, prior_alpha: float = 0.6, ema: float = 0.3, probe_every: int = 16,
                 max_probe_every: int = 128, warmup_rounds: int = 2, tree_ema: float = 0.2,
                 alpha_decay: float = 0.7, alpha_window: float = 8.0, prior_row_cost: float = 0.05,
                 min_row_cost: float = 0.01, first_probe: int = 4, min_gain: float = 0.05) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens={max_draft_tokens} must be >= 1")
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = adaptive
        self.tree = tree
        self.cost_per_token = cost_per_token
        self.prior_cost = prior_cost
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        # A new request starting at K = 0 (its drafter's recent requests did not pay) probes sooner:
        # until then its acceptance is only its predecessors'.
        self.first_probe = min(first_probe, probe_every)
        # Cost: target passes by tokens in the pass; draft steps by batch size. Draft steps are
        # sampled less often once a chain settles on 0 (only probes draft), so that fit forgets
        # faster: one slow early sample must not keep drafting dear for long.
        # (the line through every pass is the per-row-count table's own fit: one fit, fed once)
        self.passes = PassTimes()  # the passes by row count: a chain's rows are costed from it
        self.target = self.passes.fit
        self.draft = LinearFit(decay=0.7)
        # Chain acceptance: per-request α (the first draft's), and where new requests start. α is
        # the request's accepted first drafts over rounds, each round weighing alpha_decay times less
        # per round and at most alpha_window rounds in all: a request copying a passage for a while
        # still backs off within a round or two once its text stops repeating.
        self.ema = ema
        # α per request id, or per (request id, class) for a drafter that classes its drafts.
        self.alpha: dict[Hashable, float] = {}
        self._weight: dict[Hashable, float] = {}  # trials (rounds) behind each α (decayed)
        self.alpha_decay = alpha_decay
        self.alpha_window = alpha_window
        self.prior_alpha = prior_alpha
        self.recent_alpha = prior_alpha
        self.class_alpha: dict[int, float] = {}  # each class's recent acceptance over every request
        # Continuation: a draft's acceptance once the draft before it was accepted, learned like α (per
        # request, or request and class) from the drafts after a round's first. Model-free drafts
        # copy: the first draft after a match is often wrong, but once one is right the copy mostly
        # goes on, which one α for every draft would call a short chain.
        self.cont: dict[Hashable, float] = {}
        self._cont_weight: dict[Hashable, float] = {}
        self.class_cont: dict[int, float] = {}
        self.recent_cont: float | None = None  # the drafter's, once a round has judged a second draft
        self._class_rounds: dict[int, int] = {}  # rounds behind each (their mean until the EMA takes over)
        self._round_class: dict[str, int] = {}  # each request's class in the round being decided
        # A chain's verification row in plain decode steps, until the fit measures one, and at least.
        self.prior_row_cost = prior_row_cost
        self.min_row_cost = min_row_cost
        # Per request at K = 0: rounds since its last probe (or speculation), and the wait before the next.
        self._plain_rounds: dict[str, int] = {}
        self._probe_wait: dict[str, int] = {}
        # Tree acceptance: tokens per request and round at each ladder size (unused for chains).
        self.sizes = size_ladder(max_draft_tokens) if tree else list(range(max_draft_tokens + 1))
        self.warmup_rounds = warmup_rounds
        self.tree_ema = tree_ema
        self.min_gain = min_gain
        self.tokens = [0.0] * len(self.sizes)
        self.counts = [0] * len(self.sizes)
        self._arm = len(self.sizes) - 1
        self._probe_up = True
        self._tree_wait = probe_every  # rounds between a tree's probes of a neighbour size
        self._since_probe = 0
        self._probed_from: int | None = None  # the best arm the last round's probe left
        self._last_cost = self.round_cost(1)  # the prior, until a round is costed

    # -- the decision ----------------------------------------------------------------------------
    def budgets(self, requests: list[Request], classes: list[int] | None = None) -> list[int]:
        """Budget per request for the next round (the runner clamps it to each request's room);
        ``classes``: each request's draft class this round (``Drafter.match_classes``), or None."""
        self._round_class = {} if classes is None else {
            r.request_id: c for r, c in zip(requests, classes, strict=True)}
        if not self.adaptive:
            return [self.max_draft_tokens] * len(requests)
        if self.tree:
            per_node, overhead = self._last_cost = self.round_cost(len(requests))
            return [self.tree_size(per_node, overhead)] * len(requests)
        per_row, per_step, overhead = self.chain_cost(len(requests))
        # A chain of up to max_draft_tokens rows: its row cost is a prior until a pass is timed, and never
        # below min_row_cost, so an unmeasured (or noisy, flat) fit cannot make a 32-row pass look free.
        if not self.target.ready:
            return self.chain_lengths(requests, self.prior_row_cost, overhead, per_step)
        batch = len(requests)
        plain = self.passes.predict(batch)

        def rows_cost(rows: int) -> float:  # the pass's extra cost for `rows` drafted rows, in plain steps
            return max(self.passes.predict(batch + rows) / plain - 1.0, self.min_row_cost * rows)

        return self.chain_lengths(requests, max(per_row, self.min_row_cost), overhead, per_step, rows_cost)

    def chain_cost(self, batch_size: int) -> tuple[float, float, float]:
        """``(per_row, per_step, overhead)``: a round of this batch where request b drafts ``k_b``
        costs ``1 + overhead·[any k_b > 0] + per_step·max k_b + per_row·Σ k_b`` plain decode steps
        (the verification pass computes each request's own rows; a draft model steps as long as the
        longest chain; a one-call drafter pays its call once)."""
        if not self.target.ready:  # the prior: drafting costs prior_cost, verified rows nothing yet
            return (0.0, self.prior_cost, 0.0) if self.cost_per_token else (0.0, 0.0, self.prior_cost)
        a, b = self.target.coefficients()
        plain = a + b * batch_size
        draft = (self.draft.predict(batch_size) if self.draft.ready else self.prior_cost * plain) / plain
        return (b / plain, draft, 0.0) if self.cost_per_token else (b / plain, 0.0, draft)

    def round_cost(self, batch_size: int) -> tuple[float, float]:
        """``(per_node, overhead)``: a round with ``n`` nodes for every request costs
        ``1 + overhead·[n > 0] + per_node·n`` plain decode steps of this batch."""
        per_row, per_step, overhead = self.chain_cost(batch_size)
        return per_step + per_row * batch_size, overhead

    def chain_lengths(self, requests: list[Request], per_row: float, overhead: float = 0.0,
                      per_step: float = 0.0, rows_cost: Callable[[int], float] | None = None) -> list[int]:
        """Chain length per request, maximising ``Σ_b E_b(k_b) / T`` (``chain_cost``). The pass is
        ragged, so a request whose drafts are seldom accepted drafts less than its batch mates
        rather than making them pay for its rows: for each longest chain ``K``, the best rounds take
        the most valuable drafts first (request b's j-th draft adds ``α_b·γ_b^(j-1)``, less for each
        further one), so the best ``m`` of them, over every ``K`` and ``m``, is the optimum. A
        one-call drafter's cost does not grow with ``K`` (``per_step`` 0): only the longest is tried.
        No request drafts past its own ``draft_room`` (its ``max_draft_tokens``; 0 with speculation off).
        ``rows_cost(m)``: the verification pass's extra plain steps for ``m`` drafted rows (measured
        per row count, ``PassTimes``); without it ``per_row·m``. ``per_row`` is then the least a row
        may cost: it bounds the drafts worth ranking."""
        # Class 0: the drafter found nothing to draft from (no match), so it drafts nothing, probe or not.
        found = [self._round_class.get(r.request_id) != 0 for r in requests]
        caps = [min(self.max_draft_tokens, r.draft_room) if f else 0 for r, f in zip(requests, found, strict=True)]
        alphas = [self.request_alphas(r) for r in requests]
        batch = len(requests)
        best_rate, best = float(batch), [0] * batch  # plain decoding: B tokens per step
        # At the optimum every draft is worth at least its row at the optimum's rate (else dropping it
        # would raise the rate), a rate above plain decoding's B: lesser gains never enter it, and
        # skipping them keeps a 64-token budget's ranking short.
        floor = (self.min_row_cost if rows_cost is not None else per_row) * batch
        ranked = sorted(((gain, j, b) for b, (first, cont) in enumerate(alphas)
                         for j, gain in _gains(first, cont, caps[b], floor)), key=lambda g: -g[0])
        top = max(caps, default=0)
        extra = [0.0]  # the pass's extra cost for m drafted rows, priced once per decision
        for longest in (range(1, top + 1) if per_step > 0 else [top] if top else []):
            fixed = 1.0 + overhead + per_step * longest
            tokens, rows, cost = float(batch), 0, fixed
            counts = [0] * batch
            for gain, j, b in ranked:
                if j > longest:
                    continue
                # A draft worth less than a row at a straight line's price: so are the rest. (A
                # measured price is not one line: the first row also pays the verification's fixed
                # work, so every draft is weighed then.)
                if rows_cost is None and gain * cost <= tokens * per_row:
                    break
                rows += 1
                if rows == len(extra):
                    extra.append(rows_cost(rows) if rows_cost is not None else per_row * rows)
                tokens, cost = tokens + gain, fixed + extra[rows]
                counts[b] += 1
                rate = tokens / cost
                if rate > best_rate * (1 + 1e-9):
                    best_rate, best = rate, list(counts)
        if best_rate < batch * (1.0 + self.min_gain):
            # Near break-even the estimates' noise decides, and drafts that lose a little every round
            # are what the default must never do: plain decoding (and the probes) until a round
            # promises min_gain more.
            best = [0] * batch
        return self._probe(requests, best, caps, found)

    def _probe(self, requests: list[Request], lengths: list[int], caps: list[int],
               found: list[bool] | None = None) -> list[int]:
        """Requests left at K = 0 for their probe wait draft two tokens, so one whose text turns
        predictable wins speculation back; each probe that does not doubles its wait. When one is
        due every request at 0 probes with it: a round that verifies anything pays the drafter's
        call (or its steps) once, and eight requests probing in eight rounds would pay it eight times.
        A request whose drafter found nothing this round (``found`` False) neither probes nor waits."""
        due = False
        found = found or [True] * len(requests)
        for request, k, cap, here in zip(requests, lengths, caps, found, strict=True):
            rid = request.request_id
            if not here:
                continue
            if k or not cap:  # speculating (or not allowed to): probe promptly once it stops paying
                self._plain_rounds[rid], self._probe_wait[rid] = 0, self.probe_every
                continue
            self._plain_rounds[rid] = self._plain_rounds.get(rid, 0) + 1
            due |= self._plain_rounds[rid] >= self._probe_wait.setdefault(rid, self.first_probe)
        if not due:
            return lengths
        probed = list(lengths)
        for b, (request, k, cap) in enumerate(zip(requests, lengths, caps, strict=True)):
            if k == 0 and cap:
                # Two drafts, so the draft model's single-token step gets timed too (the first step of
                # a round also catches the draft cache up and is not a clean sample).
                rid = request.request_id
                probed[b] = min(2, cap)
                self._plain_rounds[rid] = 0
                self._probe_wait[rid] = min(2 * self._probe_wait[rid], self.max_probe_every)
        return probed

    def tree_size(self, per_node: float, overhead: float = 0.0) -> int:
        """The tree size of the next round: the ladder climbed from plain decoding, each size tried
        ``warmup_rounds`` times, while the best measured size is one of the two largest tried (a
        big tree costs several plain steps a round: it is tried only once smaller ones pay more and
        more); then the best, and after ``probe_every`` rounds a neighbour of it (alternately above
        and below; from plain decoding, the smallest tree), which is how a size above the climb's
        end is reached later. A probe that leaves the best where it was doubles the wait for the
        next (up to ``max_probe_every``): where speculation does not pay, its probes cost ever
        less; one that moves it starts over."""
        climb = self._climb_arm(per_node, overhead)
        if climb is not None:
            self._arm = climb
            return self.sizes[self._arm]
        best = self._best_arm(per_node, overhead)
        if self._probed_from is not None:  # the last round probed a neighbour of ``_probed_from``
            moved = best != self._probed_from
            self._tree_wait = self.probe_every if moved else min(2 * self._tree_wait, self.max_probe_every)
            self._probed_from = None
        self._since_probe += 1
        self._arm = best
        if self._since_probe >= self._tree_wait:
            self._since_probe = 0
            up = self._probe_up or best == 0
            self._probe_up = not self._probe_up
            neighbour = min(max(best + (1 if up else -1), 0), len(self.sizes) - 1)
            if neighbour != best:
                self._arm, self._probed_from = neighbour, best
        return self.sizes[self._arm]

    def plain_rounds_ahead(self) -> int:
        """How many rounds after the one just decided will surely draft nothing (0: the next may):
        only a tree sizer resting on plain decoding knows, from the wait for its next probe. A
        drafter that reads target states of recent positions only (``DrafterInfo.aux_window``)
        needs none captured before then."""
        if not (self.adaptive and self.tree) or self.sizes[self._arm] != 0 or self._probed_from is not None:
            return 0
        if self._climb_arm(*self._last_cost) is not None:
            return 0
        return max(self._tree_wait - self._since_probe - 1, 0)

    def _climb_arm(self, per_node: float, overhead: float) -> int | None:
        """The next size of the climb (the smallest tried fewer than ``warmup_rounds`` times), while
        the climb goes on: always up to the 2-node tree, then while the best measured size is one of
        the two largest tried. None: the climb is over (for now: a probe may move the best up)."""
        climb = next((i for i, n in enumerate(self.counts) if n < self.warmup_rounds), None)
        if climb is not None and (climb < 2 or self._best_arm(per_node, overhead) >= climb - 2):
            return climb
        return None

    @property
    def rounds(self) -> int:
        return sum(self.counts)

    @property
    def best_tree_size(self) -> int:
        """The size the last round's costs make best (what the controller plays between probes)."""
        return self.sizes[self._best_arm(*self._last_cost)]

    def _best_arm(self, per_node: float, overhead: float) -> int:
        """The measured size of the most tokens per unit of time, a tree's rate counted ``min_gain``
        lower against plain decoding's (trees against each other compare as measured)."""
        measured = [i for i, n in enumerate(self.counts) if n]
        if not measured:
            return 0
        return max(measured, key=lambda i: self.tokens[i] / _cost(self.sizes[i], per_node, overhead)
                   / (1.0 + self.min_gain if self.sizes[i] else 1.0))

    # -- learning --------------------------------------------------------------------------------
    def observe_target(self, num_tokens: int, seconds: float) -> None:
        """A target pass over ``num_tokens`` tokens (all requests together) took ``seconds``."""
        self.passes.observe(num_tokens, seconds)

    def observe_draft_step(self, batch_size: int, seconds: float) -> None:
        """One draft step (or call, for a drafter that drafts a round at once) for a batch."""
        self.draft.observe(batch_size, seconds)

    def observe_round(self, requests: list[Request], verified: list[int], judged: list[int],
                      accepted: list[int]) -> None:
        """Per request: nodes verified, draft positions judged (a chain's length, a tree's depth) and
        drafts accepted. A request that verified nothing had a plain decode step."""
        if self.tree:
            by_size: dict[int, list[int]] = {}
            for nodes, kept in zip(verified, accepted, strict=True):
                by_size.setdefault(nodes, []).append(kept + 1)
            for nodes, emitted in by_size.items():
                if nodes in self.sizes:  # a tree clamped to a size off the ladder teaches nothing
                    self.record_tree_round(nodes, sum(emitted) / len(emitted))
            return
        for request, proposed, kept in zip(requests, judged, accepted, strict=True):
            self.update(request, proposed, kept)

    def record_tree_round(self, size: int, tokens: float) -> None:
        """A round verifying ``size`` nodes per request emitted ``tokens`` per request."""
        arm = self.sizes.index(size)
        if self.counts[arm] == 0:
            self.tokens[arm] = float(tokens)
        else:
            self.tokens[arm] += self.tree_ema * (tokens - self.tokens[arm])
        self.counts[arm] += 1

    def _alpha_key(self, request: Request) -> tuple[Hashable, float]:
        """The key of the request's α this round (its id, or id and class) and the prior it starts
        from (the drafter's recent acceptance, or the class's)."""
        rid = request.request_id
        cls = self._round_class.get(rid)
        if cls is None:
            return rid, self.recent_alpha
        return (rid, cls), self.class_alpha.get(cls, self.prior_alpha)

    def request_alpha(self, request: Request) -> float:
        """The request's first draft's acceptance this round (of its class this round, where classed)."""
        return self.request_alphas(request)[0]

    def request_alphas(self, request: Request) -> tuple[float, float]:
        """``(first, continuation)``: the acceptance of the request's first draft this round, and of
        each later draft once the one before it was accepted (its class's, or the drafter's, until
        the request has its own; the first's until anything has judged a later draft)."""
        key, prior = self._alpha_key(request)
        first = self.alpha.get(key, prior)
        cls = self._round_class.get(request.request_id)
        fallback = self.class_cont.get(cls) if cls is not None else None
        if fallback is None:
            fallback = self.recent_cont if self.recent_cont is not None else first
        return first, self.cont.get(key, fallback)

    def update(self, request: Request, proposed: int, accepted: int) -> None:
        """Learn a chain request's acceptances from one verified round: the first draft's (one trial a
        round) and the continuation's (the drafts after an accepted first, up to the first rejection;
        later drafts were never tested)."""
        if proposed == 0:
            return
        key, _ = self._alpha_key(request)
        first, cont = self.request_alphas(request)
        observed = 1.0 if accepted else 0.0
        self._learn(self.alpha, self._weight, key, first, observed, 1)
        trials = accepted - 1 + (1 if accepted < proposed else 0) if accepted else 0
        kept = (accepted - 1) / trials if trials else None  # the continuation's rate this round
        rate = self.ema / 4
        self.recent_alpha = (1 - rate) * self.recent_alpha + rate * observed
        if kept is not None:
            self._learn(self.cont, self._cont_weight, key, cont, accepted - 1, trials)
            self.recent_cont = kept if self.recent_cont is None else (1 - rate) * self.recent_cont + rate * kept
        cls = self._round_class.get(request.request_id)
        if cls is not None:
            # The mean of the class's rounds (the prior counting as one) until there are enough for the
            # EMA: a fresh drafter learns within a few rounds that one-token matches fail, instead of
            # paying for a dozen more at the prior's acceptance.
            seen = self._class_rounds[cls] = self._class_rounds.get(cls, 0) + 1
            weight = max(rate, 1.0 / (seen + 1))
            self.class_alpha[cls] = (1 - weight) * self.class_alpha.get(cls, self.prior_alpha) + weight * observed
            if kept is not None:
                self.class_cont[cls] = (1 - weight) * self.class_cont.get(cls, cont) + weight * kept

    def _learn(self, estimates: dict[Hashable, float], weights: dict[Hashable, float], key: Hashable,
               prev: float, successes: float, trials: int) -> None:
        """Successes over trials, the estimate so far counting as ``weight`` trials (the prior: one),
        each round's weighing ``alpha_decay`` times less per round and at most ``alpha_window`` in all."""
        weight = min(self.alpha_decay * weights.get(key, 1.0), self.alpha_window)
        estimates[key] = (prev * weight + successes) / (weight + trials)
        weights[key] = weight + trials

    def release(self, request: Request) -> None:
        rid = request.request_id
        for state in (self.alpha, self._weight, self.cont, self._cont_weight, self._plain_rounds, self._probe_wait,
                      self._round_class):
            state.pop(rid, None)
        for cls in self.class_alpha:
            for estimates in (self.alpha, self._weight, self.cont, self._cont_weight):
                estimates.pop((rid, cls), None)


def _gains(first: float, cont: float, most: int, floor: float) -> list[tuple[int, float]]:
    """``(j, first·cont^(j-1))`` for a request's drafts j = 1..most (the chance all of 1..j are
    accepted), while at least ``floor``."""
    out, gain = [], first
    for j in range(1, most + 1):
        if gain < floor:
            break
        out.append((j, gain))
        gain *= cont
    return out


def _cost(nodes: int, per_node: float, overhead: float) -> float:
    return 1.0 + (overhead if nodes else 0.0) + per_node * nodes


class EntropyStop:
    """Entropy-adaptive draft length (EGAG): a chain stops once the draft model is unsure.

    After at least ``spec_length_min`` drafts, a row stops when the EMA-smoothed normalised entropy of
    its draft distribution, H(q)/log|V|, exceeds ``threshold``: a flat q rarely survives
    verification, so further drafts would be wasted work. Only a drafter that drafts a chain from
    a distribution has a loop to stop; n-gram guesses are one-hot (entropy 0, never stopped) and
    Medusa drafts a whole tree in one call, so the engine refuses it there.
    """

    def __init__(self, spec_length_min: int, threshold: float, ema_beta: float = 0.5) -> None:
        self.spec_length_min = max(1, spec_length_min)
        self.threshold = threshold
        self.beta = ema_beta
        self._ema: dict[str, float] = {}

    def keep_drafting(self, requests: list[Request], draft_logits: torch.Tensor, step: int) -> torch.Tensor:
        """Which rows draft another token after ``step`` drafts, from their raw draft logits."""
        log_probs = torch.log_softmax(draft_logits.float(), dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1) / math.log(draft_logits.shape[-1])
        keep = []
        for request, h in zip(requests, entropy.tolist(), strict=True):
            prev = self._ema.get(request.request_id, h)
            smoothed = self.beta * prev + (1 - self.beta) * h
            self._ema[request.request_id] = smoothed
            keep.append(step < self.spec_length_min or smoothed <= self.threshold)
        return torch.tensor(keep, dtype=torch.bool)

    def release(self, request: Request) -> None:
        self._ema.pop(request.request_id, None)
