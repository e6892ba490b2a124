"""Quick tau check: 8 MT-bench first turns, batch 8, T=0, 96 tokens, bf16 SmolLM2.

    .venv/bin/python benchmarks/micro/tau_quick.py HEAD_DIR eagle num_speculative_tokens=3
    .venv/bin/python benchmarks/micro/tau_quick.py HEAD_DIR eagle2 num_speculative_tokens=4 topk=4 total_tokens=16
    .venv/bin/python benchmarks/micro/tau_quick.py HEAD_DIR eagle draft_sample_method=sample temperature=1 prompts=32

``temperature=``, ``prompts=`` and ``dtype=`` (default 0, 8 and bfloat16) set the run;
other key=value pairs go into the speculative config.

Prints tau = 1 + accepted/drafts and per-depth acceptance from vLLM's own counters.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("head", help="the draft head's folder")
    p.add_argument("method", help="the speculative method (eagle, eagle2)")
    p.add_argument("options", nargs="*", metavar="KEY=VALUE",
                   help="temperature=, prompts=, dtype=; the rest go into the config")  # fmt: skip
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.datasets import mtbench_prompts

    spec: dict = {"method": args.method, "model": args.head}
    for kv in args.options:
        k, v = kv.split("=")
        spec[k] = int(v) if v.isdigit() else v
    temperature = float(spec.pop("temperature", 0))
    num_prompts = int(spec.pop("prompts", 8))
    dtype = spec.pop("dtype", "bfloat16")
    llm = LLM("models/SmolLM2-135M-Instruct", speculative_config=spec, dtype=dtype,
              enforce_eager=True, max_model_len=2048, disable_log_stats=False)  # fmt: skip
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in mtbench_prompts()[:num_prompts]
    ]
    start = time.time()
    llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=96), use_tqdm=False)
    m = {
        x.name: (x.values if hasattr(x, "values") else x.value)
        for x in llm.get_metrics()
        if x.name.startswith("vllm:spec_decode")
    }
    drafts = m["vllm:spec_decode_num_drafts"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = [round(x / drafts, 2) for x in m["vllm:spec_decode_num_accepted_tokens_per_pos"]]
    print(spec, "T", temperature, "tau", round(1 + accepted / drafts, 3), "per_pos", per_pos,
          "time", round(time.time() - start, 1))  # fmt: skip


if __name__ == "__main__":
    main()
