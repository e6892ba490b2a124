"""EAGLE-3 heads: the model in plain torch, training-time test, ``speculators`` export.

The head (SafeAILab ``eagle/traineagle3/cnets.py``; vLLM 0.32 ``llama_eagle3.py``)::

    g_i  = fc([a_i ; b_i ; c_i])                     features of n target layers, nH -> H
    x    = [RMSNorm_in(embed(t_{i+1})) ; RMSNorm_hidden(g_i)]          2H, into q/k/v
    h    = g_i + Attn(x)                             (norm_before_residual: false)
    o_i  = h + MLP(RMSNorm(h))                       the next step's feature
    q    = softmax(lm_head(RMSNorm(o_i)))            over the draft vocabulary (its own head)

**Training-time test** (TTT). Step 0 is the first pass over the sequence: position i
takes token t_{i+1} with the target's feature g_i and predicts t_{i+2}. Step s >= 1
feeds back the head's own output: position i takes token t_{i+1+s} with o_i of step
s-1, sits at position i+s, and predicts t_{i+2+s}; it attends to step 0's keys at
positions <= i (the prefix's draft KV at inference) and to its own earlier steps' keys
at row i (its ancestors in the draft tree). That is exactly what a draft node at depth
s+1 sees in the plugin's tree drafter, so the head is trained on the inputs it drafts
from. The tokens are the true ones (a drafted node only matters if it was right).

**Loss** per step: soft cross-entropy against the target's distribution restricted to
the draft vocabulary (log-softmax over those logits), at positions whose target argmax
lies in the draft vocabulary (SafeAILab's mask) and whose input token is an assistant
token; steps weighted ``decay**s``. Optional extras, off by default: a HASS-style term
(``--ttt-topk-weight``), the same cross-entropy over the target's top-K tokens only; a
feature term (``--ttt-feature-weight``), SmoothL1 between the head's normed output and the
target's last hidden state at that position; ``--ttt-freeze-lm-head`` keeps the LM head at
the target's rows (cheaper steps).

**Export**: a ``speculators``-format folder (``config.json`` with
``speculators_model_type: eagle3``; ``model.safetensors`` with ``fc``, ``layers.0.*``,
``norm``, ``lm_head``, ``d2t``, ``t2d``; the embedding is the target's), which stock
vLLM (``method: eagle3``) and the plugin both load. With ``--share-lm-head`` the head
drafts the whole vocabulary through the target's own LM head, frozen during training and
left out of the export (no ``lm_head``, ``d2t``, ``t2d``): vLLM's loader then shares the
target's (``has_own_lm_head`` false), and no token is out of the draft's reach (a reduced
vocabulary ranked on chat answers leaves out names and identifiers the target copies from
the prompt: ``benchmarks/draft_vocab_coverage.py``). Its ``draft_vocab.json`` ranks the
16384 most frequent assistant tokens, for configs that draft over fewer LM-head rows
(``draft_vocab: N``, cheaper draft passes). ``--lm-head-sample N`` makes training such
a head affordable: each training batch's softmaxes (the head's and the target's,
renormalised) run over the N most frequent assistant tokens, every token of the batch's
conversations (what the target copies) and the target's argmaxes: 8220-8582 of
SmolLM2's 49152 columns per 4096-token batch of its chat data at N = 8192. Validation
still scores the whole vocabulary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle_vllm.train.features import Example
from eagle_vllm.train.head import MLP, RMSNorm, SelfAttention, rope_theta
from eagle_vllm.train.trainer import (
    TrainConfig,
    Trainer,
    check_init_vocab_size,
    feature_noise,
    frequent_tokens,
    write_draft_vocab,
)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM 0.32's default (``get_eagle3_default_aux_hidden_state_layers``): the inputs of
    layers 2, L/2 and L-3 (SafeAILab's choice)."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Attention(SelfAttention):
    """q/k/v from [embed ; feature] (2H); the unrolled attention is the EAGLE-1 head's
    (step 0's causal keys plus the row's own earlier steps, ``cache``)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float):
        super().__init__(hidden, heads, kv_heads, head_dim, theta)
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, config: dict, theta: float):
        super().__init__()
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Eagle3Attention(
            hidden, heads, config.get("num_key_value_heads", heads), head_dim, theta
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config["intermediate_size"])

    def forward(self, embeds, features, positions, cache) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        h = features + self.self_attn(x, positions, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The trainable EAGLE-3 head; the token embedding is the target's (frozen, outside)."""

    def __init__(self, target_config: dict, num_aux: int, draft_vocab_size: int):
        super().__init__()
        hidden = target_config["hidden_size"]
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(target_config, rope_theta(target_config))])
        self.norm = RMSNorm(hidden, target_config.get("rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        std = target_config.get("initializer_range", 0.02)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, std)
        layer = self.layers[0]
        layer.self_attn.o_proj.weight.data.mul_(1 / math.sqrt(2))
        layer.mlp.down_proj.weight.data.mul_(1 / math.sqrt(2))

    def unroll(self, embeds_of, tokens: torch.Tensor, aux: torch.Tensor, steps: int,
               with_hidden: bool = False):  # fmt: skip
        """Training-time test over ``tokens [B, L]`` and features ``aux [B, L, nH]``:
        ``steps`` logits ``[B, L, V']``; step s at row i predicts token i+2+s. With
        ``with_hidden``, also each step's normed output ``[B, L, H]`` (what the LM head reads)."""
        hidden = self.unroll_outputs(embeds_of, tokens, aux, steps)
        out = [self.lm_head(h) for h in hidden]
        return (out, hidden) if with_hidden else out

    def unroll_outputs(self, embeds_of, tokens: torch.Tensor, aux: torch.Tensor,
                       steps: int) -> list[torch.Tensor]:  # fmt: skip
        """Each unrolled step's normed output ``[B, L, H]``, before the LM head (the
        trainer applies the head to the loss rows only)."""
        b, n = tokens.shape
        features = self.fc(aux)
        base = torch.arange(n, device=tokens.device)[None, :].expand(b, n)
        padded = F.pad(tokens, (0, steps + 1))
        cache: list = []
        hidden = []
        for s in range(steps):
            embeds = embeds_of(padded[:, 1 + s : 1 + s + n])
            features = self.layers[0](embeds, features, base + s, cache)
            hidden.append(self.norm(features))
        return hidden


def target_distributions(
    last_hidden: torch.Tensor,
    lm_head: torch.Tensor,
    draft_ids: torch.Tensor,
    chunk: int = 1024,
    argmax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position of ``last_hidden [N, H]``: the target's log-probabilities restricted
    to the draft vocabulary (renormalised there) ``[N, V']``, whether the target's argmax
    lies in the draft vocabulary ``[N]``, and that argmax's draft column (-1 if not).

    ``argmax [N]``: the target's full-vocabulary argmax there, if known (see
    :func:`target_argmax`); otherwise it is computed here, over the whole LM head."""
    if argmax is None:
        argmax = target_argmax(last_hidden, lm_head, chunk)
    in_vocab = torch.full((lm_head.shape[0],), -1, dtype=torch.int64)
    in_vocab[draft_ids] = torch.arange(len(draft_ids))
    draft_head = lm_head[draft_ids]
    logps = [
        torch.log_softmax(last_hidden[start : start + chunk].float() @ draft_head.T, dim=-1)
        for start in range(0, last_hidden.shape[0], chunk)
    ]
    column = in_vocab[argmax]
    return torch.cat(logps), column >= 0, column


@torch.no_grad()
def target_argmax(last_hidden: torch.Tensor, lm_head: torch.Tensor, chunk: int = 1024):
    """The target's full-vocabulary argmax for each row of ``last_hidden [N, H]``."""
    return torch.cat([
        (last_hidden[start : start + chunk].float() @ lm_head.T).argmax(-1)
        for start in range(0, last_hidden.shape[0], chunk)
    ]) if len(last_hidden) else torch.zeros(0, dtype=torch.int64)  # fmt: skip


def ttt_losses(
    logits: list[torch.Tensor],
    target_logp: torch.Tensor,
    target_column: torch.Tensor,
    valid: torch.Tensor,
    *,
    target_hidden: torch.Tensor | None = None,
    **options,
) -> dict[str, torch.Tensor]:
    """Loss and per-step top-1 agreement. ``logits[s] [B, L, V']``; ``target_logp``
    ``[B, L, V']`` and ``target_column [B, L]`` at the position whose next token step 0
    predicts (row i -> position i+1); ``valid [B, L]``: rows whose input token at step 0
    is an assistant token. Step s reads the targets and validity s rows further.
    ``target_hidden [B, L, H]``: the target's last hidden state, for the feature term.

    The dense form of :func:`ttt_row_losses` (same ``options``), which the trainer uses on
    the loss rows only."""
    rows = (valid & (target_column >= 0)).nonzero(as_tuple=True)
    return ttt_row_losses(
        logits, lambda x: x, rows, target_logp[rows], target_column[rows],
        target_hidden=None if target_hidden is None else target_hidden[rows], **options,
    )  # fmt: skip


def ttt_row_losses(
    outputs: list[torch.Tensor],
    project,
    rows: tuple[torch.Tensor, torch.Tensor],
    target_logp: torch.Tensor,
    target_column: torch.Tensor,
    *,
    decay: float,
    topk: int = 0,
    topk_weight: float = 0.0,
    hidden: list[torch.Tensor] | None = None,
    target_hidden: torch.Tensor | None = None,
    feature_weight: float = 0.0,
    loss_steps: int | None = None,
) -> dict[str, torch.Tensor]:
    """The training-time-test loss on the loss rows only. ``rows = (batch, j)``: the M
    target rows with a loss (assistant input token, target argmax in the draft vocabulary);
    ``target_logp [M, V']``, ``target_column [M]`` (and ``target_hidden [M, H]``) there.
    Step s scores row j from its output at row j - s: ``project(outputs[s][b, j - s])``
    gives the logits, so the LM head and the softmax run on M rows per step, not on every
    position of the batch. Steps from ``loss_steps`` on (None: none) are scored, not
    trained: their accuracy and CE are reported, and the loss leaves them out."""
    batch, j = rows
    total = target_logp.new_zeros(())
    parts: dict[str, torch.Tensor] = {}
    weight_sum = 0.0
    for s, out in enumerate(outputs):
        keep = j >= s
        if not bool(keep.any()):
            continue
        at = (batch[keep], j[keep] - s)
        logp = torch.log_softmax(project(out[at]).float(), dim=-1)
        tgt, col = target_logp[keep], target_column[keep]
        ce = -(tgt.exp() * logp).sum(-1).mean()
        loss = ce
        if topk and topk_weight:
            top = tgt.topk(topk, dim=-1).indices
            p_top = tgt.gather(-1, top).exp()
            loss = loss + topk_weight * -(p_top * logp.gather(-1, top)).sum(-1).mean()
        if feature_weight and hidden is not None and target_hidden is not None:
            mine = hidden[s][at].float()
            loss = loss + feature_weight * F.smooth_l1_loss(mine, target_hidden[keep].float())
        if loss_steps is None or s < loss_steps:
            total = total + decay**s * loss
            weight_sum += decay**s
        with torch.no_grad():
            parts[f"acc_{s + 1}"] = (logp.argmax(-1) == col).float().mean()
            parts[f"ce_{s + 1}"] = ce.detach()
    parts["loss"] = total / max(weight_sum, 1e-9)
    parts["acc"] = parts.get("acc_1", total.new_zeros(()))
    return parts


def export_speculators(
    head: Eagle3Head,
    out: Path,
    *,
    target: str | Path,
    target_config: dict,
    aux_layers: tuple[int, ...],
    draft_ids: torch.Tensor,
    dtype: torch.dtype,
    speculative_tokens: int,
    extra: dict,
    shared_lm_head: bool = False,
) -> Path:
    """Write the head as a ``speculators`` eagle3 folder (see the module docstring). With
    ``shared_lm_head`` the head drafts the whole vocabulary through the target's LM head:
    no ``lm_head``, ``d2t`` or ``t2d`` is written, and loaders share the target's."""
    from safetensors.torch import save_file

    vocab = target_config["vocab_size"]
    # d2t[i] = target id of draft column i, minus i (the speculators/SafeAILab offset table);
    # vLLM adds it back in compute_logits. Columns are stored in ascending target id.
    order = torch.argsort(draft_ids)
    used = draft_ids[order]
    weights = {k: v.detach() for k, v in head.state_dict().items()}
    weights["lm_head.weight"] = weights["lm_head.weight"][order]
    weights = {k: v.to(dtype).contiguous() for k, v in weights.items()}
    if shared_lm_head:
        if len(used) != vocab:
            raise ValueError(f"a shared LM head drafts all {vocab} tokens, not {len(used)}")
        del weights["lm_head.weight"]
    else:
        weights["d2t"] = (used - torch.arange(len(used))).to(torch.int64).contiguous()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
        weights["t2d"] = t2d
    save_file(weights, str(out / "model.safetensors"))
    layer_cfg = {
        k: target_config[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
            "rope_parameters",
            "rope_scaling",
            "vocab_size",
            "hidden_act",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "attention_bias",
            "mlp_bias",
        )  # fmt: skip
        if k in target_config
    }
    layer_cfg.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        # vLLM 0.32 sizes fc from this (else 3 layers) for speculators configs
        num_aux_hidden_states=len(aux_layers),
        tie_word_embeddings=False,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "draft_vocab_size": len(used),
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "transformer_layer_config": layer_cfg,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": str(target),
                "architectures": target_config.get("architectures", []),
            },
        },
        "eagle_vllm": extra,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def parse_aux_layers(value: str, num_layers: int) -> tuple[int, ...]:
    """``--aux-layers`` ("" -> the default; "2,15,27" -> those), checked against the target."""
    layers = (
        default_aux_layers(num_layers) if not value else tuple(int(x) for x in value.split(","))
    )
    if len(set(layers)) != len(layers) or not all(0 <= j < num_layers for j in layers):
        raise ValueError(
            f"--aux-layers {list(layers)}: need distinct layer indices in [0, {num_layers}). "
            "Fix: e.g. --aux-layers 2,15,27, or leave it empty for (2, L/2, L-3)."
        )
    return layers


def check_lm_head_options(share_lm_head: bool, ce_vocab: int, lm_head_sample: int) -> None:
    """Raise ValueError (what is wrong, and the fix) for LM-head options that do not go
    together; the CLI calls it before any work, the trainer again."""
    if share_lm_head and ce_vocab:
        raise ValueError(
            f"--share-lm-head drafts the whole vocabulary through the target's LM head, "
            f"but --ce-vocab {ce_vocab} asks for a reduced one. Fix: drop "
            "--ce-vocab (or pass 0), or drop --share-lm-head."
        )
    if lm_head_sample and not share_lm_head:
        raise ValueError(
            f"--lm-head-sample {lm_head_sample} samples the columns of the shared "
            "LM head. Fix: add --share-lm-head, or drop --lm-head-sample (a reduced "
            "vocabulary is --ce-vocab)."
        )
    if lm_head_sample < 0:
        raise ValueError(
            f"--lm-head-sample {lm_head_sample}: need 0 (the whole vocabulary) or "
            "a positive number of frequent tokens, e.g. 8192."
        )


def collate_eagle3(examples: list[Example], indices: list[int]):
    width = max(len(examples[i].input_ids) for i in indices)
    b = len(indices)
    first = examples[indices[0]]
    ids = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.bool)
    aux = torch.zeros(b, width, first.aux.shape[-1])
    last = torch.zeros(b, width, first.hidden.shape[-1])
    for row, i in enumerate(indices):
        ex = examples[i]
        n = len(ex.input_ids)
        ids[row, :n], mask[row, :n] = ex.input_ids, ex.loss_mask
        aux[row, :n], last[row, :n] = ex.aux.float(), ex.hidden.float()
    return ids, mask, aux, last


class Eagle3Trainer(Trainer):
    """The EAGLE-1 trainer's loop, schedule, resume and logging, with the EAGLE-3 head,
    the training-time test and the speculators export. ``ce_vocab`` is the draft
    vocabulary (0: the full vocabulary, no d2t)."""

    default_ttt_steps = 5

    def __init__(self, target, examples: list[Example], out_dir, config: TrainConfig,
                 aux_layers: tuple[int, ...]):  # fmt: skip
        if examples and examples[0].aux is None:
            raise ValueError(
                "the feature cache has no EAGLE-3 layer features. Fix: use a --features-dir "
                "made with --arch eagle3 (or a new one)."
            )
        if examples and examples[0].aux.shape[-1] != len(aux_layers) * examples[0].hidden.shape[-1]:
            raise ValueError(
                f"the feature cache holds other layers than {list(aux_layers)}. Fix: use a "
                "new --features-dir for these --aux-layers."
            )
        check_lm_head_options(config.share_lm_head, config.ce_vocab, config.lm_head_sample)
        self.aux_layers = aux_layers
        self.target = target
        super().__init__(target, examples, out_dir, config)
        self.frequent_ids = (
            frequent_tokens(self.train, len(self.vocab_ids), config.lm_head_sample)
            if config.lm_head_sample
            else None
        )

    def sampled_columns(self, ids: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
        """The columns of a sampled-softmax batch, in ascending id: the frequent tokens,
        every token of the batch's conversations (what the target may copy) and the target's
        argmax at each loss row (so every loss row keeps its label)."""
        return torch.unique(torch.cat([self.frequent_ids, ids.flatten(), argmax]))

    def draft_vocabulary(self, vocab_size: int) -> torch.Tensor:
        """A warm start keeps its head's draft vocabulary (its ``d2t``), so that training
        can go on over more or other data, whose most frequent tokens differ; otherwise
        the most frequent tokens of the training split."""
        if self.cfg.share_lm_head:
            return torch.arange(vocab_size)
        init = Path(self.cfg.init_from) / "model.safetensors" if self.cfg.init_from else None
        if init is None or not init.is_file():
            return super().draft_vocabulary(vocab_size)  # warm_start reports a missing file
        from safetensors import safe_open

        with safe_open(str(init), framework="pt") as f:
            if "lm_head.weight" not in f.keys():  # a shared-LM-head head: no rows to keep
                return super().draft_vocabulary(vocab_size)
            d2t = f.get_tensor("d2t") if "d2t" in f.keys() else None
        ids = torch.arange(vocab_size) if d2t is None else d2t + torch.arange(len(d2t))
        check_init_vocab_size(ids, self.cfg, vocab_size, "--init-from ", "drafts")
        return ids.to(torch.int64)

    def build_model(self) -> nn.Module:
        head = Eagle3Head(self.target_config, len(self.aux_layers), len(self.vocab_ids))
        with torch.no_grad():  # start from the target's own LM-head rows
            head.lm_head.weight.copy_(self.lm_head)
        # frozen: the target's rows stay (a third of the LM head's GEMMs saved per step)
        frozen = self.cfg.ttt_freeze_lm_head or self.cfg.share_lm_head
        head.lm_head.weight.requires_grad_(not frozen)
        return head

    def adapt_warm_start(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An exported head stores its LM-head rows in ascending target id, with ``d2t``;
        this trainer holds them in its draft vocabulary's order (``vocab_ids``)."""
        weights = dict(weights)
        d2t = weights.pop("d2t", None)
        weights.pop("t2d", None)
        rows = weights.get("lm_head.weight")
        if rows is None or self.cfg.share_lm_head:
            # a shared-LM-head head has no rows, and a shared-LM-head run keeps the target's
            weights["lm_head.weight"] = self.lm_head
            return weights
        exported_ids = torch.arange(rows.shape[0]) if d2t is None else d2t + torch.arange(len(d2t))
        row_of = torch.full((self.target_lm_head.shape[0],), -1, dtype=torch.int64)
        row_of[exported_ids] = torch.arange(len(exported_ids))
        order = row_of[self.vocab_ids]
        if len(exported_ids) != len(self.vocab_ids) or bool((order < 0).any()):
            raise ValueError(
                f"--init-from '{self.cfg.init_from}' drafts another vocabulary than this run "
                f"({len(exported_ids)} tokens vs --ce-vocab {len(self.vocab_ids)}, or other "
                "tokens). Fix: train on the data and --ce-vocab that head was trained with."
            )
        weights["lm_head.weight"] = rows[order]
        return weights

    def _losses(self, indices: list[int], examples: list[Example], train: bool):
        ids, mask, aux, last = collate_eagle3(examples, indices)
        if train:
            aux = feature_noise(aux, self.cfg.noise, self.cfg.noise_scale)
        # loss row j: input token t_{j+1} is an assistant token; step 0 predicts t_{j+2} from
        # the target's distribution at position j+1. The target's LM head, the draft's and the
        # softmaxes run on these rows only (prompt and padding rows only feed attention).
        vb, vj = mask[:, 1:].nonzero(as_tuple=True)
        target_last = last[:, 1:][vb, vj]
        argmax = torch.cat([self._target_argmax(examples[i]) for i in indices])
        columns, project = self.vocab_ids, self.model.lm_head
        if train and self.frequent_ids is not None:
            # the sampled softmax: the frozen shared head's rows of this batch's columns only
            columns = self.sampled_columns(ids, argmax)
            rows = self.model.lm_head.weight[columns]
            project = lambda h: F.linear(h, rows)  # noqa: E731
        logp, in_vocab, column = target_distributions(
            target_last, self.target_lm_head, columns, argmax=argmax
        )
        steps = self.cfg.ttt_steps if train else max(self.cfg.ttt_steps, self.cfg.eval_ttt_steps)
        outputs = self.model.unroll_outputs(lambda t: self.embed[t], ids, aux, steps)
        feature_term = bool(self.cfg.ttt_feature_weight)
        return ttt_row_losses(
            outputs, project, (vb[in_vocab], vj[in_vocab]), logp[in_vocab],
            column[in_vocab], decay=self.cfg.ttt_decay, topk=self.cfg.ttt_topk,
            topk_weight=self.cfg.ttt_topk_weight, hidden=outputs if feature_term else None,
            target_hidden=target_last[in_vocab] if feature_term else None,
            feature_weight=self.cfg.ttt_feature_weight, loss_steps=self.cfg.ttt_steps,
        )  # fmt: skip

    def _target_argmax(self, example: Example) -> torch.Tensor:
        """The target's full-vocabulary argmax at the example's loss rows (positions 1.. with
        an assistant token), in row order. Computed on first use and kept on the example:
        every later epoch then needs only the draft vocabulary's rows of the LM head."""
        if example.target_argmax is None:
            rows = example.loss_mask.clone()
            rows[0] = False
            argmax = torch.full((len(rows),), -1, dtype=torch.int32)
            argmax[rows] = target_argmax(example.hidden[rows], self.target_lm_head).int()
            example.target_argmax = argmax
        return example.target_argmax[1:][example.loss_mask[1:]].long()

    def export(self, dtype: str = "bfloat16") -> Path:
        from dataclasses import asdict

        if self.cfg.share_lm_head:
            # the whole vocabulary is drafted; this ranking lets a config draft over the
            # most frequent part of it (draft_vocab: N), a cheaper LM head per pass
            vocab = len(self.vocab_ids)
            write_draft_vocab(self.out, frequent_tokens(self.train, vocab, min(vocab, 16384)))
        return export_speculators(
            self.model, self.out, target=self.target, target_config=self.target_config,
            aux_layers=self.aux_layers, draft_ids=self.vocab_ids,
            shared_lm_head=self.cfg.share_lm_head,
            dtype={"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype],
            speculative_tokens=3,
            extra={"trained_steps": self.step, "train_config": asdict(self.cfg)},
        )  # fmt: skip


def plot_eagle3_curves(log_path: Path, png_path: Path) -> None:
    """Loss, and validation top-1 agreement per unrolled step, over training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4))
    ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], alpha=0.6, label="train")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("TTT loss (decay-weighted soft CE)")
    ax_loss.legend()
    steps = sorted({int(k.split("_")[-1]) for r in val for k in r if k.startswith("val_acc_")})
    for s in steps:
        pts = [(r["step"], r[f"val_acc_{s}"]) for r in val if f"val_acc_{s}" in r]
        ax_acc.plot(*zip(*pts), "o-", label=f"unrolled step {s}")
    ax_acc.set_xlabel("step")
    ax_acc.set_title("validation top-1 agreement with the target")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
