"""benchmarks/revision_ab.py's summary: speedups over the same run's vanilla, per revision."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from revision_ab import _absolute, speedups, summarize  # noqa: E402


def _table_run(path: Path, vanilla: float, auto: float, accepted: int | None = None) -> None:
    rows = [
        {"system": system, "rep": 0, "dataset": "mtbench", "temperature": 1.0, "batch": 4,
         "tok_s": tok_s}
        for system, tok_s in (("vanilla", vanilla), ("eagle2-auto", auto))
    ]  # fmt: skip
    if accepted is not None:  # vLLM's counters: 100 drafting steps
        rows[1]["spec"] = {"num_drafts": 100, "num_accepted_tokens": accepted}
    path.write_text(json.dumps({"args": {}, "rows": rows}))


def _curve_run(path: Path, vanilla: float, auto: float) -> None:
    rows = [
        {"system": system, "rep": 0, "concurrency": 16, "tok_s": tok_s}
        for system, tok_s in (("vanilla", vanilla), ("eagle2-auto", auto))
    ]
    path.write_text(json.dumps({"args": {}, "rows": rows}))


def test_each_run_is_divided_by_its_own_vanilla(tmp_path):
    # vanilla drifts 2x between rounds; the ratios do not
    for r, (vanilla, new, old) in enumerate([(100.0, 98.0, 87.0), (50.0, 48.0, 45.0)]):
        _table_run(tmp_path / f"new-{r}.json", vanilla, new)
        _table_run(tmp_path / f"base-{r}.json", vanilla, old)
    assert speedups(tmp_path / "new-0.json") == {("mtbench", 1.0, 4, "eagle2-auto"): 0.98}
    md = summarize(tmp_path, 2, {"new": "b", "base": "a"}, ["table"], ["--base", "a"])
    assert "| dataset | T | batch | system | a | b | ratio of medians | τ, base | τ, new |" in md
    # medians over rounds: base (0.87, 0.90) -> 0.885, new (0.98, 0.96) -> 0.97; no
    # spec-decode counters in these runs, so no τ
    assert (
        "| mtbench | 1 | 4 | eagle2-auto | 0.89 [0.87-0.90] | 0.97 [0.96-0.98] | 1.10 | - | - |"
        in md
    )


def test_tau_of_each_revision_over_rounds(tmp_path):
    for r, (new, old) in enumerate([(60, 40), (80, 50)]):
        _table_run(tmp_path / f"new-{r}.json", 100.0, 120.0, accepted=new)
        _table_run(tmp_path / f"base-{r}.json", 100.0, 110.0, accepted=old)
    md = summarize(tmp_path, 2, {"new": "b", "base": "a"}, ["table"], ["--base", "a"])
    # τ = 1 + accepted / drafts: base 1.40, 1.50; new 1.60, 1.80
    assert (
        "| 1.10 [1.10-1.10] | 1.20 [1.20-1.20] | 1.09 | 1.45 [1.40-1.50] | 1.70 [1.60-1.80] |" in md
    )


def test_base_only_arguments_name_this_checkouts_files():
    # the base runs in a worktree of committed files: a path of this checkout is made
    # absolute, flags and values that are not paths are kept
    root = Path(__file__).resolve().parents[2]
    assert _absolute("benchmarks/bench.py") == str(root / "benchmarks/bench.py")
    assert _absolute("--auto-config") == "--auto-config"
    assert _absolute("4") == "4"


def test_curve_runs_are_keyed_by_requests_in_flight(tmp_path):
    _curve_run(tmp_path / "new-0.json", 170.0, 170.0)
    _curve_run(tmp_path / "base-0.json", 170.0, 153.0)
    md = summarize(tmp_path, 1, {"new": "b", "base": "a"}, ["curve"], ["--base", "a"])
    assert "| requests in flight | system | a | b | ratio of medians | τ, base | τ, new |" in md
    assert "| 16 | eagle2-auto | 0.90 [0.90-0.90] | 1.00 [1.00-1.00] | 1.11 | - | - |" in md
