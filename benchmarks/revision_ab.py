"""One benchmark command, run against two revisions of the plugin in alternating rounds.

    .venv/bin/python benchmarks/revision_ab.py --base HEAD~1 --rounds 4 \\
        --out benchmarks/results/sizer-ab-cpu -- table --dtype float32 --batch-sizes 4,16 \\
        --temperatures 0,1 --systems vanilla,eagle2-auto --num-prompts 4 --max-tokens 64 --reps 1

The base revision is checked out in a temporary git worktree (models and the venv
linked from this checkout); each round runs ``bench.py ARGS`` once from each tree, the
base with its own ``eagle_vllm`` (the editable install's finder removed from its import
path, the worktree put first), in ABBA order: a machine speeding up or slowing down
steadily favours neither. Each run is a fresh engine per system (bench.py's own
design), so no suffix or prefix cache outlives a run. Every run's speedups over the
vanilla of the same run are gathered into ``OUT.md``: per condition and system, the
median [min-max] over rounds for each revision, and their ratio. Run outputs stay in
``OUT-runs/``.

``--base-args`` appends bench.py arguments to the base runs only (later arguments win),
so one revision can be set against itself with another input, a head for instance:

    .venv/bin/python benchmarks/revision_ab.py --base HEAD --rounds 4 \\
        --base-args "--auto-config benchmarks/results/head-stage5-ab/stage4-calibrated.yaml" \\
        --out benchmarks/results/head-stage5-ab-batch1-cpu -- table --dtype float32 \\
        --batch-sizes 1 --systems vanilla,eagle2-auto \\
        --auto-config benchmarks/results/head-stage5-ab/stage5-calibrated.yaml

Relative paths in ``--base-args`` are resolved in this checkout, since the base worktree
holds only committed files.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import tau  # noqa: E402

SITECUSTOMIZE = """\
# revision_ab.py: import eagle_vllm from the base worktree, not the editable install.
import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if "editable" not in getattr(type(f), "__module__", "")
                    and "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, {tree!r})
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--base-args", default="",
                        help="bench.py arguments appended to the base runs only")  # fmt: skip
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="-- then bench.py's arguments (without --out)")  # fmt: skip
    args = parser.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    if not bench_args or "--out" in bench_args:
        raise SystemExit("error: give bench.py's arguments after --, without --out")
    base_extra = [_absolute(a) for a in shlex.split(args.base_args)]
    base = _git("rev-parse", "--short", args.base)
    head = _git("rev-parse", "--short", "HEAD")
    new_label = f"{head}+changes" if _git("status", "--porcelain", "eagle_vllm") else head
    base_label = f"{base} {args.base_args}" if base_extra else base
    runs = Path(args.out + "-runs").resolve()
    runs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="revision-ab-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree),
                        base], check=True)  # fmt: skip
        try:
            for name in ("models", ".venv"):
                (tree / name).symlink_to(ROOT / name)
            hook = Path(tmp) / "hook"
            hook.mkdir()
            (hook / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tree=str(tree)))
            trees = {
                "new": (ROOT, {}, []),
                "base": (tree, {"PYTHONPATH": str(hook)}, base_extra),
            }
            for r in range(args.rounds):
                for label in ("new", "base") if r % 2 == 0 else ("base", "new"):
                    where, env, extra = trees[label]
                    out = runs / f"{label}-{r}"
                    cmd = [sys.executable, "benchmarks/bench.py", *bench_args, *extra,
                           "--out", str(out)]  # fmt: skip
                    print(f"== round {r + 1} of {args.rounds}: {label}", flush=True)
                    subprocess.run(cmd, cwd=where, env={**os.environ, **env}, check=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           check=False)  # fmt: skip
    md = summarize(runs, args.rounds, {"new": new_label, "base": base_label}, bench_args, argv)
    Path(args.out + ".md").write_text(md)
    print(md)
    return 0


def _absolute(arg: str) -> str:
    """A base-only argument naming a file or folder of this checkout, made absolute."""
    return str((ROOT / arg).resolve()) if (ROOT / arg).exists() else arg


def _git(*args: str) -> str:
    """A git command's output in this checkout."""
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


# the fields that name a condition in bench.py's rows: table's, then curve's
CONDITION_FIELDS = ("dataset", "temperature", "batch", "concurrency")


def speedups(path: Path) -> dict[tuple, float]:
    """(condition..., system) -> tok/s over the same run's vanilla, for ``bench.py table``
    (dataset, T, batch) and ``bench.py curve`` (concurrency) runs."""
    rows = json.loads(path.read_text())["rows"]

    def condition(row: dict) -> tuple:
        return tuple(row[k] for k in CONDITION_FIELDS if k in row)

    vanilla = {condition(r): r["tok_s"] for r in rows if r["system"] == "vanilla"}
    return {
        (*condition(r), r["system"]): r["tok_s"] / vanilla[condition(r)]
        for r in rows
        if r["system"] != "vanilla" and condition(r) in vanilla
    }


def taus(path: Path) -> dict[tuple, float]:
    """(condition..., system) -> the run's τ (1 + accepted / drafts), where it drafted."""
    rows = json.loads(path.read_text())["rows"]
    return {
        (*(r[k] for k in CONDITION_FIELDS if k in r), r["system"]): tau(r["spec"])
        for r in rows
        if r.get("spec") and tau(r["spec"]) is not None
    }


def summarize(runs: Path, rounds: int, labels: dict, bench_args: list, argv) -> str:
    per = {label: [speedups(runs / f"{label}-{r}.json") for r in range(rounds)] for label in labels}
    per_tau = {label: [taus(runs / f"{label}-{r}.json") for r in range(rounds)] for label in labels}
    keys = sorted(set().union(*(s.keys() for s in per["new"])))
    first_row = json.loads((runs / "new-0.json").read_text())["rows"][0]
    fields = [k for k in CONDITION_FIELDS if k in first_row]
    names = {"dataset": "dataset", "temperature": "T", "batch": "batch",
             "concurrency": "requests in flight"}  # fmt: skip

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    command = " ".join([".venv/bin/python benchmarks/revision_ab.py",
                        *(argv if argv is not None else sys.argv[1:])])  # fmt: skip
    lines = [
        f"# A/B: {labels['new']} against {labels['base']}",
        "",
        f"Command: `{command}`",
        "",
        f"bench.py {' '.join(bench_args)}; {rounds} rounds, ABBA; speedup over the vanilla "
        "of the same run, median [min-max] over rounds.",
        "",
        "| "
        + " | ".join(names[f] for f in fields)
        + f" | system | {labels['base']} | {labels['new']} | ratio of medians | τ, base | τ, new |",
        "|" + "---|" * (len(fields) + 6),
    ]
    for key in keys:
        new = [s[key] for s in per["new"] if key in s]
        old = [s[key] for s in per["base"] if key in s]
        if not new or not old:
            continue
        ratio = statistics.median(new) / statistics.median(old)
        shown = [f"{v:g}" if isinstance(v, float) else str(v) for v in key]
        tau_cells = []
        for label in ("base", "new"):
            values = [t[key] for t in per_tau[label] if key in t]
            tau_cells.append(cell(values) if values else "-")
        lines.append(
            f"| {' | '.join(shown)} | {cell(old)} | {cell(new)} | {ratio:.2f} | "
            f"{' | '.join(tau_cells)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
