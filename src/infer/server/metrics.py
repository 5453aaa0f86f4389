"""Prometheus metrics in the text exposition format (no prometheus_client dependency).

Counters and histograms are updated by the engine thread; gauges are snapshots the engine
thread publishes after each step. ``render()`` may run on any thread.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Mapping, Sequence

Labels = tuple[tuple[str, str], ...]


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    items = list(labels) + ([extra] if extra else [])
    if not items:
        return ""
    escaped = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, v in items)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(items, escaped, strict=True)) + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str) -> None:
        self.name = name
        self.help = help
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class _LabelledValues(_Metric):
    """One number per label set, rendered as a sample each (counters and gauges)."""

    def __init__(self, name: str, help: str, initial_labels: Sequence[Labels] = ()) -> None:
        super().__init__(name, help)
        self._values: dict[Labels, float] = {labels: 0.0 for labels in initial_labels}

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(k)} {_fmt(v)}" for k, v in items]


class Counter(_LabelledValues):
    kind = "counter"

    def __init__(self, name: str, help: str, initial_labels: Sequence[Labels] = ((),)) -> None:
        super().__init__(name, help, initial_labels)

    def inc(self, amount: float = 1.0, labels: Labels = ()) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, labels: Labels = ()) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)


class Gauge(_LabelledValues):
    kind = "gauge"

    def set(self, value: float, labels: Labels = ()) -> None:
        with self._lock:
            self._values[labels] = float(value)

    def value(self, labels: Labels = ()) -> float | None:
        with self._lock:
            return self._values.get(labels)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help)
        self.bounds = sorted(float(b) for b in buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``value`` ``count`` times."""
        if count <= 0:
            return
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += count
            self._sum += value * count
            self._count += count

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines = self.header()
        cumulative = 0
        for bound, c in zip([*self.bounds, math.inf], counts, strict=True):
            cumulative += c
            lines.append(f"{self.name}_bucket{_labels((), ('le', _fmt(bound)))} {cumulative}")
        lines += [f"{self.name}_sum {_fmt(total)}", f"{self.name}_count {n}"]
        return lines


FINISH_REASONS = ("stop", "length", "grammar_error", "abort", "error")
# Refusal reasons shown from the start (at 0); others (an error's code) appear when first counted.
REFUSAL_REASONS = ("invalid_request", "context_length_exceeded", "invalid_api_key", "model_not_found",
                   "request_too_large", "queue_full", "server_shutting_down")


class ServerMetrics:
    """Every metric ``GET /metrics`` exposes.

    Besides infer's own metrics, the three gauges Kubernetes inference gateways (the Gateway API
    Inference Extension's endpoint picker, llm-d, KServe) route by, under the vLLM names their
    model-server protocol documents: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``
    and ``vllm:kv_cache_usage_perc`` (also as ``vllm:gpu_cache_usage_perc``, the name older
    gateway releases scrape), plus ``vllm:cache_config_info`` with the block size.
    """

    def __init__(self, max_draft: int = 0, model_name: str = "") -> None:
        self.model_labels: Labels = (("model_name", model_name),)
        self.requests = Counter("infer_requests_total", "Finished requests by finish reason.",
                                [(("finish_reason", r),) for r in FINISH_REASONS])
        self.rejected = Counter("infer_requests_rejected_total", "Requests refused before admission (queue full).")
        self.refused = Counter("infer_requests_refused_total",
                               "Requests refused with an error answer (4xx, 503), by reason: the error's code.",
                               [(("reason", r),) for r in REFUSAL_REASONS])
        self.prompt_tokens = Counter("infer_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("infer_generation_tokens_total", "Generated tokens.")
        self.ttft = Histogram("infer_time_to_first_token_seconds", "Time from arrival to the first token.",
                              [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60])
        self.itl = Histogram("infer_inter_token_latency_seconds",
                             "Time per generated token after the first (a step's gap shared by its tokens).",
                             [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5])
        self.e2e = Histogram("infer_e2e_request_latency_seconds", "Time from arrival to finish.",
                             [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600])
        self.running = Gauge("infer_num_requests_running", "Requests in the running batch.")
        self.waiting = Gauge("infer_num_requests_waiting", "Requests waiting for admission.")
        self.kv_free_tokens = Gauge("infer_kv_cache_free_tokens", "Free KV cache token rows, by pool.")
        self.kv_blocks_in_use = Gauge("infer_kv_cache_blocks_in_use", "KV blocks in use, by pool (paged only).")
        self.kv_blocks_total = Gauge("infer_kv_cache_blocks_total", "KV blocks in the pool (paged only).")
        self.spec_rounds = Counter("infer_spec_decode_rounds_total", "Speculative verification rounds.")
        self.spec_proposed = Counter("infer_spec_decode_proposed_tokens_total", "Draft tokens proposed.")
        self.spec_accepted = Counter("infer_spec_decode_accepted_tokens_total", "Draft tokens accepted.")
        self.spec_draft_nodes = Counter("infer_spec_decode_draft_nodes_total",
                                        "Drafts the target verified: a chain's tokens, every node of a tree "
                                        "(nodes / rounds is the mean tree size).")
        self.spec_proposed_by_position = Counter(
            "infer_spec_decode_proposed_by_position_total",
            "Rounds whose draft reached this position (1 = first draft token), counted when a request finishes.", ())
        self.spec_accepted_by_position = Counter(
            "infer_spec_decode_accepted_by_position_total",
            "Rounds whose draft was accepted at this position; / proposed = acceptance by position.", ())
        self.spec_acceptance = Gauge("infer_spec_decode_acceptance_rate", "Accepted / proposed draft tokens so far.")
        self.spec_per_round = Histogram("infer_spec_decode_accepted_tokens_per_round",
                                        "Draft tokens accepted in one verification round.",
                                        list(range(0, max(1, max_draft) + 1)))
        self.spec_acceptance.set(0.0)
        self.gateway_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for admission (gateway protocol).")
        self.gateway_running = Gauge("vllm:num_requests_running", "Requests in the running batch (gateway protocol).")
        self.gateway_kv_usage = Gauge("vllm:kv_cache_usage_perc",
                                      "KV cache usage, 0 to 1: the fullest pool (target, or draft when fuller).")
        self.gateway_gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc",
                                             "Same as vllm:kv_cache_usage_perc (the name older gateways read).")
        self.cache_config = Gauge("vllm:cache_config_info", "KV cache configuration (labels); value 1.")
        self.backend_info = Gauge("infer_backend_info", "What computes the forward pass, and why (labels); value 1.")

    def all(self) -> list[_Metric]:
        return [self.requests, self.rejected, self.refused, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                self.e2e, self.running, self.waiting, self.kv_free_tokens, self.kv_blocks_in_use,
                self.kv_blocks_total, self.spec_rounds, self.spec_proposed, self.spec_accepted,
                self.spec_draft_nodes, self.spec_proposed_by_position, self.spec_accepted_by_position,
                self.spec_acceptance, self.spec_per_round, self.gateway_waiting, self.gateway_running,
                self.gateway_kv_usage, self.gateway_gpu_cache_usage, self.cache_config, self.backend_info]

    def refuse(self, reason: str) -> None:
        self.refused.inc(labels=(("reason", reason),))

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.gateway_running.set(running, self.model_labels)
        self.gateway_waiting.set(waiting, self.model_labels)

    def set_kv_usage(self, fraction: float) -> None:
        self.gateway_kv_usage.set(fraction, self.model_labels)
        self.gateway_gpu_cache_usage.set(fraction, self.model_labels)

    def record_round(self, proposed: int, accepted: int, rounds: int, nodes: int) -> None:
        if rounds <= 0:
            return
        self.spec_rounds.inc(rounds)
        self.spec_proposed.inc(proposed)
        self.spec_draft_nodes.inc(nodes)
        self.spec_accepted.inc(accepted)
        self.spec_per_round.observe(accepted / rounds, rounds)
        total = self.spec_proposed.value()
        self.spec_acceptance.set(self.spec_accepted.value() / total if total else 0.0)

    def record_positions(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        """A finished request's per-position draft counts (``RequestMetrics.*_per_position``)."""
        for position, (p, a) in enumerate(zip(proposed, accepted, strict=True), start=1):
            labels = (("position", str(position)),)
            self.spec_proposed_by_position.inc(p, labels)
            self.spec_accepted_by_position.inc(a, labels)

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.all():
            lines += metric.render()
        return "\n".join(lines) + "\n"


_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def merge_expositions(by_source: Mapping[str, str], label: str) -> str:
    """One exposition from several of the same kind (e.g. one per replica): each metric family's
    HELP and TYPE once, then every source's samples with ``label="<source>"`` added."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for source, text in by_source.items():
        tag = _labels(((label, source),))[1:-1]  # 'label="source"', escaped
        family = ""
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    lines = headers.setdefault(family, [])
                    if not any(h.split(" ", 2)[1] == parts[1] for h in lines):
                        lines.append(line)
                continue
            match = _SAMPLE_NAME.match(line)
            if match is None:
                continue
            name, rest = match.group(), line[match.end():]
            if rest.startswith("{"):
                rest = "{" + tag + ("" if rest.startswith("{}") else ",") + rest[1:]
            else:
                rest = "{" + tag + "}" + rest
            samples.setdefault(family or name, []).append(name + rest)
    out: list[str] = []
    for family in dict.fromkeys([*headers, *samples]):
        out += headers.get(family, []) + samples.get(family, [])
    return "\n".join(out) + "\n"
