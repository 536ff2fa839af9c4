"""Render docs/benchmarks.md from the result files in benchmarks/results/*.jsonl.

    python -m benchmarks.render_results            # rewrite docs/benchmarks.md
    python -m benchmarks.render_results --check    # exit 1 if docs/benchmarks.md is out of date

(`python benchmarks/render_results.py` does the same.) Each line of a results file is one JSON
object: a result, or the header of a run (its command and time). The page groups them by file
and by `bench`, one table row per line: the figures, the baseline they are compared against,
the ratios, and where they come from (date, machine, command, code snapshot). Figures of other
systems that were not measured in the same run are shown as recorded, with their date and
version, as the line labels them. Standard library only, so it runs without the package.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
OUTPUT = ROOT / "docs" / "benchmarks.md"
COMMAND = "python -m benchmarks.render_results"

# Where a figure comes from: shown in their own columns, not among the figures.
DATE_KEYS = ("date", "time")
MACHINE_KEYS = ("machine", "device")
COMMAND_KEYS = ("command",)
SNAPSHOT_KEYS = ("snapshot", "commit", "code", "commit_context", "context", "recorded_in_commit", "date_source",
                 "source")
BENCH_KEYS = ("bench", "benchmark")
META_KEYS = frozenset(DATE_KEYS + MACHINE_KEYS + COMMAND_KEYS + SNAPSHOT_KEYS + BENCH_KEYS)


def is_baseline_key(key: str) -> bool:
    """The baseline's name and figures, and figures of other systems recorded elsewhere."""
    return (key in ("baseline", "theirs", "all_theirs", "peer_recorded") or key.startswith(("baseline_", "vllm_"))
            or key.endswith("_recorded"))


def is_ratio_key(key: str) -> bool:
    return any(word in key for word in ("ratio", "speedup", "slowdown", "fraction_of", "mfu", "_vs_"))


def load(results_dir: Path = RESULTS_DIR) -> dict[str, list[dict]]:
    """Every results file's lines, by file name, in file order; a line that is not JSON fails
    naming the file and line."""
    files: dict[str, list[dict]] = {}
    for path in sorted(results_dir.glob("*.jsonl")):
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path.name}:{number}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise TypeError(f"{path.name}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
        files[path.name] = rows
    return files


def show(value: object) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    for raw, safe in (("\\", "\\\\"), ("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*"), ("_", "\\_"),
                      ("`", "'"), ("[", "\\["), ("]", "\\]"), ("\n", " ")):
        text = text.replace(raw, safe)
    return text


def pairs(row: dict, keys: list[str]) -> str:
    return "; ".join(f"{key}={show(row[key])}" for key in keys)


def first(row: dict, keys: tuple[str, ...]) -> str:
    for key in keys:
        if key in row:
            return show(row[key])
    return ""


def baseline_prefix(row: dict) -> str | None:
    """The first word of the baseline's name, which its figures' keys start with in older lines
    ("unconstrained" -> unconstrained_tok_s, "bf16 weights, ..." -> bf16_ms_per_token)."""
    words = re.findall(r"[A-Za-z0-9]+", str(row.get("baseline", "")).lower())
    if not words or len(words[0]) < 3 or words[0] in ("same", "the", "one", "none", "not"):
        return None
    return words[0] + "_"


def render_row(row: dict) -> str:
    prefix = baseline_prefix(row)

    def baseline_figure(key: str) -> bool:
        return is_baseline_key(key) or (prefix is not None and key.startswith(prefix))

    figures = [k for k in row if k not in META_KEYS and not baseline_figure(k) and not is_ratio_key(k)]
    baseline = sorted((k for k in row if k not in META_KEYS and baseline_figure(k)), key=lambda k: k != "baseline")
    ratios = [k for k in row if k not in META_KEYS and is_ratio_key(k) and not baseline_figure(k)]
    date = first(row, ("date",)) or first(row, ("time",))
    if "date" in row and "time" in row:
        date = f"{row['date']} ({row['time']})"
    origin = "; ".join(f"{key}: {show(row[key])}" for key in SNAPSHOT_KEYS if key in row)
    command = first(row, COMMAND_KEYS)
    if origin:
        command = f"{command} [{origin}]" if command else f"[{origin}]"
    cells = [pairs(row, figures), pairs(row, baseline), pairs(row, ratios), date,
             first(row, MACHINE_KEYS), command]
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def render(results_dir: Path = RESULTS_DIR) -> str:
    files = load(results_dir)
    out = [
        ("<!-- Generated by `python -m benchmarks.render_results` from benchmarks/results/*.jsonl."
         " Do not edit: change the results files and run it again. -->"),
        "",
        "# Benchmark results",
        "",
        f"Generated by `{COMMAND}` from the files in `benchmarks/results/`; do not edit this page by",
        "hand. One row per line of a results file, grouped by file and benchmark, in the order they",
        "were recorded. Each row: the figures, the baseline they are compared against (measured in the",
        "same run unless the row says it was recorded elsewhere, with its date and version), the",
        "ratios, and where the figures come from (date, machine, command and code snapshot).",
        "\"not recorded\" marks what the results did not keep. `recorded_in_commit` is the commit",
        "that added a line to the results (the code measured is at or just before it), `date_source`",
        "says where a date that the run did not print comes from, and `source` where a figure was",
        "taken from (a log in `benchmarks/results/gpu_logs/`, or the README that first stated it).",
        "Lines without figures are the headers of their runs.",
        "",
    ]
    for name, rows in files.items():
        out += [f"## {name}", ""]
        benches: dict[str, list[dict]] = {}
        for row in rows:
            benches.setdefault(first(row, BENCH_KEYS) or "(no bench name)", []).append(row)
        for bench, bench_rows in benches.items():
            out += [f"### {name[:-len('.jsonl')]}: {bench}", "",
                    "| figures | baseline | ratio | date | machine | command [snapshot] |",
                    "|---|---|---|---|---|---|"]
            out += [render_row(row) for row in bench_rows]
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if docs/benchmarks.md differs from what would be rendered")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({sum(len(r) for r in load().values())} results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
