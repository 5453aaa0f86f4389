"""results.json and table.md from raw/*.json (llama-bench -o json, one file a build, file and round)."""
import json
import re
import statistics
from pathlib import Path

here = Path(__file__).resolve().parent
rows: dict[tuple[str, str, str], list[float]] = {}
meta: dict[str, object] = {}
for path in sorted((here / "raw").glob("*.r*.json")):
    m = re.fullmatch(r"(.+?)\.(build[\w-]*)\.r(\d+)\.json", path.name)
    if not m or path.stat().st_size == 0:
        continue
    name, build, _ = m.groups()
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError:  # a run still writing, or one that died
        continue
    for entry in entries:
        test = f"pp{entry['n_prompt']}" if entry["n_gen"] == 0 else f"tg{entry['n_gen']}"
        rows.setdefault((name, build, test), []).append(entry["avg_ts"])
        meta = {k: entry[k] for k in ("build_commit", "build_number", "cpu_info", "n_threads", "n_batch", "n_ubatch",
                                     "type_k", "type_v", "repack")}
results = [{"file": n, "build": b, "test": t, "median_tok_s": round(statistics.median(v), 2),
            "rounds": len(v), "per_round_tok_s": [round(x, 2) for x in v]}
           for (n, b, t), v in sorted(rows.items())]
(here / "results.json").write_text(json.dumps({"llama_bench": meta, "results": results}, indent=1) + "\n")
lines = ["| file | test | AMX (patched) tok/s | no AMX tok/s | AMX ÷ no AMX | rounds |",
         "|---|---|---:|---:|---:|---:|"]
for n in sorted({r[0] for r in rows}):
    for t in sorted({r[2] for r in rows if r[0] == n}):
        a, b = rows.get((n, "build-amx-patched", t)), rows.get((n, "build", t))
        if a and b:
            ma, mb = statistics.median(a), statistics.median(b)
            lines.append(f"| {n} | {t} | {ma:.1f} ({', '.join(f'{x:.1f}' for x in a)}) | "
                         f"{mb:.1f} ({', '.join(f'{x:.1f}' for x in b)}) | {ma / mb:.2f}× | {len(a)}/{len(b)} |")
(here / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
