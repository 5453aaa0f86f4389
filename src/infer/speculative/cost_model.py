"""Online timing model: what a target pass and a draft step cost, as a function of batch size."""

from __future__ import annotations


class LinearFit:
    """Exponentially forgetting least squares for ``time ≈ a + b * x``."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.n = d * self.n + 1
        self.sx, self.sy = d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    @property
    def ready(self) -> bool:
        return self.n > 0

    def coefficients(self) -> tuple[float, float]:
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x**2
        slope = 0.0
        if var > 1e-9 * max(1.0, mean_x**2):
            slope = max(0.0, (self.sxy / self.n - mean_x * mean_y) / var)
        return max(mean_y - slope * mean_x, 1e-9), slope

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class CostModel:
    """Effective draft cost per request, c_eff(B) = (D(B) + b·B) / (a + b·B).

    A target pass over n tokens costs about a + b·n; a batched draft step for B requests costs
    D(B). Per request and round, speculating K tokens adds K draft steps (shared by the batch)
    and K extra verified tokens, against the request's share (a + b·B)/B of a plain decode step.
    With B = 1 and b = 0 this is Theorem 3.8's c; as the batch grows b·B dominates and c_eff → 1,
    which is why the goodput policy stops speculating under load.
    """

    def __init__(self, prior_cost: float) -> None:
        self.prior_cost = prior_cost
        self.target = LinearFit()  # x = tokens in the pass
        # Draft steps are sampled less often once goodput settles on K = 0 (only probes draft), so
        # forget faster: one slow early sample must not keep c high for long.
        self.draft = LinearFit(decay=0.7)  # x = requests in the draft step

    def observe_target(self, num_tokens: int, seconds: float) -> None:
        self.target.observe(num_tokens, seconds)

    def observe_draft_step(self, batch_size: int, seconds: float) -> None:
        self.draft.observe(batch_size, seconds)

    def effective_cost(self, batch_size: int) -> float:
        if not self.target.ready:
            return self.prior_cost
        a, b = self.target.coefficients()
        draft = self.draft.predict(batch_size) if self.draft.ready else self.prior_cost * (a + b * batch_size)
        return (draft + b * batch_size) / (a + b * batch_size)

    def draft_target_ratio(self, batch_size: int = 1) -> float | None:
        """Measured c: one draft step over one plain target decode step (None until both are seen)."""
        if not (self.target.ready and self.draft.ready):
            return None
        return self.draft.predict(batch_size) / self.target.predict(batch_size)
