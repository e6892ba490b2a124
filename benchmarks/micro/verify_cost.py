"""What verification costs per step, against what vanilla vLLM's sampler costs.

Times ``ExactRejectionSampler.forward`` (the plugin's verifier: bonus token, logits
processing, the exact accept/reject walk) on chains of 1-4 nodes per request, at batch
1 and 4, greedy and sampled (T=1, with and without a per-request seed), next to vLLM
0.32's own ``Sampler`` on the one-row-per-request logits of a drafts-off step (what
vanilla pays). Only the sampling work: the target forward is not in these figures.

    .venv/bin/python benchmarks/micro/verify_cost.py [--vocab 49152] [--threads 1]
    .venv/bin/python benchmarks/micro/verify_cost.py --list-walk-max-nodes 0   # tensor walk only

    .venv/bin/python benchmarks/micro/verify_cost.py --vllm-draws   # vLLM's own random draws

The plugin's runner gives vLLM's sampler inverse-CDF draws (``InverseCdfDraws``), so a
step without drafts (the "no drafts" columns: vanilla vLLM's sampler, and the same with
the plugin's draws) and the verifier's walk both draw that way unless ``--vllm-draws``.
Prints a table of median milliseconds per call over ``--iters`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def sampling_metadata(batch: int, temperature: float, seeded: bool, vocab: int):
    from vllm.v1.sample.logits_processor.state import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    greedy = temperature == 0
    generators = {}
    if seeded and not greedy:
        generators = {b: torch.Generator().manual_seed(1000 + b) for b in range(batch)}
    return SamplingMetadata(
        temperature=None if greedy else torch.full((batch,), temperature),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=None,
        top_k=None,
        generators=generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def spec_metadata(batch: int, drafts: int, vocab: int):
    """A chain of ``drafts`` drafts per request, logits rows laid out as vLLM 0.32 does."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    nodes = drafts + 1
    starts = torch.arange(batch) * nodes
    target = (starts[:, None] + torch.arange(drafts)[None, :]).flatten()
    bonus = starts + drafts
    return SpecDecodeMetadata(
        draft_token_ids=torch.randint(vocab, (batch * drafts,), dtype=torch.int32),
        num_draft_tokens=[drafts] * batch,
        cu_num_draft_tokens=torch.arange(1, batch + 1, dtype=torch.int32) * drafts,
        cu_num_sampled_tokens=torch.arange(1, batch + 1, dtype=torch.int32) * nodes,
        target_logits_indices=target.to(torch.int32),
        bonus_logits_indices=bonus.to(torch.int32),
        logits_indices=torch.arange(batch * nodes, dtype=torch.int32),
    )


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-drafts", type=int, default=3)
    parser.add_argument("--list-walk-max-nodes", type=int, default=None,
                        help="greedy batches of at most this many nodes are walked over "
                        "Python lists (default: engine/sampler.py's; 0: always the tensor "
                        "walk, for an A/B)")  # fmt: skip
    parser.add_argument("--vllm-draws", action="store_true",
                        help="the verifier draws with vLLM's CPU Gumbel-max, as before the "
                        "plugin's inverse-CDF draws (an A/B)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.list_walk_max_nodes is not None:
        from eagle_vllm.engine import sampler as sampler_module

        sampler_module.LIST_WALK_MAX_NODES = args.list_walk_max_nodes

    from vllm.v1.sample.sampler import Sampler

    from eagle_vllm.engine.sampler import ExactRejectionSampler, use_inverse_cdf_draws
    from eagle_vllm.engine.step import StepRecord, StepState

    sampler = Sampler()  # vanilla's
    plugin_sampler = Sampler()
    if not args.vllm_draws:
        use_inverse_cdf_draws(plugin_sampler)
    verifier = ExactRejectionSampler(plugin_sampler)
    gen = torch.Generator().manual_seed(0)
    modes = [("T=0", 0.0, False), ("T=1", 1.0, False), ("T=1 seeded", 1.0, True)]
    print(f"vocab {args.vocab}, {args.threads} thread(s), median of {args.iters} calls (ms)")
    header = ["batch", "mode", "vLLM sampler, no drafts", "plugin's sampler, no drafts"]
    header += [f"verify {d} draft{'s' if d > 1 else ''}" for d in range(1, args.max_drafts + 1)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for name, temperature, seeded in modes:
            row = [str(batch), name]
            logits = torch.randn(batch, args.vocab, generator=gen) * 3
            meta = sampling_metadata(batch, temperature, seeded, args.vocab)

            def plain(logits=logits, meta=meta):
                return sampler(logits.clone(), meta)

            row.append(f"{median_ms(plain, args.iters):.2f}")

            def plugin_plain(logits=logits, meta=meta):
                return plugin_sampler(logits.clone(), meta)

            row.append(f"{median_ms(plugin_plain, args.iters):.2f}")
            for drafts in range(1, args.max_drafts + 1):
                spec = spec_metadata(batch, drafts, args.vocab)
                rows = torch.randn(batch * (drafts + 1), args.vocab, generator=gen) * 3
                positions = torch.arange(rows.shape[0], dtype=torch.int64) + 100
                step = StepState(StepRecord(started=0.0, decode_only=True), positions=positions)

                def run(spec=spec, rows=rows, meta=meta, step=step):
                    with verifier.bound_to(step):
                        return verifier(spec, None, rows.clone(), meta)

                row.append(f"{median_ms(run, args.iters):.2f}")
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
