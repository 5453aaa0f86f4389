"""``infer audit``: check that speculative decoding is lossless on your own models and settings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from infer.audit.checks import CHECKS, AuditSettings, exit_code, run_audit


def add_subparser(sub: Any) -> None:
    from infer.engine.options import add_engine_args
    from infer.sampling.options import add_sampling_args

    p = sub.add_parser("audit", help="check that speculation is lossless on your target, drafter and sampling settings",
                       description="Distribution (chi-square against the target's exact next-token distributions), "
                       "greedy identity, and acceptance/speedup checks. Exit status: 0 passed, 1 a check failed, "
                       "3 no failure but too little statistical power to pass, 2 bad arguments.")
    add_engine_args(p)
    # An audit tests the verifier, so by default every round drafts: the serving default (goodput)
    # may stop drafting where drafts do not pay, and a context that never drafts proves nothing.
    p.set_defaults(spec_length_policy="fixed")
    # With a grammar every check runs under it, and with grammar drafting (the default) its forced
    # tokens are drafted too: a speculator is then optional.
    add_sampling_args(p, ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "json_schema", "json_object",
                          "regex", "grammar"))
    p.add_argument("--samples", type=int, default=3000, help="speculative samples per context (distribution check)")
    p.add_argument("--contexts", type=int, default=3, help="how many of the prompts the distribution check uses")
    p.add_argument("--prompts", default=None,
                   help="prompt file (JSON list, JSON lines with 'prompt', or text split by lines of ---); "
                   "default: built-in varied prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt for the greedy and acceptance checks")
    p.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    p.add_argument("--alpha", type=float, default=0.01, help="significance level over all distribution tests")
    p.add_argument("--power", type=float, default=0.8)
    p.add_argument("--max-detectable-tv", type=float, default=0.1,
                   help="a context counts toward a pass only if its tests detect this total-variation deviation")
    p.add_argument("--tie-tolerance", type=float, default=None,
                   help="logit difference below which a greedy divergence is a rounding near-tie "
                   "(default: from the dtype's precision)")
    p.add_argument("--batch-size", type=int, default=128, help="requests batched while sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT", help="write the JSON report to OUT ('-': stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from infer.data.workloads import load_prompts
    from infer.engine.config import EngineConfig
    from infer.engine.options import engine_options
    from infer.sampling.options import sampling_params

    sampling = sampling_params(args)
    options = engine_options(args)
    EngineConfig.from_options(**options)  # validate the flags before the (slow) model loads
    extra: dict[str, Any] = {"prompts": load_prompts(args.prompts)} if args.prompts else {}
    settings = AuditSettings(engine=options, sampling=sampling, contexts=args.contexts, samples=args.samples,
                             max_tokens=args.max_tokens, checks=args.checks, alpha=args.alpha, power=args.power,
                             max_detectable_tv=args.max_detectable_tv, tie_tolerance=args.tie_tolerance,
                             batch_size=args.batch_size, seed=args.seed, **extra)
    report = run_audit(settings, say=lambda msg: print(f"[audit] {msg}", file=sys.stderr, flush=True))
    to_stdout = args.json == "-"
    print(format_report(report), file=sys.stderr if to_stdout else sys.stdout)
    if args.json:
        text = json.dumps(report, indent=2)
        if to_stdout:
            print(text)
        else:
            Path(args.json).write_text(text + "\n", encoding="utf-8")
    return exit_code(report)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable verdicts: one block per check, then the overall verdict."""
    lines = []
    checks = report["checks"]
    for name, check in checks.items():
        lines.append(f"{name:<13} {check['verdict']:<18} {check['summary']}")
        if name == "distribution":
            for c in check.get("contexts", []):
                lines.append(f"    context {c['prompt'][-40:]!r}: {c['samples_used']}/{c['samples']} samples in "
                             f"{len(c['first_tokens'])} first-token groups, drafted {c['drafted_share']:.0%}, "
                             f"acceptance {_num(c['acceptance_rate'])}")
                for key, label in (("next_token", "next token"), ("next_two_tokens", "next two tokens")):
                    t = c[key]
                    lines.append(f"      {label:<16} p={_num(t['p_value'], '.3g')} (chi2 {t['statistic']:.1f}, "
                                 f"dof {t['dof']}), observed TV {_num(t['observed_tv'])}, "
                                 f"detectable TV {_num(t['detectable_tv'])}")
                if c["impossible_samples"]:
                    lines.append(f"      {c['impossible_samples']} samples fell on tokens the target gives probability 0")
        elif name == "greedy":
            for g in check["prompts"]:
                d = g["first_divergence"]
                if d is not None:
                    lines.append(f"    {g['prompt'][:40]!r}: diverges at token {d['index']}: plain {d['plain_text']!r} vs "
                                 f"speculative {d['speculative_text']!r}, logit gap {_num(d['chosen_margin'], '.4g')}, "
                                 f"top-2 margin {d['top2_margin']:.4g} (tolerance {d['tie_tolerance']:.2g})")
        elif name == "acceptance" and check.get("acceptance_by_position"):
            by_position = ", ".join(_num(a, ".2f") for a in check["acceptance_by_position"])
            lines.append(f"    acceptance by draft position: {by_position}")
    lines.append(f"audit         {report['verdict']}")
    return "\n".join(lines)


def _num(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)
