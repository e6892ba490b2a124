"""The speculative config: parse a YAML/JSON file or a dict, validate it, map it to vLLM.

Everything here runs in the calling process (the `LLM` constructor or the
`vllm serve` front end) before any engine or worker process starts, so a bad
config fails fast with a message that names the key and the fix.

A config maps onto three stock vLLM engine arguments:

* ``speculative_config``: ``method="eagle"`` with the draft folder and
  ``num_speculative_tokens`` = draft slots per request per step, so that
  vLLM's scheduler reserves the slots and allocates KV for the draft layers;
* ``additional_config["eagle_vllm"]``: the full, validated plugin config,
  which reaches every worker;
* ``worker_cls``: the plugin's worker, which installs the plugin's runner
  (drafting, verification, and for trees the tree attention and KV compaction).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ADDITIONAL_CONFIG_KEY = "eagle_vllm"
WORKER_CLS = "eagle_vllm.engine.worker.EagleWorker"
SCHEDULER_CLS = "eagle_vllm.engine.scheduler.SaltCarryingScheduler"
# eagle: EAGLE chain; eagle2: EAGLE-2 dynamic tree; suffix: model-free suffix-tree drafts
# (no head). eagle and eagle2 take an optional ``suffix:`` section (hybrid trees).
METHODS = ("eagle", "eagle2", "suffix")
# vLLM's name for an EAGLE-3 chain, accepted as the eagle chain with an EAGLE-3 head.
METHOD_ALIASES_EAGLE3 = "eagle3"
# vLLM 0.32 runs a model-free drafter named by class path (``method: custom_class``);
# the plugin's runner drafts the suffix trees itself (engine/suffix_drafts.py).
SUFFIX_PROPOSER_CLASS = "eagle_vllm.engine.suffix_drafts.SuffixProposer"
# vLLM 0.32: vllm/v1/sample/rejection_sampler.py MAX_SPEC_LEN.
MAX_DRAFT_SLOTS = 128
# greedy: argmax / top-k drafts, verified by the target-only rule (exact for any tree).
# sample: chain drafts drawn from the draft distribution at the request's temperature,
# verified with min(1, p/q) (higher acceptance at T > 0; docs/lossless-verification.md).
DRAFT_SAMPLE_METHODS = ("greedy", "sample")

# Defaults are sized for small models on CPU, where verifying more than ~16
# tokens per step costs much more than one decode step (see BENCHMARKS.md).
DEFAULTS: dict[str, dict[str, Any]] = {
    "eagle": {"num_speculative_tokens": 3, "topk": 1, "draft_sample_method": "sample"},
    "eagle2": {
        "num_speculative_tokens": 4,
        "topk": 4,
        "total_tokens": 16,
        "draft_sample_method": "greedy",
    },
}


@dataclass(frozen=True)
class SuffixConfig:
    """The ``suffix:`` section: model-free candidates from suffix trees over each
    request's prompt and output and over past responses (``eagle_vllm/drafting/suffix.py``).

    ``max_depth`` bounds a suffix branch's depth (separate from ``num_speculative_tokens``:
    suffix branches cost no draft pass); ``max_nodes`` is the suffix tree's node budget per
    request and step, root excluded; ``cache_requests`` is how many finished responses the
    global index keeps (0: off); ``min_prob`` the least path probability of a candidate;
    ``spec_factor`` bounds the depth drafted from a match of m tokens to
    ``floor(spec_factor * m)`` (vLLM's ``suffix_decoding_max_spec_factor``);
    ``seed_corpus``/``seed_tokens``: an optional JSONL corpus (token ids or text) the
    global index starts from, bounded in tokens; ``expand``: EAGLE passes also expand
    suffix nodes outside the head's beam (``tree/merge.py``, ``SuffixGuide``; off by
    default, measured not to pay with the shipped head).
    """

    max_depth: int = 8
    max_nodes: int = 8
    cache_requests: int = 1000
    min_prob: float = 0.1
    spec_factor: float = 1.0
    seed_corpus: str | None = None
    seed_tokens: int = 1_000_000
    expand: bool = False


SUFFIX_KEYS: dict[str, tuple[type, ...]] = {
    "max_depth": (int,),
    "max_nodes": (int,),
    "cache_requests": (int,),
    "min_prob": (float, int),
    "spec_factor": (float, int),
    "seed_corpus": (str, os.PathLike),
    "seed_tokens": (int,),
    "expand": (bool,),
}


class EagleConfigError(ValueError):
    """A speculative config that cannot work; the message names the key and the fix."""


@dataclass(frozen=True)
class EagleSpecConfig:
    """A validated plugin config.

    ``num_speculative_tokens`` is the chain length for ``eagle`` and the tree
    depth (number of draft forward passes) for ``eagle2``. ``total_tokens``
    counts the tree's root (the last accepted token), as in SafeAILab's
    EAGLE-2, so a step verifies ``total_tokens`` tokens of which
    ``total_tokens - 1`` are drafts.
    """

    method: str
    model: str
    num_speculative_tokens: int
    topk: int = 1
    total_tokens: int = 0
    draft_sample_method: str = "greedy"
    # Children of the root among the tree's candidates (0: topk). Wider than topk widens
    # depth 1 only: the beam below it stays topk wide, so it costs no draft row.
    root_topk: int = 0
    # Draft over the N most frequent tokens (0: the full vocabulary). See draft_vocab key.
    draft_vocab: int = 0
    # With draft_vocab: also draft every token of the request's own context (prompt and
    # output so far); drafting/context_vocab.py. See the draft_vocab_context key.
    draft_vocab_context: bool = False
    # total_tokens: auto. Each step's tree (draft passes and nodes, possibly none) is
    # chosen by eagle_vllm/sizing/; num_speculative_tokens and total_tokens are the maxima.
    auto_size: bool = False
    # total_tokens: auto: costs and acceptance measured by `eagle-vllm calibrate` (the
    # file's content, so workers on other nodes need no copy of the file)
    sizing_profile: dict[str, Any] | None = field(default=None, compare=False)
    # the suffix source (hybrid trees for eagle/eagle2; the only source for suffix)
    suffix: SuffixConfig | None = None
    source: str | None = field(default=None, compare=False)
    # the head's type, read from its checkpoint (models/checkpoint.py): "eagle1" drafts
    # from the target's last layer, "eagle3" from several layers fused by its fc
    head_type: str = "eagle1"
    # the draft's GEMMs: "model" (the target's dtype), "bfloat16", "int8" (CPU), or "auto"
    # (under a float32 target on CPU: bfloat16 with AVX-512 BF16 or AMX, else int8);
    # models/draft_precision.py
    draft_dtype: str = "model"

    def __post_init__(self) -> None:
        if self.root_topk == 0:
            object.__setattr__(self, "root_topk", self.topk)

    @property
    def uses_head(self) -> bool:
        """Whether an EAGLE head drafts (every method but ``suffix``)."""
        return self.method != "suffix"

    @property
    def uses_trees(self) -> bool:
        """Whether drafts can branch (verified with tree attention and KV compaction)."""
        return self.root_topk > 1 or self.suffix is not None

    @property
    def num_draft_slots(self) -> int:
        """Draft tokens per request per step: what vLLM's scheduler reserves."""
        return self.total_tokens - 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EagleSpecConfig:
        data = dict(data)
        if data.get("suffix") is not None:
            data["suffix"] = SuffixConfig(**data["suffix"])
        return cls(**data)

    def vllm_speculative_config(self) -> dict[str, Any]:
        if not self.uses_head:
            return {
                "method": "custom_class",
                "model": SUFFIX_PROPOSER_CLASS,
                "num_speculative_tokens": self.num_draft_slots,
            }
        return {
            # eagle3 makes vLLM's runner collect the target's auxiliary layers
            # (SupportsEagle3.set_aux_hidden_state_layers) in the target forward
            "method": "eagle3" if self.head_type == "eagle3" else "eagle",
            "model": self.model,
            "num_speculative_tokens": self.num_draft_slots,
            # vLLM 0.32 drops the last prefix-cache block an EAGLE request hits, so that
            # its own drafter recomputes the hidden states there. This plugin's drafter
            # needs features only for the tokens it computes; a cached block's draft KV
            # was written when the block was filled, and a stale entry (the block's last
            # slot reads the next block's first token) can only lower acceptance:
            # verification is exact. Dropping it cost a whole block of prefill per hit.
            "disable_eagle_block_drop": True,
        }

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM`` / ``EngineArgs``."""
        kwargs = {
            "speculative_config": self.vllm_speculative_config(),
            "additional_config": {ADDITIONAL_CONFIG_KEY: self.to_dict()},
            "worker_cls": WORKER_CLS,
        }
        if self.suffix is not None and self.suffix.cache_requests > 0:
            # past responses are isolated by cache_salt, which this scheduler hands workers
            kwargs["scheduler_cls"] = SCHEDULER_CLS
        return kwargs


def eagle_config_of(vllm_config) -> EagleSpecConfig | None:
    """The plugin config a worker received (``additional_config``), or None."""
    extra = vllm_config.additional_config or {}
    data = extra.get(ADDITIONAL_CONFIG_KEY)
    return None if data is None else EagleSpecConfig.from_dict(data)


_ALLOWED_KEYS = {
    "method": (str,),
    "model": (str, os.PathLike),
    "num_speculative_tokens": (int,),
    "topk": (int,),
    # the root's children among the candidates (default topk; at least topk)
    "root_topk": (int,),
    "total_tokens": (int, str),  # N, or "auto" (load-aware sizing, eagle_vllm/sizing/)
    "max_total_tokens": (int,),  # the largest tree "auto" may pick
    "draft_sample_method": (str,),
    # "auto": the head's draft_vocab.json if it has one; "full"; or N most frequent
    "draft_vocab": (str, int),
    # with a reduced draft_vocab, also draft the tokens of each request's own context
    # (default: on wherever draft_vocab reduces the vocabulary)
    "draft_vocab_context": (bool,),
    # total_tokens: auto: a JSON file written by `eagle-vllm calibrate`
    "sizing_profile": (str, os.PathLike),
    # model-free suffix-tree candidates (SuffixConfig, SUFFIX_KEYS)
    "suffix": (dict,),
    # the draft's GEMMs: model, bfloat16, int8 or auto (DRAFT_DTYPES)
    "draft_dtype": (str,),
}
DRAFT_DTYPES = ("model", "bfloat16", "int8", "auto")


def cpu_has_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX tiles)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_has_int8_gemm() -> bool:
    """Whether PyTorch's x86 int8 engine (fbgemm: dynamic-quantized linear) runs here."""
    import torch

    return "fbgemm" in torch.backends.quantized.supported_engines


def slow_target_dtype_warning(model_dtype: torch.dtype, device_type: str) -> str | None:
    """A warning for a bfloat16 target on a CPU without bf16 GEMMs (None otherwise):
    there a step's matrix products cost in proportion to the tokens it verifies
    (``benchmarks/micro/cpu_gemm.py``), and drafts barely pay for themselves. vLLM's
    ``--dtype auto`` serves a checkpoint saved in bfloat16, as SmolLM2's is, in bfloat16."""
    import torch

    if device_type != "cpu" or model_dtype != torch.bfloat16 or cpu_has_bf16_gemm():
        return None
    return (
        "eagle-vllm: the target runs in bfloat16 on a CPU without AVX-512 BF16 or AMX. Its "
        "bf16 matrix products here cost in proportion to the tokens a step verifies, which "
        "eats most of what speculation gains. Fix: serve with --dtype float32 (README, "
        "'Which dtype to serve')."
    )


def check_draft_dtype(value: str, on_cpu: bool) -> None:
    """``draft_dtype`` is known, bfloat16 is only asked of a CPU that has bf16 GEMMs, and
    int8 only of a CPU with PyTorch's x86 int8 engine."""
    if value not in DRAFT_DTYPES:
        raise _fail("draft_dtype", f"unknown value '{value}'", f"use one of {list(DRAFT_DTYPES)}")
    if value == "int8" and not (on_cpu and cpu_has_int8_gemm()):
        raise _fail(
            "draft_dtype",
            "int8 draft GEMMs run on x86 CPUs only (PyTorch's fbgemm dynamic-quantized "
            "linear), and this worker is " + ("a CPU without it" if on_cpu else "a GPU"),
            "use draft_dtype: auto or model",
        )
    if value == "bfloat16" and on_cpu and not cpu_has_bf16_gemm():
        raise _fail(
            "draft_dtype",
            "bfloat16 needs a CPU with AVX-512 BF16 or AMX, and this one has neither "
            "(its bf16 GEMMs cost more than float32 ones)",
            "use draft_dtype: auto (bfloat16 where it pays) or model",
        )


def _fail(key: str, problem: str, fix: str) -> EagleConfigError:
    return EagleConfigError(f"speculative config key '{key}': {problem}. Fix: {fix}")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML or JSON speculative config file into a dict."""
    path = Path(path)
    if not path.is_file():
        raise EagleConfigError(
            f"speculative config file '{path}' does not exist. "
            "Fix: pass an existing .yaml/.yml/.json file, or a dict."
        )
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml.YAMLError, json.JSONDecodeError
        raise EagleConfigError(
            f"speculative config file '{path}' is not valid "
            f"{'JSON' if path.suffix.lower() == '.json' else 'YAML'}: {exc}. "
            "Fix: correct the syntax (see configs/eagle.yaml for an example)."
        ) from None
    if not isinstance(data, dict):
        raise EagleConfigError(
            f"speculative config file '{path}' must hold a mapping of keys "
            f"(method, model, ...), not {type(data).__name__}. "
            "Fix: see configs/eagle.yaml for an example."
        )
    return data


def parse_speculative_config(
    config: str | os.PathLike | dict[str, Any],
    *,
    target: str | None = None,
    speculative_model: str | None = None,
) -> EagleSpecConfig:
    """Parse and validate a config from a file path or a dict.

    A relative ``model`` resolves against the config file's folder (or the
    working directory for a dict). If ``target`` names a local model folder,
    the draft's hidden size and vocabulary are checked against it here.
    """
    base_dir = Path.cwd()
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = str(config)
        base_dir = Path(config).resolve().parent
        data = read_config_file(config)
    elif isinstance(config, dict):
        data = dict(config)
    else:
        raise EagleConfigError(
            f"speculative_config must be a dict or a path to a YAML/JSON file, "
            f"not {type(config).__name__}. Fix: pass e.g. 'configs/eagle.yaml'."
        )
    if speculative_model is not None:
        if data.get("model") not in (None, speculative_model):
            raise _fail(
                "model",
                f"given twice ('{data['model']}' in the config and "
                f"speculative_model='{speculative_model}')",
                "pass the draft folder in one place only",
            )
        data["model"] = speculative_model

    unknown = sorted(set(data) - set(_ALLOWED_KEYS))
    if unknown:
        raise _fail(
            unknown[0],
            "unknown key",
            f"remove it; the allowed keys are {sorted(_ALLOWED_KEYS)}",
        )
    for key, types in _ALLOWED_KEYS.items():
        if key in data and (
            not isinstance(data[key], types) or (isinstance(data[key], bool) and bool not in types)
        ):
            raise _fail(
                key,
                f"expected {' or '.join(t.__name__ for t in types)}, "
                f"got {type(data[key]).__name__} ({data[key]!r})",
                f"give '{key}' a value of that type",
            )

    method = data.get("method")
    if method is None:
        raise _fail("method", "missing", f"set it to one of {list(METHODS)}")
    # vLLM users write eagle3 for an EAGLE-3 chain; here the head type comes from the
    # checkpoint and the method is the drafting algorithm, so eagle3 is the eagle chain
    # that insists on an EAGLE-3 head (checked below, once the head is read).
    asked_eagle3 = method == METHOD_ALIASES_EAGLE3
    if asked_eagle3:
        method = "eagle"
    if method not in METHODS:
        raise _fail(
            "method",
            f"unknown method '{method}'",
            "use 'eagle' (chain; 'eagle3' is accepted for an EAGLE-3 head), 'eagle2' "
            "(dynamic tree) or 'suffix' (model-free); "
            "vLLM's built-in "
            "methods are passed to vLLM directly, not through eagle_vllm",
        )
    suffix = _parse_suffix_section(data.get("suffix"), base_dir)
    if method == "suffix":
        return _parse_model_free(data, suffix, source)
    if data.get("model") is None:
        raise _fail("model", "missing", "set it to the draft checkpoint folder")
    model_path = Path(os.fspath(data["model"])).expanduser()
    if not model_path.is_absolute():
        model_path = (base_dir / model_path).resolve()
    if not model_path.is_dir():
        raise _fail(
            "model",
            f"draft folder '{model_path}' does not exist",
            "point it at a folder with config.json and weights "
            "(a relative path resolves against the config file's folder)",
        )
    if not (model_path / "config.json").is_file():
        raise _fail(
            "model",
            f"draft folder '{model_path}' has no config.json",
            "use an EAGLE checkpoint folder (SafeAILab layout or eagle-vllm train output)",
        )

    auto_size = data.get("total_tokens") == "auto"
    if isinstance(data.get("total_tokens"), str) and not auto_size:
        raise _fail(
            "total_tokens", f"unknown value '{data['total_tokens']}'", "use a number or 'auto'"
        )
    for key in ("max_total_tokens", "sizing_profile"):
        if key in data and not auto_size:
            raise _fail(key, "only applies to total_tokens: auto",
                        "drop it, or set total_tokens: auto")  # fmt: skip
    if auto_size:
        data.pop("total_tokens")
        if "max_total_tokens" in data:
            data["total_tokens"] = data.pop("max_total_tokens")
    values = {**DEFAULTS[method], **{k: v for k, v in data.items() if k in _ALLOWED_KEYS}}
    depth = values["num_speculative_tokens"]
    topk = values["topk"]
    if depth < 1:
        raise _fail("num_speculative_tokens", f"{depth} is below 1", "use 1 or more")
    if topk < 1:
        raise _fail("topk", f"{topk} is below 1", "use 1 or more")
    root_topk = values.get("root_topk", topk)
    if root_topk < topk:
        raise _fail(
            "root_topk",
            f"{root_topk} is below topk {topk} (the beam below the root takes topk of the "
            "root's children)",
            f"use root_topk >= {topk}, or drop it",
        )
    if method == "eagle" and "root_topk" in data and root_topk != 1:
        raise _fail(
            "root_topk",
            f"method 'eagle' is a chain, root_topk must be 1 (got {root_topk})",
            "drop 'root_topk', or use method 'eagle2' for a tree",
        )
    if method == "eagle":
        if topk != 1:
            raise _fail(
                "topk",
                f"method 'eagle' is a chain, topk must be 1 (got {topk})",
                "drop 'topk', or use method 'eagle2' for a tree",
            )
        total = depth + 1
        if suffix is not None:  # the chain plus every suffix candidate: nothing to rerank
            total += suffix.max_nodes
        if "total_tokens" in data and data["total_tokens"] != total:
            raise _fail(
                "total_tokens",
                "method 'eagle' verifies num_speculative_tokens + 1 tokens (plus "
                "suffix.max_nodes with a suffix section)",
                "drop 'total_tokens', or use method 'eagle2' for a tree",
            )
    else:
        # Candidates the expansion can produce: root_topk at depth 1, topk*topk below, plus
        # the suffix candidates of a hybrid tree.
        max_nodes = 1 + root_topk + (depth - 1) * topk * topk
        if suffix is not None:
            max_nodes += suffix.max_nodes
        total = (
            values["total_tokens"]
            if "total_tokens" in data
            else min(values["total_tokens"], max_nodes)
        )
        if total < 2:
            raise _fail(
                "max_total_tokens" if auto_size else "total_tokens",
                f"{total} is below 2",
                "use 2 or more (root + 1 draft)",
            )
        if total > max_nodes:
            raise _fail(
                "max_total_tokens" if auto_size else "total_tokens",
                f"{total} exceeds the {max_nodes} nodes that depth {depth} with "
                f"topk {topk} (root_topk {root_topk}) can draft",
                f"use total_tokens <= {max_nodes}, or raise "
                "topk/root_topk/num_speculative_tokens"
                + (" or suffix.max_nodes" if suffix is not None else ""),
            )
    if total - 1 > MAX_DRAFT_SLOTS:
        raise _fail(
            "total_tokens" if method == "eagle2" else "num_speculative_tokens",
            f"{total - 1} draft tokens per step exceed vLLM's limit of {MAX_DRAFT_SLOTS}",
            f"use at most {MAX_DRAFT_SLOTS} drafts per step",
        )
    if values["draft_sample_method"] not in DRAFT_SAMPLE_METHODS:
        raise _fail(
            "draft_sample_method",
            f"unknown value '{values['draft_sample_method']}'",
            f"use one of {list(DRAFT_SAMPLE_METHODS)}",
        )
    if values["draft_sample_method"] == "sample" and root_topk != 1:
        # The EAGLE-2 rerank keeps or drops sampled siblings by their values, so they are
        # no longer draws from q and min(1, p/q) would not be exact.
        raise _fail(
            "draft_sample_method",
            f"'sample' drafts chains only (topk 1), got topk {topk}, root_topk {root_topk}",
            "use draft_sample_method: greedy for trees (exact for any tree), or topk: 1",
        )

    sizing_profile = None
    if "sizing_profile" in data:
        sizing_profile = _read_sizing_profile(
            data["sizing_profile"], base_dir, depth, topk, total, root_topk
        )

    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint

    info = inspect_draft_checkpoint(str(model_path))  # raises on unreadable/mismatched weights
    if asked_eagle3 and info.head_type != "eagle3":
        raise _fail(
            "method",
            f"'eagle3' needs an EAGLE-3 head, and '{model_path}' is an EAGLE-1 head "
            "(fc takes [embed; feature], no hidden_norm, no d2t)",
            "use method 'eagle' (the chain runs either head type) or an EAGLE-3 checkpoint",
        )
    draft_vocab = _resolve_draft_vocab(data.get("draft_vocab", "auto"), info)
    draft_vocab_context = _resolve_draft_vocab_context(data.get("draft_vocab_context"), draft_vocab)
    draft_dtype = data.get("draft_dtype", "model")
    check_draft_dtype(draft_dtype, on_cpu=not _has_cuda())
    cfg = EagleSpecConfig(
        draft_dtype=draft_dtype,
        head_type=info.head_type,
        draft_vocab=draft_vocab,
        draft_vocab_context=draft_vocab_context,
        method=method,
        model=str(model_path),
        num_speculative_tokens=depth,
        topk=topk,
        root_topk=root_topk,
        total_tokens=total,
        draft_sample_method=values["draft_sample_method"],
        auto_size=auto_size,
        sizing_profile=sizing_profile,
        suffix=suffix,
        source=source,
    )
    if target is not None:
        validate_against_target(cfg, target)
    return cfg


def _parse_suffix_section(value: dict[str, Any] | None, base_dir: Path) -> SuffixConfig | None:
    """The validated ``suffix:`` section (None when absent)."""
    if value is None:
        return None
    unknown = sorted(set(value) - set(SUFFIX_KEYS))
    if unknown:
        raise _fail(
            f"suffix.{unknown[0]}", "unknown key",
            f"remove it; the suffix section's keys are {sorted(SUFFIX_KEYS)}",
        )  # fmt: skip
    for key, types in SUFFIX_KEYS.items():
        if key in value and (not isinstance(value[key], types)
                             or (isinstance(value[key], bool) and bool not in types)):  # fmt: skip
            raise _fail(
                f"suffix.{key}",
                f"expected {' or '.join(t.__name__ for t in types)}, "
                f"got {type(value[key]).__name__} ({value[key]!r})",
                f"give 'suffix.{key}' a value of that type",
            )
    cfg = SuffixConfig(**{k: v for k, v in value.items() if k != "seed_corpus"})
    for key, least in (("max_depth", 1), ("max_nodes", 1), ("cache_requests", 0),
                       ("seed_tokens", 1)):  # fmt: skip
        if getattr(cfg, key) < least:
            raise _fail(f"suffix.{key}", f"{getattr(cfg, key)} is below {least}",
                        f"use {least} or more")  # fmt: skip
    if not 0.0 < cfg.min_prob <= 1.0:
        raise _fail("suffix.min_prob", f"{cfg.min_prob} is outside (0, 1]",
                    "use a path probability such as 0.1")  # fmt: skip
    if cfg.spec_factor <= 0:
        raise _fail("suffix.spec_factor", f"{cfg.spec_factor} is not above 0",
                    "use a depth per matched token such as 1.0")  # fmt: skip
    corpus = value.get("seed_corpus")
    if corpus is not None:
        path = Path(os.fspath(corpus)).expanduser()
        if not path.is_absolute():
            path = (base_dir / path).resolve()
        if not path.is_file():
            raise _fail(
                "suffix.seed_corpus", f"file '{path}' does not exist",
                "point it at a JSONL file of token_ids or texts (README: suffix drafting), "
                "or drop the key",
            )  # fmt: skip
        cfg = SuffixConfig(**{**asdict(cfg), "seed_corpus": str(path)})
    return cfg


def _parse_model_free(data: dict[str, Any], suffix: SuffixConfig | None,
                      source: str | None) -> EagleSpecConfig:  # fmt: skip
    """``method: suffix``: suffix-tree drafts and no head; the tree size comes from the
    suffix section."""
    for key, fix in (
        ("model", "drop it: method 'suffix' drafts without a head (or use eagle2 with a "
                  "suffix section for the hybrid)"),
        ("num_speculative_tokens", "use suffix.max_depth"),
        ("topk", "drop it: suffix trees branch where past text did"),
        ("total_tokens", "use suffix.max_nodes (drafts per step)"),
        ("max_total_tokens", "use suffix.max_nodes (drafts per step)"),
        ("sizing_profile", "drop it: method 'suffix' has no load-aware sizing"),
        ("draft_sample_method", "drop it: suffix drafts are deterministic"),
        ("draft_vocab", "drop it: there is no head"),
        ("draft_vocab_context", "drop it: there is no head"),
        ("draft_dtype", "drop it: there is no head"),
    ):  # fmt: skip
        if key in data:
            raise _fail(key, "does not apply to method 'suffix'", fix)
    suffix = suffix or SuffixConfig()
    if suffix.max_nodes > MAX_DRAFT_SLOTS:
        raise _fail(
            "suffix.max_nodes",
            f"{suffix.max_nodes} draft tokens per step exceed vLLM's limit of {MAX_DRAFT_SLOTS}",
            f"use at most {MAX_DRAFT_SLOTS}",
        )
    return EagleSpecConfig(
        method="suffix",
        model="",
        num_speculative_tokens=suffix.max_depth,
        topk=1,
        total_tokens=suffix.max_nodes + 1,
        suffix=suffix,
        source=source,
    )


def _read_sizing_profile(
    value: str | os.PathLike, base_dir: Path, depth: int, topk: int, total: int, root_topk: int
) -> dict[str, Any]:
    """The profile file's content, checked against this config's tree bound."""
    from eagle_vllm.sizing import check_profile

    path = Path(os.fspath(value)).expanduser()
    if not path.is_absolute():
        path = (base_dir / path).resolve()
    if not path.is_file():
        raise _fail(
            "sizing_profile",
            f"file '{path}' does not exist",
            "write it with `eagle-vllm calibrate`, or drop the key (the sizer then "
            "measures every arm while serving)",
        )
    try:
        profile = json.loads(path.read_text())
        check_profile(profile, depth, topk, total, root_topk)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        problem, _, fix = str(exc).partition(" Fix: ")
        raise _fail(
            "sizing_profile",
            f"'{path}': {problem.rstrip('.')}",
            fix or "use `eagle-vllm calibrate`",
        ) from None
    return profile


def resolve_draft_dtype(
    value: str, model_dtype: torch.dtype, device_type: str
) -> torch.dtype | None:
    """The dtype the draft's GEMMs run in (``draft_dtype`` on a worker whose model runs in
    ``model_dtype`` on ``device_type``; ``torch.qint8`` for int8), or None for the
    model's own."""
    import torch

    check_draft_dtype(value, on_cpu=device_type == "cpu")
    if value == "int8":
        return torch.qint8
    if value == "model" or model_dtype == torch.bfloat16:
        return None
    if value == "auto":
        if device_type != "cpu":
            return None
        if cpu_has_bf16_gemm():
            return torch.bfloat16
        return torch.qint8 if cpu_has_int8_gemm() else None
    return torch.bfloat16


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve_draft_vocab_context(value: bool | None, draft_vocab: int) -> bool:
    """On by default wherever the head drafts a reduced vocabulary; ``true`` needs one."""
    if value is None:
        return draft_vocab > 0
    if value and draft_vocab == 0:
        raise _fail(
            "draft_vocab_context",
            "adds each request's own tokens to a reduced draft vocabulary, and this head "
            "drafts a full one (draft_vocab resolved to 'full', or an EAGLE-3 head's own d2t "
            "vocabulary)",
            "drop draft_vocab_context, or set draft_vocab: N on a head with a draft_vocab.json",
        )
    return value


def _resolve_draft_vocab(value: str | int, info) -> int:
    """'auto' -> the head's reduced vocabulary if it has one; 'full' -> 0; N -> N."""
    if value == "auto":
        return info.draft_vocab_size
    if value == "full":
        return 0
    if isinstance(value, str):
        raise _fail("draft_vocab", f"unknown value '{value}'", "use auto, full or a number")
    if info.head_type == "eagle3" and info.has_draft_vocab_map:
        raise _fail(
            "draft_vocab",
            f"this EAGLE-3 head drafts over its own vocabulary ({info.head_vocab_size} tokens "
            "of its lm_head, mapped by d2t)",
            "drop draft_vocab",
        )
    if info.draft_vocab_size == 0:
        raise _fail(
            "draft_vocab",
            f"{value} needs the head's draft_vocab.json, which '{info.path}' lacks",
            "use 'full', or train the head with eagle-vllm train --ce-vocab N",
        )
    if not 1 <= value <= info.draft_vocab_size:
        raise _fail(
            "draft_vocab",
            f"{value} is outside 1..{info.draft_vocab_size} (the head's ranked token list)",
            f"use at most {info.draft_vocab_size}, or 'auto'",
        )
    return value


def _load_target_config(target: str) -> dict[str, Any] | None:
    path = Path(target).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    try:  # a hub id already in the local cache; never downloads here
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(target, local_files_only=True).to_dict()
    except Exception:
        return None


def validate_against_target(
    cfg: EagleSpecConfig, target: str, max_model_len: int | None = None
) -> None:
    """Check the draft fits the target: hidden size, vocabulary, context length."""
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint

    if max_model_len is not None and cfg.num_draft_slots + 1 >= max_model_len:
        key = {"eagle2": "total_tokens", "suffix": "suffix.max_nodes"}.get(
            cfg.method, "num_speculative_tokens"
        )
        raise _fail(
            key,
            f"{cfg.num_draft_slots} drafts per step do not fit max_model_len {max_model_len}",
            "use fewer draft tokens or a longer max_model_len",
        )
    if not cfg.uses_head:
        return
    info = inspect_draft_checkpoint(cfg.model)
    target_cfg = _load_target_config(target)
    if target_cfg is None:
        return  # checked again in the worker, where the target is loaded
    text_cfg = target_cfg.get("text_config", target_cfg)
    t_hidden, t_vocab = text_cfg.get("hidden_size"), text_cfg.get("vocab_size")
    if t_hidden is not None and info.hidden_size != t_hidden:
        raise _fail(
            "model",
            f"draft hidden_size {info.hidden_size} does not match the target's "
            f"{t_hidden} ({target})",
            "use a draft trained for this target (eagle-vllm train)",
        )
    if t_vocab is not None and info.vocab_size != t_vocab:
        raise _fail(
            "model",
            f"draft vocab_size {info.vocab_size} does not match the target's {t_vocab} ({target})",
            "use a draft trained for this target's tokenizer",
        )
    t_layers = text_cfg.get("num_hidden_layers")
    # id j is the residual stream entering layer j; j == num_layers is the last layer's output
    if info.aux_layer_ids and t_layers is not None and max(info.aux_layer_ids) > t_layers:
        raise _fail(
            "model",
            f"the EAGLE-3 head reads target layers {list(info.aux_layer_ids)} "
            f"(eagle_aux_hidden_state_layer_ids) but the target has {t_layers} layers ({target})",
            "use a head trained for this target",
        )


def is_eagle_vllm_request(spec: Any) -> bool:
    """Whether a ``speculative_config`` value is meant for this plugin.

    A file path always is. A dict is when its method is ``eagle2`` or it uses a
    key that only this plugin has; plain ``{"method": "eagle", ...}`` stays
    vLLM's built-in EAGLE (the baseline).
    """
    if isinstance(spec, (str, os.PathLike)):
        return True
    if isinstance(spec, dict):
        if spec.get("_eagle_vllm_source"):
            return True
        if spec.get("method") == "eagle2":
            return True
        plugin_only = {
            "topk", "total_tokens", "max_total_tokens", "draft_sample_method", "sizing_profile",
            "suffix",
        }  # fmt: skip
        return bool((plugin_only | {"draft_vocab", "draft_vocab_context"}) & set(spec))
    return False
