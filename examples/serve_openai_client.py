"""Talk to `vllm serve ... --speculative-config configs/eagle2.yaml` with the OpenAI client.

Start the server first (CPU; on a GPU drop --dtype/--enforce-eager as you like):

    .venv/bin/eagle-vllm prepare smollm2                 # ./models/SmolLM2-135M-Instruct
    VLLM_CPU_KVCACHE_SPACE=4 .venv/bin/vllm serve models/SmolLM2-135M-Instruct \
        --speculative-config configs/eagle2.yaml --dtype float32 --enforce-eager \
        --port 8000
    (configs/eagle2-auto.yaml sizes the tree to the load; float32 on CPUs without
    AVX-512 BF16, see BENCHMARKS.md)

then:

    .venv/bin/python examples/serve_openai_client.py [--base-url http://127.0.0.1:8000]

It sends a streamed chat completion and a plain completion, then prints the
server's speculative-decoding counters (mean acceptance length and acceptance
per draft position) from /metrics.
"""

from __future__ import annotations

import argparse
import re
import urllib.request

from openai import OpenAI


def spec_decode_summary(base_url: str) -> str:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()

    def total(name: str) -> float:
        return sum(
            float(v) for v in re.findall(rf"^vllm:{name}(?:_total)?{{[^}}]*}} (\S+)", text, re.M)
        )

    drafts, accepted = total("spec_decode_num_drafts"), total("spec_decode_num_accepted_tokens")
    per_pos = re.findall(
        r'^vllm:spec_decode_num_accepted_tokens_per_pos(?:_total)?{[^}]*position="(\d+)"[^}]*} (\S+)',
        text,
        re.M,
    )
    lines = [f"drafts={drafts:.0f} accepted={accepted:.0f}"]
    if drafts:
        lines.append(f"mean acceptance length = {1 + accepted / drafts:.2f}")
        for pos, value in sorted(per_pos, key=lambda x: int(x[0])):
            lines.append(f"  depth {int(pos) + 1}: {float(value) / drafts:.2f} accepted per step")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Explain speculative decoding in two sentences."}],
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    completion = client.completions.create(
        model=model, prompt="def fibonacci(n):", max_tokens=64, temperature=0
    )
    print(completion.choices[0].text)
    print(spec_decode_summary(args.base_url))


if __name__ == "__main__":
    main()
