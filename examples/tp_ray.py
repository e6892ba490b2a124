"""Tensor parallelism with Ray actors as vLLM's workers, with eagle-vllm drafting.

python examples/tp_ray.py TARGET_DIR CONFIG_OR_DRAFT_DIR [TP_SIZE]

CONFIG_OR_DRAFT_DIR is a speculative config file (e.g. configs/eagle2.yaml) or a
draft folder (then method eagle2 with its defaults). TP_SIZE defaults to 2.

Ray: ray.init() joins this machine's Ray cluster (RAY_ADDRESS, or one started with
`ray start`) or starts a local instance; RAY_ADDRESS hands it to vLLM's engine-core
process, which would otherwise start a Ray instance of its own (and leave some of its
processes behind). Each rank reserves one GPU, or on CPU one CPU (eagle_vllm.ray_cpu),
so the cluster needs TP_SIZE of them. On CPU also set VLLM_CPU_KVCACHE_SPACE (GiB). The same launch from the command line, on a
machine of a running Ray cluster (`ray start --head`):

    vllm serve TARGET --tensor-parallel-size 2 --distributed-executor-backend ray \\
        --speculative-config configs/eagle2.yaml

Multi-node GPU deployment: docs/multi-node.md.
"""

import os
import sys

import ray
from vllm import SamplingParams

from eagle_vllm import LLM


def main() -> None:
    target, spec = sys.argv[1], sys.argv[2]
    tp_size = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    if not spec.endswith((".yaml", ".yml", ".json")):
        spec = {"method": "eagle2", "model": spec}
    context = ray.init()
    os.environ["RAY_ADDRESS"] = context.address_info["gcs_address"]  # for vLLM's engine core
    try:
        llm = LLM(
            target,
            speculative_config=spec,
            tensor_parallel_size=tp_size,
            distributed_executor_backend="ray",
            enforce_eager=True,
            disable_log_stats=False,
        )
        outputs = llm.generate(
            ["Write a haiku about speculative decoding."],
            SamplingParams(temperature=0, max_tokens=64),
        )
        print(outputs[0].outputs[0].text)
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode"):
                print(metric.name, getattr(metric, "value", getattr(metric, "values", None)))
        llm.llm_engine.engine_core.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
