#!/usr/bin/env bash
# Train an EAGLE-1 head for SmolLM2-135M-Instruct on CPU, then serve it with EAGLE-2 trees.
# A short run (about 20 minutes on 2 cores); `make reference-head` is the full recipe of the
# committed head. Rerunning this script resumes every stage (features, optimiser state).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=models/SmolLM2-135M-Instruct
HEAD=heads/my-smollm2-head

test -d "$TARGET" || .venv/bin/eagle-vllm prepare smollm2
.venv/bin/eagle-vllm train --target "$TARGET" --out "$HEAD" \
    --num-conversations 200 --max-steps 150 --lr 5e-4 --ce-vocab 16384

cat > "$HEAD.eagle2.yaml" <<YAML
method: eagle2
model: $(basename "$HEAD")
num_speculative_tokens: 3
topk: 4
total_tokens: 8
YAML
.venv/bin/eagle-vllm check-config "$HEAD.eagle2.yaml" --target "$TARGET"
VLLM_CPU_KVCACHE_SPACE=4 exec .venv/bin/vllm serve "$TARGET" \
    --speculative-config "$HEAD.eagle2.yaml" --dtype bfloat16 --enforce-eager --port 8000
