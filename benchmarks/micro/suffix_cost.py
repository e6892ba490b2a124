"""What the suffix index costs per request per step on the host, outside any engine.

    .venv/bin/python benchmarks/micro/suffix_cost.py
    .venv/bin/python benchmarks/micro/suffix_cost.py --batches 1,16,64 --max-nodes 32
    .venv/bin/python benchmarks/micro/suffix_cost.py --synthetic   # no data/tokenizer needed

Text: SmolLM2's own answers (``data/regen-sharegpt-0-6000``, tokenized with
``models/SmolLM2-135M-Instruct/tokenizer.json``), or with ``--synthetic`` (or when either
is missing) a Zipf-distributed token stream with copied phrases. A global cache of
``--cache-responses`` responses of ``--response-tokens`` tokens (all under one cache key,
the largest index a request can draft from) is built first. Then ``B`` requests, each with
a ``--prompt-tokens`` prompt (other answers, concatenated) and a ``--gen-tokens`` answer
as the text the target "writes", run in lockstep: every step, each request is extended
with the tokens the previous step accepted and asked for candidates; the accepted tokens
are the longest path of the candidate tree that matches the answer, plus one (greedy
verification against the real text, so the step count and the tree sizes are those of a
real run). Timed per request per step: ``extend`` + ``propose`` (the simulated
verification is not timed). Also printed: the one-off costs (index a prompt, finish a
request = cache its response and evict the oldest), the memory of the global cache, and
the acceptance length tau the trees would get on this text.
At 64 requests a CPU step of this project's SmolLM2 takes 100+ ms, so 100 us per request
is ~6% of it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagle_vllm.drafting import GlobalSuffixCache, RequestSuffixes  # noqa: E402

DATA = ROOT / "data/regen-sharegpt-0-6000/conversations.partial.jsonl"
TOKENIZER = ROOT / "models/SmolLM2-135M-Instruct/tokenizer.json"


def real_answers(limit: int) -> list[list[int]] | None:
    """Token ids of SmolLM2's own answers, or None if the data or tokenizer is missing."""
    if not DATA.exists() or not TOKENIZER.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    tok = Tokenizer.from_file(str(TOKENIZER))
    texts = []
    with open(DATA) as f:
        for line in f:
            texts.append(json.loads(line)["answer"])
            if len(texts) >= limit:
                break
    return [e.ids for e in tok.encode_batch(texts)]


def synthetic_answers(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Zipf tokens over a 49k vocabulary, with phrases copied from a shared pool (answers
    reuse phrasing) and from earlier in the same answer (answers repeat themselves)."""
    rng = random.Random(seed)
    vocab = 49152
    weights = [1.0 / (r + 1) for r in range(vocab)]
    pool = [rng.choices(range(vocab), weights, k=rng.randint(4, 20)) for _ in range(2000)]
    out = []
    for _ in range(n):
        ans: list[int] = []
        while len(ans) < length:
            r = rng.random()
            if r < 0.3:
                ans += rng.choice(pool)
            elif r < 0.45 and len(ans) > 20:
                a = rng.randrange(len(ans) - 10)
                ans += ans[a : a + rng.randint(4, 16)]
            else:
                ans += rng.choices(range(vocab), weights, k=rng.randint(1, 6))
        out.append(ans[:length])
    return out


def accepted_prefix(cands, truth: list[int]) -> int:
    """Drafts accepted by greedy verification: the longest tree path that is a prefix of
    ``truth`` (the tokens the target writes next)."""
    kids: dict[tuple[int, int], int] = {}
    for i in range(1, cands.num_nodes):
        kids[(cands.parents[i], cands.tokens[i])] = i
    node, n = 0, 0
    while n < len(truth):
        node = kids.get((node, truth[n]))
        if node is None:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--cache-responses", type=int, default=1000)
    ap.add_argument("--response-tokens", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=32, help="index depth (match + draft)")
    ap.add_argument("--max-nodes", type=int, default=16, help="tree budget, root included")
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--min-prob", type=float, default=0.1)
    ap.add_argument("--synthetic", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    top = max(batches)

    # Text: cached responses, then per request an answer (>= gen tokens) and prompt text.
    answers = None if args.synthetic else real_answers(6000)
    source = "SmolLM2 answers (data/regen-sharegpt-0-6000)"
    if answers is None:
        source = "synthetic Zipf text with copied phrases"
        answers = synthetic_answers(args.cache_responses + 12 * top, 320)
    long_enough = [a for a in answers if len(a) >= args.response_tokens]
    cached = long_enough[: args.cache_responses]
    rest = [a for a in answers if not any(a is c for c in cached)]
    gens = [a[: args.gen_tokens] for a in rest if len(a) >= args.gen_tokens][:top]
    filler = [a for a in rest if all(a is not g for g in gens)]
    if len(cached) < args.cache_responses or len(gens) < top:
        sys.exit(f"not enough text: {len(cached)} cached, {len(gens)} answers")
    stream = [t for a in filler for t in a]
    prompts = []
    for b in range(top):
        start = (b * args.prompt_tokens * 3) % max(1, len(stream) - args.prompt_tokens)
        prompts.append(stream[start : start + args.prompt_tokens])
    print(f"text: {source}")
    print(
        f"global cache: {len(cached)} responses x {args.response_tokens} tokens; requests: "
        f"{args.prompt_tokens}-token prompt + {args.gen_tokens} generated; max_len "
        f"{args.max_len}, max_nodes {args.max_nodes}, max_depth {args.max_depth}, "
        f"min_prob {args.min_prob}"
    )

    tracemalloc.start()
    cache = GlobalSuffixCache(args.cache_responses, max_len=args.max_len)
    t0 = time.perf_counter()
    for r in cached:
        cache.add((None, None), r[: args.response_tokens])
    build_s = time.perf_counter() - t0
    cache_mb = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    (gindex,) = cache.indexes_for((None, None))
    print(
        f"global cache built in {build_s:.2f} s ({build_s * 1e6 / len(cached):.0f} us per "
        f"response); {gindex.num_nodes} nodes for {gindex.num_tokens} tokens, "
        f"{cache_mb:.0f} MB (tracemalloc)"
    )

    kw = dict(max_nodes=args.max_nodes, max_depth=args.max_depth, min_prob=args.min_prob)
    print()
    header = (
        f"{'requests':>8} {'global':>6} {'steps':>5} {'tau':>5} {'nodes':>5} "
        f"{'us/req/step':>11} {'p50':>6} {'p99':>6} {'extend':>7} {'propose':>7} "
        f"{'prompt ms':>9} {'finish ms':>9}"
    )
    print(header)
    for use_global in (True, False):
        for batch in batches:
            reqs = RequestSuffixes(cache if use_global else None, max_len=args.max_len)
            t0 = time.perf_counter()
            for b in range(batch):
                reqs.add_request(b, prompts[b], (None, None))
            prompt_ms = (time.perf_counter() - t0) * 1e3 / batch
            pos = [0] * batch
            pending: list[list[int]] = [[] for _ in range(batch)]
            per_step, ext_s, prop_s, nodes, drafted_steps = [], 0.0, 0.0, 0, 0
            accepted_total = steps_total = 0
            while any(p < args.gen_tokens for p in pos):
                live = [b for b in range(batch) if pos[b] < args.gen_tokens]
                cands = {}
                t_step = time.perf_counter()
                for b in live:
                    t1 = time.perf_counter()
                    reqs.extend(b, pending[b])
                    t2 = time.perf_counter()
                    cands[b] = reqs.propose(b, **kw)
                    t3 = time.perf_counter()
                    ext_s += t2 - t1
                    prop_s += t3 - t2
                per_step.append((time.perf_counter() - t_step) / len(live))
                for b in live:  # verification against the real answer (not timed)
                    truth = gens[b][pos[b] :]
                    n = min(accepted_prefix(cands[b], truth) + 1, len(truth))
                    pending[b] = truth[:n]
                    pos[b] += n
                    accepted_total += n
                    steps_total += 1
                    nodes += cands[b].num_nodes
                    drafted_steps += 1
            t0 = time.perf_counter()
            for b in range(batch):
                reqs.extend(b, pending[b])
                if use_global:
                    reqs.finish(b)
                else:
                    reqs.remove(b)
            finish_ms = (time.perf_counter() - t0) * 1e3 / batch
            us = [x * 1e6 for x in per_step]
            q = statistics.quantiles(us, n=100) if len(us) >= 2 else us * 99
            print(
                f"{batch:>8} {'yes' if use_global else 'no':>6} {len(per_step):>5} "
                f"{accepted_total / steps_total:>5.2f} {nodes / drafted_steps:>5.1f} "
                f"{statistics.fmean(us):>11.1f} {q[49]:>6.1f} {q[98]:>6.1f} "
                f"{ext_s * 1e6 / steps_total:>7.1f} {prop_s * 1e6 / steps_total:>7.1f} "
                f"{prompt_ms:>9.2f} {finish_ms:>9.2f}"
            )
    print()
    print(
        "us/req/step: extend + propose per request per step (mean over steps; p50/p99 of "
        "the per-step means); extend, propose: mean us per request-step; tau: tokens per "
        "step (accepted drafts + 1); nodes: mean tree size with the root; prompt ms: "
        "indexing one prompt; finish ms: caching one response and evicting the oldest "
        "(global) or dropping the request."
    )


if __name__ == "__main__":
    main()
