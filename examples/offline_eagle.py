"""Offline generation with eagle-vllm (chain or tree), exactly like vllm.LLM.

python examples/offline_eagle.py TARGET_DIR DRAFT_DIR [eagle|eagle2]
"""

import sys

from vllm import SamplingParams

from eagle_vllm import LLM


def main() -> None:
    target, draft = sys.argv[1], sys.argv[2]
    method = sys.argv[3] if len(sys.argv) > 3 else "eagle"
    spec = {"method": method, "model": draft}
    llm = LLM(target, speculative_config=spec, enforce_eager=True, disable_log_stats=False)
    outputs = llm.generate(
        ["Write a haiku about speculative decoding."],
        SamplingParams(temperature=0, max_tokens=64),
    )
    print(outputs[0].outputs[0].text)
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            print(metric.name, getattr(metric, "value", getattr(metric, "values", None)))


if __name__ == "__main__":
    main()
