"""The suffix draft source inside the runner (``suffix:`` configs).

:class:`SuffixDrafts` keeps the pure suffix index (``eagle_vllm/drafting/suffix.py``) in
step with vLLM's requests:

* a request is indexed (prompt, output so far) the first time it reaches drafting, and
  every step appends the tokens it accepted, whether or not that step drafts;
* a request leaving (``finished_req_ids``) moves its response into the global cache under
  its key ``(cache_salt, LoRA adapter)``; the salt comes with the request's first
  scheduling (``engine/scheduler.py``);
* ``propose`` gives each request its suffix candidates for the step.

The drafter merges them with the EAGLE tree (``tree/merge.py``, :func:`merge_drafts`);
with ``method: suffix`` they are the whole tree, drafted by :class:`SuffixProposer`, the
model-free drafter vLLM builds (``method: custom_class``) and calls like its own n-gram
proposer. After verification, :meth:`SuffixDrafts.observe` measures acceptance per
source and depth (``sizing.SourceCalibration``), which calibrates the next merges, and
counts which source the accepted tokens came from.

Sampled drafts (``draft_sample_method: sample``, chains at T > 0) get no suffix nodes:
their verifier's ``min(1, p/q)`` needs every draft to be a draw from q.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle_vllm import vllm_surface as vs
from eagle_vllm.config import SuffixConfig, eagle_config_of
from eagle_vllm.drafting.suffix import (
    GlobalSuffixCache,
    RequestSuffixes,
    SuffixCandidates,
    cache_key,
)
from eagle_vllm.engine.step import DraftedTrees, StepBound
from eagle_vllm.sizing import SourceCalibration
from eagle_vllm.tree.layout import DraftTree
from eagle_vllm.tree.merge import BOTH, EAGLE, SOURCE_NAMES, SUFFIX, merge_trees

# Longest substring the index counts (ArcticInference's max_depth): a match of m tokens
# drafts at most INDEX_MAX_LEN - m deep.
INDEX_MAX_LEN = 32


class SuffixDrafts:
    """Per-request and global suffix indexes, kept in step with the runner's requests."""

    def __init__(self, cfg: SuffixConfig, tokenizer: str | None = None) -> None:
        self.cfg = cfg
        self.cache = GlobalSuffixCache(
            cfg.cache_requests, max_len=max(INDEX_MAX_LEN, cfg.max_depth + 1)
        )
        if cfg.seed_corpus:
            self.seed_tokens = self.cache.seed(
                read_seed_corpus(cfg.seed_corpus, tokenizer), cfg.seed_tokens
            )
        else:
            self.seed_tokens = 0
        self.requests = RequestSuffixes(self.cache)
        self.calibration = SourceCalibration(max_depth=max(8, cfg.max_depth))
        self._salts: dict[str, str | None] = {}
        self._stops: dict[str, tuple[set[int], int | None, int]] = {}
        # totals since start (RPC eagle_vllm_suffix): accepted drafts per source, host cost
        self.accepted = {EAGLE: 0, SUFFIX: 0, BOTH: 0}
        self.drafted = {EAGLE: 0, SUFFIX: 0, BOTH: 0}
        self.host_seconds = 0.0
        self.host_steps = 0
        # suffix nodes the head had not proposed that its draft passes expanded
        self.expanded = 0
        # req_id -> every step's suffix candidate tokens (inspection; None: off)
        self.record: dict[str, list[list[int]]] | None = None

    # -- requests arriving and leaving ---------------------------------------------
    def note_scheduled(self, scheduler_output) -> None:
        """Keep new requests' salts; finished requests' responses go to the global cache."""
        for data in scheduler_output.scheduled_new_reqs:
            self._salts[data.req_id] = vs.cache_salt_of(data)
        for req_id in scheduler_output.finished_req_ids:
            if req_id in self.requests:
                self.requests.finish(req_id, self._response_len(req_id))
            self._salts.pop(req_id, None)
            self._stops.pop(req_id, None)

    def _response_len(self, req_id: str) -> int | None:
        """The output the user received: up to max_tokens, through its first stop token."""
        stops, max_tokens, min_tokens = self._stops.get(req_id, (set(), None, 0))
        if not stops and max_tokens is None:
            return None
        response = self.requests.response(req_id)
        end = len(response) if max_tokens is None else min(len(response), max_tokens)
        for i in range(max(0, min_tokens - 1), end):
            if response[i] in stops:
                return i + 1
        return end

    def sync(self, req_ids: Sequence[str], requests: dict, new_tokens: Sequence[Sequence[int]],
             output_has_new: bool) -> None:  # fmt: skip
        """Append each request's tokens of this step (``new_tokens[b]``) to its index,
        indexing its prompt and earlier output the first time. ``output_has_new``: vLLM's
        output ids already hold this step's tokens (drafting after its bookkeeping)."""
        start = time.perf_counter()
        for req_id, new in zip(req_ids, new_tokens):
            if req_id in self.requests:
                if new:
                    self.requests.extend(req_id, new)
                continue
            state = requests.get(req_id)
            if state is None:
                continue
            prompt, output, lora_name = vs.request_text(state)
            text = [*prompt, *output] if output_has_new else [*prompt, *output, *new]
            if not text:
                continue
            key = cache_key(self._salts.get(req_id), lora_name)
            self._stops[req_id] = vs.stop_rule(state)
            self.requests.add_request(req_id, prompt, key)
            self.requests.extend(req_id, text[len(prompt) :])
        self.host_seconds += time.perf_counter() - start

    def propose(self, req_ids: Sequence[str], skip: Sequence[bool] | None = None
                ) -> list[SuffixCandidates | None]:  # fmt: skip
        """Each request's candidates (None where ``skip`` or not indexed)."""
        start = time.perf_counter()
        cfg = self.cfg
        out: list[SuffixCandidates | None] = []
        for b, req_id in enumerate(req_ids):
            if (skip is not None and skip[b]) or req_id not in self.requests:
                out.append(None)
                continue
            cands = self.requests.propose(
                req_id, max_nodes=cfg.max_nodes + 1, max_depth=cfg.max_depth,
                min_prob=cfg.min_prob, spec_factor=cfg.spec_factor,
            )  # fmt: skip
            out.append(cands)
            if self.record is not None:
                self.record.setdefault(req_id, []).append(cands.tokens[1:])
        self.host_seconds += time.perf_counter() - start
        self.host_steps += 1
        return out

    # -- what verification accepted -------------------------------------------------
    def observe(self, verified: DraftedTrees, req_ids: Sequence[str],
                accepted_nodes: torch.Tensor, not_as_drafted: set[str]) -> None:  # fmt: skip
        """Calibration and per-source counts from one verified step."""
        if verified is None or verified.sources is None or accepted_nodes is None:
            return
        row_of = verified.row_of()
        rows, src = [], []
        for b, req_id in enumerate(req_ids[: accepted_nodes.shape[0]]):
            i = row_of.get(req_id)
            if i is not None and req_id not in not_as_drafted:
                rows.append(b)
                src.append(i)
        if not rows:
            return
        sources = verified.sources[src]
        width = sources.shape[1]
        accepted = torch.zeros(len(rows), width + 1, dtype=torch.bool)
        path = accepted_nodes[rows].to("cpu", torch.int64)
        hit = path >= 0
        index = torch.arange(len(rows))[:, None].expand_as(path)
        accepted[index[hit], path[hit].clamp(max=width)] = True
        accepted = accepted[:, :width]
        valid = verified.tree.valid_mask()[src].cpu()
        self.calibration.observe(
            sources, verified.tree.depths[src].cpu(), verified.raw_values[src], accepted, valid
        )
        for s in (EAGLE, SUFFIX, BOTH):
            self.accepted[s] += int((accepted & (sources == s)).sum())
            self.drafted[s] += int((valid & (sources == s)).sum())

    def stats(self) -> dict:
        """Totals since start: accepted and verified drafts per source, the index's host
        time per drafting step, the cache's size."""
        accepted = {SOURCE_NAMES[s]: n for s, n in self.accepted.items()}
        total = sum(accepted.values())
        return {
            "accepted": accepted,
            "verified": {SOURCE_NAMES[s]: n for s, n in self.drafted.items()},
            "accepted_share": {k: (v / total if total else 0.0) for k, v in accepted.items()},
            "host_seconds": self.host_seconds,
            "host_steps": self.host_steps,
            "host_ms_per_step": 1e3 * self.host_seconds / max(1, self.host_steps),
            "expanded": self.expanded,
            "cached_responses": len(self.cache),
            "cached_tokens": self.cache.num_tokens,
            "seed_tokens": self.seed_tokens,
            "calibration": self.calibration.factors()[1:].tolist(),
        }


def merge_drafts(step, eagle: DraftTree | None, suffix: list[SuffixCandidates | None],
                 nodes: int, calibration: torch.Tensor | None) -> list[list[int]]:  # fmt: skip
    """Merge (``tree/merge.py``) and record the trees on the step; returns each request's
    draft tokens (the merged tree's nodes after the root, in rank order)."""
    merged = merge_trees(eagle, suffix, [nodes] * len(suffix), calibration, width=nodes)
    tree = merged.tree
    step.drafted = DraftedTrees(
        req_ids=step.req_ids[: len(suffix)], tree=tree, sources=merged.sources,
        raw_values=merged.raw_values, pass_depths=_pass_depths(tree, merged.sources),
    )  # fmt: skip
    counts = tree.num_nodes.tolist()
    return [row[1:n] for row, n in zip(tree.tokens.tolist(), counts)]


def _pass_depths(tree: DraftTree, sources: torch.Tensor) -> torch.Tensor:
    """Per node, the draft passes its path needs: the depth of its deepest node that only
    the EAGLE head proposed (suffix nodes cost no pass). The sizer's acceptance
    statistics cut trees by passes (``sizing/acceptance.py``)."""
    parents = tree.parents.tolist()
    depths = tree.depths.tolist()
    src = sources.tolist()
    out = []
    for p_row, d_row, s_row, n in zip(parents, depths, src, tree.num_nodes.tolist()):
        row = [0] * len(p_row)
        for i in range(1, n):
            own = d_row[i] if s_row[i] == EAGLE else 0
            row[i] = max(row[p_row[i]], own)
        out.append(row)
    return torch.tensor(out, dtype=torch.int64)


class SuffixProposer(StepBound):
    """The drafter of ``method: suffix``: vLLM builds it (``method: custom_class``) and
    calls ``propose`` after its bookkeeping, as for its n-gram proposer; the runner binds
    the step, whose ``suffix_candidates`` it turns into the step's tree."""

    def __init__(self, vllm_config) -> None:
        cfg = eagle_config_of(vllm_config)
        if cfg is None or cfg.suffix is None:
            raise ValueError(
                "eagle_vllm: SuffixProposer needs an eagle_vllm config with method 'suffix'. "
                "Fix: pass speculative_config={'method': 'suffix', ...} through eagle_vllm."
            )
        self.nodes = cfg.total_tokens
        self.suffix = SuffixDrafts(cfg.suffix, vllm_config.model_config.tokenizer)

    def load_model(self, target_model) -> None:
        """No model to load (vLLM's CPU runner calls this on every drafter)."""

    def propose(self, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None,
                slot_mappings=None) -> list[list[int]]:  # fmt: skip
        step = self._step
        assert step is not None, "propose runs inside bound_to(step)"
        cands = step.suffix_candidates or []
        if not any(c is not None and c.num_nodes > 1 for c in cands):
            step.drafted = None
            return [[] for _ in cands]
        # a request not indexed yet (its prompt still being computed) drafts nothing
        none = SuffixCandidates([-1], [-1], [0.0], [0])
        return merge_drafts(step, None, [c or none for c in cands], self.nodes, None)


def read_seed_corpus(path: str, tokenizer: str | None) -> list[list[int]]:
    """A seed corpus: JSONL, one text per line as ``{"token_ids": [...]}`` or a text under
    ``"text"``, ``"answer"`` or ``"response"`` (tokenized with the target's tokenizer)."""
    texts: list[str] = []
    seqs: list[list[int]] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"suffix.seed_corpus '{path}' line {n}: not JSON ({exc})") from None
        if isinstance(item, dict) and isinstance(item.get("token_ids"), list):
            seqs.append([int(t) for t in item["token_ids"]])
            continue
        text = next((item[k] for k in ("text", "answer", "response")
                     if isinstance(item, dict) and isinstance(item.get(k), str)), None)  # fmt: skip
        if text is None:
            raise ValueError(
                f"suffix.seed_corpus '{path}' line {n}: no 'token_ids' list or "
                "'text'/'answer'/'response' string. Fix: write one of them per line."
            )
        texts.append(text)
    if texts:
        if tokenizer is None:
            raise ValueError(f"suffix.seed_corpus '{path}' holds texts but no tokenizer is known")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        seqs += [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return seqs
