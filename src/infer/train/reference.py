"""The reference model pair: a target and a distilled draft, trained offline and cached.

``build_reference_pair("small")`` pretrains a ~10M-parameter Llama on the standard library's
source, distils a <1M-parameter draft from it, measures the pair on held-out text and caches the
result under ``$XDG_CACHE_HOME/infer/reference-pair-<size>`` (``~/.cache/infer/...``). A later
call finds the folder complete (``reference_pair.json`` carries the settings hash) and reuses it.

Layout of the pair folder::

    target/            Hugging Face model folder (with training_args.json, train_log.json)
    draft/             Hugging Face model folder sharing target's tokenizer
    metrics.json       alpha, greedy agreement, KL, losses, parameter counts, timings
    reference_pair.json  the settings and their hash; written last (completeness marker)

The pair is built in a hidden ``.reference-pair-<size>.partial`` sibling (resumed if a previous
build was interrupted) and renamed into place when finished; a lock file serialises concurrent
builders, so the second one simply reuses the first one's result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from infer.fileio import default_cache_dir, publish_folder
from infer.loader import load_model
from infer.models.layers import DecoderOnlyLM
from infer.train.common import (
    configure_threads,
    count_params,
    is_complete_model,
    pick_device,
    say,
    write_json,
)
from infer.train.data import TOKENS_FILE, TokenData, eval_windows
from infer.train.distill import DistillConfig, distill, pair_metrics
from infer.train.pretrain import PretrainConfig, pretrain

MARKER_FILE = "reference_pair.json"
METRICS_FILE = "metrics.json"
SETTINGS_FORMAT = 2  # bump when the build procedure changes in a way the settings do not show
STAGES = ("pretrain", "distill", "medusa")


@dataclass(frozen=True)
class ReferenceSettings:
    """Fixed recipe for one pair size: PretrainConfig / DistillConfig / MedusaTrainConfig fields (minus paths).

    Every stage is budgeted in optimiser steps, never in seconds: a seed then gives the same pair
    on a fast machine and on a busy one, only sooner or later.
    """

    pretrain: dict[str, Any]
    distill: dict[str, Any]
    medusa: dict[str, Any] = field(default_factory=dict)  # Medusa heads for the target (empty: none)
    eval_windows: int = 128  # held-out windows (of the target's seq_len) for the final alpha / agreement
    description: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for stage in STAGES:
            recipe = getattr(self, stage)
            if not recipe and stage == "medusa":
                continue
            steps = recipe.get("max_steps")
            if not isinstance(steps, int) or steps < 1 or recipe.get("time_budget") is not None:
                raise ValueError(f"reference recipe {stage}: give max_steps (a positive number of steps) and no "
                                 f"time_budget, so the pair does not depend on the machine's speed "
                                 f"(got max_steps={steps!r}, time_budget={recipe.get('time_budget')!r})")

    def total_steps(self) -> dict[str, int]:
        return {stage: int(getattr(self, stage)["max_steps"]) for stage in STAGES if getattr(self, stage)}

    def settings_hash(self) -> str:
        """The target and draft recipe: a change rebuilds the whole pair."""
        return _digest({"pretrain": self.pretrain, "distill": self.distill, "eval_windows": self.eval_windows,
                        "format": SETTINGS_FORMAT})

    def medusa_hash(self) -> str:
        """The Medusa heads' recipe: a change retrains only the heads (minutes, not the hour)."""
        return _digest({"medusa": self.medusa, "format": SETTINGS_FORMAT})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Step budgets, so a seed gives the same pair on any machine. The expected times are only shown: for
# ``small`` the CPU seconds of one thread measured on the 2-core AMD EPYC machine (an idle core's wall
# time); for ``large`` the wall time of the time-budgeted recipe its step counts were sized to match. ``large`` trains under bfloat16 autocast
# even on CPU: where the CPU computes bfloat16 natively that is faster than float32 for its 40M
# target (docs/benchmarks-history.md, "The reference pairs").
REFERENCE_SIZES: dict[str, ReferenceSettings] = {
    "small": ReferenceSettings(
        description="~10M target, ~0.7M draft, 4 Medusa heads",
        pretrain=dict(vocab_size=2048, hidden_size=320, num_layers=8, num_heads=5, num_kv_heads=1,
                      intermediate_size=864, seq_len=256, batch_size=8, lr=3e-3, warmup_steps=30,
                      max_train_chars=4_000_000, max_steps=180, time_budget=None, eval_every=0,
                      eval_windows=16, checkpoint_every=60.0),
        distill=dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384,
                     batch_size=8, lr=4e-3, warmup_steps=30, max_steps=180, time_budget=None, eval_every=0,
                     eval_windows=16, checkpoint_every=60.0),
        medusa=dict(heads=4, max_steps=60, time_budget=None, eval_windows=16),
        metadata={"expected_s": {"pretrain": 310.0, "distill": 155.0, "medusa": 75.0},
                  "expected_on": "one idle CPU core (less with more)"},
    ),
    "large": ReferenceSettings(
        description=">= 40M target whose forward costs >= 10x the draft's",
        pretrain=dict(vocab_size=8192, hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=2,
                      intermediate_size=1536, seq_len=512, batch_size=16, lr=1.5e-3, warmup_steps=100,
                      max_train_chars=None, max_steps=220, time_budget=None, eval_every=50,
                      eval_windows=32, checkpoint_every=300.0, precision="bfloat16"),
        distill=dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=768,
                     batch_size=16, lr=3e-3, warmup_steps=100, max_steps=200, time_budget=None, eval_every=100,
                     eval_windows=32, checkpoint_every=300.0, precision="bfloat16"),
        medusa=dict(heads=4, max_steps=60, time_budget=None, eval_windows=32, precision="bfloat16"),
        metadata={"expected_s": {"pretrain": 2400.0, "distill": 900.0, "medusa": 300.0},
                  "expected_on": "2 CPU cores"},
    ),
}


def _digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def reference_pair_dir(size: str) -> Path:
    return default_cache_dir() / f"reference-pair-{size}"


def _read_marker(folder: Path) -> dict[str, Any]:
    try:
        saved = json.loads((folder / MARKER_FILE).read_text())
    except (json.JSONDecodeError, OSError):
        return {}
    return saved if isinstance(saved, dict) else {}


def is_complete_pair(folder: Path, settings: ReferenceSettings) -> bool:
    """Marker present with this recipe's hash, and both model folders complete (heads aside)."""
    return (_read_marker(folder).get("settings_hash") == settings.settings_hash()
            and is_complete_model(folder / "target") and is_complete_model(folder / "draft"))


def has_current_heads(folder: Path, settings: ReferenceSettings) -> bool:
    """The target's Medusa heads exist and follow this recipe (trivially true for a recipe without)."""
    if not settings.medusa:
        return True
    from infer.models.medusa_heads import CONFIG_FILE, HEADS_FILE

    heads = folder / "target" / "medusa"
    return ((heads / HEADS_FILE).is_file() and (heads / CONFIG_FILE).is_file()
            and _read_marker(folder).get("medusa_hash") == settings.medusa_hash())


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock next to ``folder`` (no-op where fcntl is unavailable)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no cross-process lock
        yield
        return
    with open(folder.parent / f".{folder.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_reference_pair(size: str = "small", out: str | os.PathLike[str] | None = None, force: bool = False,
                         progress: bool = True, *, settings: ReferenceSettings | None = None,
                         device: str | None = None) -> tuple[Path, Path]:
    """Return ``(target_dir, draft_dir)`` of the reference pair, building it first unless cached.

    ``out`` overrides the cache folder; ``force`` rebuilds even if a complete pair is there;
    ``settings`` replaces the named size's recipe (tests use tiny ones); ``device`` (cpu, cuda, auto)
    overrides the recipe's (default auto). The device does not enter the settings hash.
    """
    if settings is None:
        if size not in REFERENCE_SIZES:
            raise ValueError(f"unknown reference pair size {size!r}; choose from {', '.join(REFERENCE_SIZES)}")
        settings = REFERENCE_SIZES[size]
    folder = Path(out).expanduser() if out is not None else reference_pair_dir(size)
    with _build_lock(folder):
        if not force and is_complete_pair(folder, settings):
            if not has_current_heads(folder, settings):
                say(f"reference pair ({size}) cached at {folder}; its Medusa recipe changed: retraining the heads",
                    progress)
                _train_heads(folder / "target", settings, device, progress)
                marker = _read_marker(folder)
                write_json(folder / MARKER_FILE, {**marker, "medusa_hash": settings.medusa_hash(),
                                                  "settings": settings.to_dict()})
            say(f"reference pair ({size}) cached at {folder}", progress)
            return folder / "target", folder / "draft"
        _build(folder, size, settings, force, progress, device)
    return folder / "target", folder / "draft"


def _train_heads(target_dir: Path, settings: ReferenceSettings, device: str | None, progress: bool) -> None:
    """Train the recipe's Medusa heads into ``target_dir/medusa`` (replacing any there, atomically)."""
    from infer.train.medusa import MedusaTrainConfig, train_medusa

    options = {**settings.medusa, "target": target_dir}
    if device is not None:
        options["device"] = device
    train_medusa(MedusaTrainConfig(**options), progress=progress)


def _build(folder: Path, size: str, settings: ReferenceSettings, force: bool, progress: bool,
           device: str | None) -> None:
    digest = settings.settings_hash()
    work = folder.parent / f".{folder.name}.partial"
    partial_marker = work / "building.json"
    if work.exists():
        saved: dict[str, Any] = {}
        with contextlib.suppress(json.JSONDecodeError, OSError):
            saved = json.loads(partial_marker.read_text())
        if force or saved.get("settings_hash") != digest:
            shutil.rmtree(work)
        else:
            say(f"continuing the interrupted build in {work}", progress)
            if saved.get("medusa_hash") != settings.medusa_hash():
                shutil.rmtree(work / "target" / "medusa", ignore_errors=True)  # heads of another recipe
    work.mkdir(parents=True, exist_ok=True)
    write_json(partial_marker, {"settings_hash": digest, "medusa_hash": settings.medusa_hash(), "size": size})
    say(f"building reference pair ({size}, settings {digest}) in {work}", progress)
    say(build_plan(settings), progress)

    target_dir, draft_dir = work / "target", work / "draft"
    pre = {**settings.pretrain, "out": target_dir, "resume": True}
    dis = {**settings.distill, "target": target_dir, "out": draft_dir, "resume": True}
    if device is not None:
        pre["device"] = dis["device"] = device
    # Stage times: measured now, or read from a stage finished by an earlier (interrupted) build.
    # CPU seconds say how long a stage takes on an idle machine better than wall time on a busy one.
    stage_s: dict[str, float] = {}
    cpu_s: dict[str, float] = {}
    reused: list[str] = []
    for stage, folder_done, run in (("target", target_dir, lambda: pretrain(PretrainConfig(**pre), progress=progress)),
                                    ("draft", draft_dir, lambda: distill(DistillConfig(**dis), progress=progress))):
        t0, c0 = time.perf_counter(), time.process_time()
        if is_complete_model(folder_done):
            stage_s[stage] = _logged_wall_time(folder_done)
            reused.append(stage)
        else:
            run()
            stage_s[stage] = time.perf_counter() - t0
            cpu_s[stage] = time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    if settings.medusa and not (target_dir / "medusa" / "medusa_config.json").is_file():
        _train_heads(target_dir, settings, device, progress)
    stage_s["medusa"] = time.perf_counter() - t0
    cpu_s["medusa"] = time.process_time() - c0

    t0 = time.perf_counter()
    metrics = evaluate_pair(target_dir, draft_dir, settings.eval_windows, pre.get("device", "auto"),
                            pre.get("threads"))
    stage_s["evaluation"] = time.perf_counter() - t0
    metrics.update({"size": size, "settings_hash": digest, "build_wall_time_s": round(sum(stage_s.values()), 1),
                    "target_build_s": round(stage_s["target"], 1), "draft_build_s": round(stage_s["draft"], 1),
                    "medusa_build_s": round(stage_s["medusa"], 1), "resumed": bool(reused),
                    "cpu_s": {stage: round(v, 1) for stage, v in cpu_s.items()}})
    write_json(work / METRICS_FILE, metrics)
    partial_marker.unlink()
    write_json(work / MARKER_FILE, {"settings_hash": digest, "medusa_hash": settings.medusa_hash(), "size": size,
                                    "settings": settings.to_dict(), "complete": True})
    publish_folder(work, folder)
    say(f"reference pair ({size}) ready at {folder} in {metrics['build_wall_time_s']:.0f}s: "
        f"alpha {metrics['alpha']:.3f}, greedy agreement {metrics['greedy_agreement']:.3f}, "
        f"target {metrics['target_params'] / 1e6:.2f}M / draft {metrics['draft_params'] / 1e6:.2f}M params",
        progress)


def build_plan(settings: ReferenceSettings) -> str:
    """One line: each stage's step budget and the time it took on the 2-core machine it was sized on."""
    expected = settings.metadata.get("expected_s", {})
    def about(seconds: float) -> str:
        return f"~{seconds:.0f} s" if seconds < 90 else f"~{seconds / 60:.0f} min"

    parts = [f"{stage} {steps} steps" + (f" ({about(expected[stage])})" if stage in expected else "")
             for stage, steps in settings.total_steps().items()]
    total = sum(expected.values())
    where = settings.metadata.get("expected_on", "this machine")
    tail = f"; about {total / 60:.0f} minutes on {where}, longer on a busy machine" if total else ""
    return "plan: " + ", ".join(parts) + tail + " (each bar shows its own remaining time)"


def _logged_wall_time(model_dir: Path) -> float:
    """Wall time a finished training stage recorded in its train_log.json (0 if it did not)."""
    with contextlib.suppress(OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return float(json.loads((model_dir / "train_log.json").read_text())["wall_time_s"])
    return 0.0


def _median_forward_ms(model: DecoderOnlyLM, ids: torch.Tensor, repeats: int = 7) -> float:
    times = []
    with torch.inference_mode():
        model(ids)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.compute_logits(model(ids))
            if ids.device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _matmul_params(model: DecoderOnlyLM) -> int:
    """Parameters used in matrix multiplies per token (the embedding lookup is free; the head is not)."""
    cfg = model.config
    total = count_params(model)
    return total if cfg.tie_word_embeddings else total - cfg.vocab_size * cfg.hidden_size


def evaluate_pair(target_dir: Path, draft_dir: Path, num_windows: int, device: str = "auto",
                  threads: int | None = None) -> dict[str, Any]:
    """Load both saved folders and measure them on held-out windows (alpha at T=1, greedy agreement...)."""
    dev = pick_device(device)
    configure_threads(dev, threads)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, tcfg = load_model(target_dir, dtype=dtype, device=str(dev))
    draft, _ = load_model(draft_dir, dtype=dtype, device=str(dev))
    targs = json.loads((target_dir / "training_args.json").read_text())
    seq_len = int(targs.get("seq_len", 256))
    data = TokenData.load(target_dir / TOKENS_FILE)
    if data is None:
        raise FileNotFoundError(f"{target_dir / TOKENS_FILE}: token cache missing; cannot evaluate the pair")
    source = data.heldout if data.num_heldout_tokens >= 2 else data.train
    windows = eval_windows(source, seq_len, num_windows)
    m = pair_metrics(target, draft, windows, dev)
    probe = windows[:1, :-1].to(dev) if windows.shape[0] else torch.zeros((1, 16), dtype=torch.long, device=dev)
    t_ms, d_ms = _median_forward_ms(target, probe), _median_forward_ms(draft, probe)
    return {
        "alpha": round(m["alpha"], 4), "greedy_agreement": round(m["agreement"], 4), "kl": round(m["kl"], 4),
        "target_heldout_loss": round(m["target_loss"], 4), "draft_heldout_loss": round(m["draft_loss"], 4),
        "heldout_tokens": int(windows[:, 1:].numel()), "seq_len": seq_len,
        "target_params": count_params(target), "draft_params": count_params(draft),
        "matmul_params_ratio": round(_matmul_params(target) / _matmul_params(draft), 2),
        "forward_ms": {"target": round(t_ms, 2), "draft": round(d_ms, 2), "tokens": int(probe.shape[1])},
        "forward_time_ratio": round(t_ms / max(d_ms, 1e-9), 2),
        "vocab_size": tcfg.vocab_size, "device": str(dev), "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
