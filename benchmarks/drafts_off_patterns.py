"""Does turning drafts off, and back on, change how often drafts are accepted?

    .venv/bin/python benchmarks/drafts_off_patterns.py --pattern auto on alt alt5 batchoff

On the tests' tiny fp32 models (``tests/tiny_models.py``: the context-dependent target
and the noisy oracle draft), eagle2 topk 3 with ``total_tokens: auto``, the workload of
``tests/integration/test_auto_sizing.py``: 9 prompts in a batch, then the first 3 alone.
Each pattern runs in its own in-process engine and fixes the sizer's choice per step:
``auto`` (the sizer decides), ``on`` (one pass of 4 nodes every step), ``alt`` (off and
on, alternating), ``alt5`` (5 steps off, 5 on), ``probe`` (31 off, 1 on), ``batchoff`` (off while more than one
request runs). Prints accepted first drafts over drafts, for the batch phase and in all.
If drafts-off steps left the draft KV wrong, acceptance after them would fall.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests/integration")]

PATTERNS = {
    "on": [(1, 4)],
    "alt": [(0, 1), (1, 4)],
    "alt5": [(0, 1)] * 5 + [(1, 4)] * 5,
    "probe": [(0, 1)] * 31 + [(1, 4)],  # long runs off, one drafting step between
}


def run(pattern: str, root: Path) -> str:
    from conftest import ENGINE_KW, spec_metrics
    from test_eagle_chain import PROMPTS, greedy
    from tiny_models import build_draft, build_target

    from eagle_vllm import LLM
    from eagle_vllm.sizing import TreeSizer

    oracle = build_target(root / "target_oracle", oracle=True)
    target = build_target(root / "target", oracle=True, context=0.002)
    draft = build_draft(root / "draft_noisy", oracle, kind="oracle", noise=0.002, attn_noise=0.03)
    if pattern != "auto":
        arms = itertools.cycle(PATTERNS.get(pattern, [(1, 4)]))

        def choose(self, batch_size, num_sampled=0):
            if pattern == "batchoff":
                arm = (0, 1) if batch_size > 1 else (1, 4)
            else:
                arm = next(arms)
            self.history.append((batch_size, *arm))
            return arm

        TreeSizer.choose = choose  # this process only: the engine runs in it
    spec = {"method": "eagle2", "model": str(draft), "num_speculative_tokens": 3,
            "total_tokens": "auto", "topk": 3}  # fmt: skip
    llm = LLM(str(target), speculative_config=spec, **ENGINE_KW)
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    batch = spec_metrics(llm)
    for prompt in PROMPTS[:3]:
        llm.generate([prompt], greedy(), use_tqdm=False)
    total = spec_metrics(llm)

    def share(m: dict) -> str:
        first = m["num_accepted_tokens_per_pos"][0] if m["num_drafts"] else 0
        return f"{first}/{m['num_drafts']}"

    return f"{pattern}: batch phase {share(batch)}, in all {share(total)} first drafts accepted"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pattern", nargs="+", default=["auto", "on", "alt", "alt5", "batchoff"],
                   choices=["auto", "batchoff", *PATTERNS])  # fmt: skip
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:  # one pattern per process: the patch and the engine die with it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        print(run(args.worker, Path(tempfile.mkdtemp())), flush=True)
        return 0
    import subprocess

    for pattern in args.pattern:
        out = subprocess.run([sys.executable, __file__, "--worker", pattern],
                             capture_output=True, text=True, check=True)  # fmt: skip
        print(out.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
