"""What the suffix index costs per request per step on the host, outside any engine.

    .venv/bin/python benchmarks/micro/suffix_cost.py
    .venv/bin/python benchmarks/micro/suffix_cost.py --batches 1,16,64 --max-nodes 32
    .venv/bin/python benchmarks/micro/suffix_cost.py --synthetic   # no data/tokenizer needed

Text: SmolLM2's own answers (``data/regen-sharegpt-0-6000``, tokenized with
``models/SmolLM2-135M-Instruct/tokenizer.json``), or with ``--synthetic`` (or when either
is missing) a Zipf-distributed token stream with copied phrases. A global cache of
``--cache-responses`` responses of ``--response-tokens`` tokens (all under one cache key,
the largest index a request can draft from) is built first. Then continuous batching:
``B`` requests in flight, ``--requests`` in all (default 2B, at least 16), each with a
``--prompt-tokens`` prompt (other answers, concatenated) and a ``--gen-tokens`` answer as
the text the target "writes". Every step, each request is extended with the tokens the
previous step accepted and asked for candidates; the accepted tokens are the longest path
of the candidate tree that matches the answer, plus one (greedy verification against the
real text, so step counts and tree sizes are those of a real run). A request that is done
is finished at once (its response enters the global cache, the oldest leaves) and the next
one starts in its slot, so the global index changes between steps as when serving.
Timed in CPU time (the machine may be shared): per request per step, ``extend`` +
``propose`` (the simulated verification is not timed); the one-off costs (indexing a
prompt, finishing a request); the memory and build time of the global cache; and the
acceptance length tau the trees would get on this text.
For scale (BENCHMARKS.md): a SmolLM2 step on this project's CPUs takes ~48 ms at batch 1
and ~300 ms or more at 64 requests, so 200 us per request is 0.4% and ~4% of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagle_vllm.drafting import GlobalSuffixCache, RequestSuffixes  # noqa: E402

DATA = ROOT / "data/regen-sharegpt-0-6000/conversations.partial.jsonl"
TOKENIZER = ROOT / "models/SmolLM2-135M-Instruct/tokenizer.json"


def rss_mb() -> float:
    """Resident memory of this process (Linux), MB; NaN elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


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


def simulate(reqs: RequestSuffixes, batch: int, total: int, prompts, gens, kw) -> dict:
    """Continuous batching: ``batch`` requests in flight, ``total`` in all; a finished
    request is finished (its response cached) and the next one starts in its slot, so the
    global cache changes between steps as it does when serving."""
    clock = time.thread_time  # CPU time: the machine may be shared; wall is printed too
    nxt = 0
    slots: list[dict | None] = [None] * batch
    prompt_s = finish_s = 0.0
    per_step_cpu, per_step_wall = [], []
    ext = prop = 0.0
    accepted = steps = nodes = 0
    while True:
        for i in range(batch):
            if slots[i] is None and nxt < total:
                t0 = clock()
                reqs.add_request(nxt, prompts[nxt], (None, None))
                prompt_s += clock() - t0
                slots[i] = {"id": nxt, "pos": 0, "pending": [], "gen": gens[nxt]}
                nxt += 1
        live = [r for r in slots if r is not None]
        if not live:
            break
        cands = {}
        c0, w0 = clock(), time.perf_counter()
        for r in live:
            t1 = clock()
            reqs.extend(r["id"], r["pending"])
            t2 = clock()
            cands[r["id"]] = reqs.propose(r["id"], **kw)
            t3 = clock()
            ext += t2 - t1
            prop += t3 - t2
        per_step_cpu.append((clock() - c0) / len(live))
        per_step_wall.append((time.perf_counter() - w0) / len(live))
        for i, r in enumerate(slots):  # verification against the real answer (not timed)
            if r is None:
                continue
            truth = r["gen"][r["pos"] :]
            c = cands[r["id"]]
            n = min(accepted_prefix(c, truth) + 1, len(truth))
            r["pending"] = truth[:n]
            r["pos"] += n
            accepted += n
            steps += 1
            nodes += c.num_nodes
            if r["pos"] >= len(r["gen"]):
                t0 = clock()
                reqs.extend(r["id"], r["pending"])
                reqs.finish(r["id"])  # into the global cache (if any), evicting the oldest
                finish_s += clock() - t0
                slots[i] = None
    return {
        "engine_steps": len(per_step_cpu),
        "tau": accepted / steps,
        "nodes": nodes / steps,
        "mean": (ext + prop) * 1e6 / steps,
        "cpu": [x * 1e6 for x in per_step_cpu],
        "wall": [x * 1e6 for x in per_step_wall],
        "extend": ext * 1e6 / steps,
        "propose": prop * 1e6 / steps,
        "prompt_ms": prompt_s * 1e3 / total,
        "finish_ms": finish_s * 1e3 / total,
        "amortized": (prompt_s + finish_s) * 1e6 / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,16,64", help="requests in flight")
    ap.add_argument(
        "--requests", type=int, default=0, help="requests per run (default 2x batch, >= 16)"
    )
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
    totals = {b: args.requests or max(2 * b, 16) for b in batches}
    need = max(totals.values())

    # Text: cached responses; per request an answer (>= gen tokens) and a prompt cut from
    # the other answers, concatenated.
    answers = None if args.synthetic else real_answers(6000)
    source = "SmolLM2's own answers (data/regen-sharegpt-0-6000)"
    if answers is None:
        source = "synthetic Zipf text with copied phrases"
        n = args.cache_responses + need + need * args.prompt_tokens // 300 + 10
        answers = synthetic_answers(n, max(320, args.response_tokens, args.gen_tokens))
    long_enough = [a for a in answers if len(a) >= args.response_tokens]
    cached = long_enough[: args.cache_responses]
    taken = {id(a) for a in cached}
    rest = [a for a in answers if id(a) not in taken]
    gens = [a[: args.gen_tokens] for a in rest if len(a) >= args.gen_tokens][:need]
    used = set(map(id, [a for a in rest if len(a) >= args.gen_tokens][:need]))
    stream = [t for a in rest if id(a) not in used for t in a]
    p = args.prompt_tokens
    prompts = [stream[i * p : (i + 1) * p] for i in range(need)]
    if len(cached) < args.cache_responses or len(gens) < need or len(prompts[-1]) < p:
        sys.exit(f"not enough text for {need} requests: {len(cached)} cached, {len(gens)} answers")
    print(f"text: {source}")
    print(
        f"global cache: {len(cached)} responses x {args.response_tokens} tokens; requests: "
        f"{p}-token prompt + {args.gen_tokens} generated; max_len {args.max_len}, max_nodes "
        f"{args.max_nodes}, max_depth {args.max_depth}, min_prob {args.min_prob}"
    )

    rss0 = rss_mb()
    cache = GlobalSuffixCache(args.cache_responses, max_len=args.max_len)
    t0 = time.perf_counter()
    for r in cached:
        cache.add((None, None), r[: args.response_tokens])
    build_s = time.perf_counter() - t0
    cache_mb = rss_mb() - rss0
    (gindex,) = cache.indexes_for((None, None))
    print(
        f"global cache built in {build_s:.2f} s ({build_s * 1e6 / len(cached):.0f} us per "
        f"response); {gindex.num_nodes} nodes for {gindex.num_tokens} tokens, "
        f"{cache_mb:.0f} MB (resident memory growth)"
    )

    kw = dict(max_nodes=args.max_nodes, max_depth=args.max_depth, min_prob=args.min_prob)
    print()
    print(
        f"{'batch':>5} {'reqs':>4} {'global':>6} {'steps':>5} {'tau':>5} {'nodes':>5} "
        f"{'us/req/step':>11} {'extend':>6} {'propose':>7} {'p50':>6} {'p99':>6} {'wall':>6} "
        f"{'prompt ms':>9} {'finish ms':>9} {'+amort':>6}"
    )
    for use_global in (True, False):
        for batch in batches:
            reqs = RequestSuffixes(cache if use_global else None, max_len=args.max_len)
            r = simulate(reqs, batch, totals[batch], prompts, gens, kw)
            q = statistics.quantiles(r["cpu"], n=100)
            print(
                f"{batch:>5} {totals[batch]:>4} {'yes' if use_global else 'no':>6} "
                f"{r['engine_steps']:>5} {r['tau']:>5.2f} {r['nodes']:>5.1f} "
                f"{r['mean']:>11.1f} {r['extend']:>6.1f} {r['propose']:>7.1f} "
                f"{q[49]:>6.1f} {q[98]:>6.1f} {statistics.fmean(r['wall']):>6.1f} "
                f"{r['prompt_ms']:>9.2f} {r['finish_ms']:>9.2f} {r['amortized']:>6.1f}"
            )
    print()
    print(
        "us/req/step = extend + propose: CPU time per request per engine step, mean over "
        "all request-steps; p50/p99: of each engine step's mean over its requests; wall: "
        "the wall-clock mean of those (higher on a shared machine); tau: tokens per step "
        "(accepted drafts + 1, greedy against the real answer); nodes: mean tree size with "
        "the root; prompt ms: indexing one prompt (add_request); finish ms: caching one "
        "response and evicting the oldest (finish; without a global cache, dropping the "
        "request); +amort: those two spread over the request's steps, us per request-step."
    )


if __name__ == "__main__":
    main()
