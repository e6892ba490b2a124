"""EAGLE-3 training pieces in plain torch (``eagle_vllm/train/eagle3.py``): the training-
time test against a step-by-step drafting reference, the loss's masks, and the export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle_vllm.train.eagle3 import (
    Eagle3Head,
    collate_eagle3,
    export_speculators,
    parse_aux_layers,
    target_distributions,
    ttt_losses,
)
from eagle_vllm.train.head import apply_rope

torch.set_num_threads(1)

CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 50,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
}


def _head(seed: int = 0, vocab: int = 20) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(CONFIG, num_aux=3, draft_vocab_size=vocab)
    for p in head.parameters():  # larger than the init, so every path matters
        p.data.normal_(0, 0.3)
    return head


def node_attention(attn, x, position, prefix_kv, ancestors_kv):
    """A draft node's attention, written out: its query over the prefix's draft KV (first
    pass, positions before the root's), its ancestors' KV and its own. ``x [1, 1, D]``;
    returns (output ``[1, 1, H]``, the node's (k, v))."""
    pos = torch.tensor([[position]])
    q = apply_rope(attn.q_proj(x).view(1, 1, attn.heads, -1).transpose(1, 2), pos, attn.theta)
    k = apply_rope(attn.k_proj(x).view(1, 1, attn.kv_heads, -1).transpose(1, 2), pos, attn.theta)
    v = attn.v_proj(x).view(1, 1, attn.kv_heads, -1).transpose(1, 2)
    g = attn.heads // attn.kv_heads
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    keys = torch.cat([prefix_kv[0], *[a[0] for a in ancestors_kv], k], dim=2)
    values = torch.cat([prefix_kv[1], *[a[1] for a in ancestors_kv], v], dim=2)
    probs = torch.softmax((q @ keys.transpose(-1, -2)) / attn.head_dim**0.5, -1)
    return attn.o_proj((probs @ values).transpose(1, 2).reshape(1, 1, -1)), (k, v)


def _draft_step(head, embeds, feature, position, prefix_kv, ancestors_kv):
    """One draft node as the plugin drafts it: attends to the prefix's draft KV (first
    pass, positions <= root) and to its ancestors' KV; returns (logits, feature, k, v)."""
    layer = head.layers[0]
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(feature)], -1)[None, None]
    out, (k, v) = node_attention(layer.self_attn, x, position, prefix_kv, ancestors_kv)
    h = feature + out[0, 0]
    o = h + layer.mlp(layer.post_attention_layernorm(h))
    return head.lm_head(head.norm(o)), o, (k, v)


@pytest.mark.parametrize("steps", [1, 3])
def test_unroll_equals_drafting_node_by_node(steps):
    """Step s of the training-time test at row i is the draft node at depth s+1 under root
    i: same inputs (true tokens, the previous step's output feature, position i+s) and
    the same attention (prefix draft KV up to i, then its ancestors)."""
    head = _head()
    n = 9
    torch.manual_seed(1)
    embed = torch.randn(CONFIG["vocab_size"], 32)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, n))
    aux = torch.randn(1, n, 96)
    with torch.no_grad():
        got = head.unroll(lambda t: embed[t], tokens, aux, steps)
        features = head.fc(aux)[0]
        padded = torch.nn.functional.pad(tokens[0], (0, steps + 1))
        # first pass: every position's step-0 K/V (the prefix's draft KV)
        prefix_k, prefix_v = [], []
        for j in range(n):
            _, _, (k, v) = _draft_step(
                head, embed[padded[j + 1]], features[j], j,
                (torch.zeros(1, 4, 0, 8), torch.zeros(1, 4, 0, 8)), [],
            )  # fmt: skip
            prefix_k.append(k)
            prefix_v.append(v)
        for i in range(n):
            prefix = (torch.cat(prefix_k[:i], 2) if i else torch.zeros(1, 4, 0, 8),
                      torch.cat(prefix_v[:i], 2) if i else torch.zeros(1, 4, 0, 8))  # fmt: skip
            feature, ancestors = features[i], []
            for s in range(steps):
                logits, feature, kv = _draft_step(
                    head, embed[padded[i + 1 + s]], feature, i + s, prefix, ancestors
                )
                ancestors.append(kv)
                torch.testing.assert_close(got[s][0, i], logits, atol=1e-5, rtol=1e-5)


def test_ttt_loss_masks_and_per_step_accuracy():
    b, n, v = 2, 6, 5
    target_logp = torch.log_softmax(torch.randn(b, n, v), -1)
    column = target_logp.argmax(-1)
    column[0, 2] = -1  # the target's argmax is outside the draft vocabulary: masked
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :] = False  # not assistant tokens
    perfect = [target_logp.clone() * 50 for _ in range(2)]  # step 1 reads rows s: later
    perfect[1] = torch.cat([perfect[1][:, 1:], perfect[1][:, :1]], 1)
    parts = ttt_losses(perfect, target_logp, column, valid, decay=0.8)
    assert parts["acc_1"] == 1.0 and parts["acc_2"] == 1.0
    wrong = [-x for x in perfect]
    parts = ttt_losses(wrong, target_logp, column, valid, decay=0.8)
    assert parts["acc_1"] == 0.0 and parts["loss"] > 1.0
    # a masked row cannot move the loss
    moved = [x.clone() for x in wrong]
    moved[0][1] += 100.0
    moved[0][0, 2] += 100.0
    assert torch.isclose(
        ttt_losses(moved, target_logp, column, valid, decay=0.8)["loss"],
        ttt_losses(wrong, target_logp, column, valid, decay=0.8)["loss"],
    )


def test_target_distributions_restricted_to_draft_vocab():
    torch.manual_seed(0)
    lm_head = torch.randn(30, 8)
    hidden = torch.randn(11, 8)
    draft_ids = torch.tensor([3, 7, 1, 20])
    logp, in_vocab, column = target_distributions(hidden, lm_head, draft_ids, chunk=4)
    full = hidden @ lm_head.T
    torch.testing.assert_close(logp, torch.log_softmax(full[:, draft_ids], -1))
    for r in range(11):
        top = int(full[r].argmax())
        assert bool(in_vocab[r]) == (top in draft_ids.tolist())
        assert int(column[r]) == (draft_ids.tolist().index(top) if in_vocab[r] else -1)
    # with the full-vocabulary argmax known, only the draft rows are multiplied: same result
    known = target_distributions(hidden, lm_head, draft_ids, chunk=4, argmax=full.argmax(-1))
    for got, want in zip(known, (logp, in_vocab, column)):
        torch.testing.assert_close(got, want)


def test_export_is_a_speculators_checkpoint_with_d2t(tmp_path):
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint

    head = _head(vocab=4)
    draft_ids = torch.tensor([9, 2, 40, 17])  # frequency order, not id order
    export_speculators(
        head, tmp_path, target="t", target_config={**CONFIG, "num_hidden_layers": 6},
        aux_layers=(2, 3, 4), draft_ids=draft_ids, dtype=torch.float32,
        speculative_tokens=3, extra={},
    )  # fmt: skip
    info = inspect_draft_checkpoint(str(tmp_path))
    assert info.head_type == "eagle3" and info.speculators_format
    assert info.aux_layer_ids == (2, 3, 4) and info.head_vocab_size == 4
    from safetensors.torch import load_file

    w = load_file(str(tmp_path / "model.safetensors"))
    used = torch.arange(4) + w["d2t"]
    assert used.tolist() == [2, 9, 17, 40]
    # row i of the exported LM head scores target token used[i]
    for i, token in enumerate(used.tolist()):
        row = draft_ids.tolist().index(token)
        torch.testing.assert_close(w["lm_head.weight"][i], head.lm_head.weight[row].detach())
    assert w["t2d"].sum() == 4 and bool(w["t2d"][40])
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_aux_hidden_states"] == 3
    assert cfg["norm_before_residual"] is False


def test_aux_layers_parsing():
    assert parse_aux_layers("", 30) == (2, 15, 27)
    assert parse_aux_layers("1,5,7", 30) == (1, 5, 7)
    for bad in ("1,1,2", "0,30", "-1,2"):
        with pytest.raises(ValueError, match="Fix"):
            parse_aux_layers(bad, 30)


def test_feature_term_is_zero_at_the_target_and_positive_elsewhere():
    b, n, v, h = 2, 5, 4, 8
    torch.manual_seed(0)
    target_logp = torch.log_softmax(torch.randn(b, n, v), -1)
    column = target_logp.argmax(-1)
    valid = torch.ones(b, n, dtype=torch.bool)
    logits = [torch.randn(b, n, v), torch.randn(b, n, v)]
    target_hidden = torch.randn(b, n, h)
    same = [target_hidden.clone(), torch.cat([target_hidden[:, 1:], target_hidden[:, :1]], 1)]
    kw = dict(decay=0.8, target_hidden=target_hidden)
    plain = ttt_losses(logits, target_logp, column, valid, decay=0.8)["loss"]
    at_target = ttt_losses(
        logits, target_logp, column, valid, hidden=same, feature_weight=1.0, **kw
    )
    away = [x + 1.0 for x in same]
    off = ttt_losses(logits, target_logp, column, valid, hidden=away, feature_weight=1.0, **kw)
    assert torch.isclose(at_target["loss"], plain)
    assert off["loss"] > plain + 0.4


def test_trainer_with_frozen_lm_head_trains_the_rest(tmp_path):
    """Two steps of Eagle3Trainer on synthetic features of a tiny target: the LM head keeps
    the target's rows when frozen, every other parameter moves; the loss is finite."""
    from tiny_models import build_target

    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.features import Example
    from eagle_vllm.train.trainer import TrainConfig

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    examples = [
        Example(
            input_ids=torch.randint(4, 250, (30,), generator=gen),
            loss_mask=torch.ones(30, dtype=torch.bool),
            hidden=torch.randn(30, hidden, generator=gen),
            aux=torch.randn(30, 2 * hidden, generator=gen),
        )
        for _ in range(12)
    ]
    cfg = TrainConfig(max_steps=2, warmup_steps=1, tokens_per_batch=120, ce_vocab=64,
                      ttt_steps=2, ttt_freeze_lm_head=True, ttt_feature_weight=0.1,
                      eval_every=2, save_every=2, log_every=1, noise="none")  # fmt: skip
    trainer = Eagle3Trainer(target, examples, tmp_path / "out", cfg, (0, 1))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    last = trainer.fit(progress=False)
    after = trainer.model.state_dict()
    assert torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    assert torch.equal(after["lm_head.weight"], trainer.lm_head)  # the target's rows
    moved = [k for k in before if k != "lm_head.weight" and not torch.equal(before[k], after[k])]
    assert "fc.weight" in moved and "layers.0.self_attn.q_proj.weight" in moved
    assert torch.isfinite(torch.tensor(last["loss"])) and "val_acc_2" in last


def test_shared_lm_head_drafts_the_whole_vocabulary_and_exports_without_it(tmp_path):
    """--share-lm-head: warm-started from a reduced-vocabulary head (its layers kept, its
    rows dropped), the head scores every token through the target's LM head, which stays
    frozen; the export has no lm_head, d2t or t2d, loads as a full-vocabulary EAGLE-3 head
    with a frequency ranking for draft_vocab, and warm-starts a reduced-vocabulary run."""
    from safetensors.torch import load_file

    from eagle_vllm.config import parse_speculative_config
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint
    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.trainer import TrainConfig

    target, examples, cfg, reduced = _exported_head(tmp_path, "reduced")
    shared_cfg = TrainConfig(**{**cfg.__dict__, "ce_vocab": 0, "share_lm_head": True,
                                "init_from": str(tmp_path / "reduced")})  # fmt: skip
    shared = Eagle3Trainer(target, examples, tmp_path / "shared", shared_cfg, (0, 1))
    vocab = shared.target_lm_head.shape[0]
    assert torch.equal(shared.vocab_ids, torch.arange(vocab))
    assert torch.equal(shared.model.lm_head.weight, shared.target_lm_head)
    assert torch.equal(shared.model.fc.weight, reduced.model.fc.weight)  # layers warm-started
    before = {k: v.clone() for k, v in shared.model.state_dict().items()}
    shared.fit(progress=False)
    after = shared.model.state_dict()
    assert torch.equal(after["lm_head.weight"], shared.target_lm_head)  # frozen
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
    folder = shared.export("float32")

    weights = load_file(str(folder / "model.safetensors"))
    assert not {"lm_head.weight", "d2t", "t2d"} & weights.keys()
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == vocab
    info = inspect_draft_checkpoint(str(folder))
    assert info.head_type == "eagle3" and info.head_vocab_size == vocab
    assert not info.has_draft_vocab_map
    # the frequency ranking a config drafts the first N of (draft_vocab: N)
    ranked = json.loads((folder / "draft_vocab.json").read_text())["token_ids"]
    counts = torch.bincount(torch.cat([ex.input_ids for ex in shared.train]), minlength=vocab)
    assert len(ranked) == info.draft_vocab_size == min(vocab, 16384)
    assert counts[ranked].tolist() == sorted(counts.tolist(), reverse=True)[: len(ranked)]
    spec = parse_speculative_config(
        {"method": "eagle2", "model": str(folder), "draft_vocab": 8}, target=str(target)
    )
    assert spec.head_type == "eagle3" and spec.draft_vocab == 8

    again = TrainConfig(**{**cfg.__dict__, "init_from": str(folder)})
    back = Eagle3Trainer(target, examples, tmp_path / "back", again, (0, 1))
    assert len(back.vocab_ids) == 64
    torch.testing.assert_close(back.model.fc.weight, after["fc.weight"], atol=0, rtol=0)
    with pytest.raises(ValueError, match="--share-lm-head.*--ce-vocab 64.*Fix"):
        Eagle3Trainer(target, examples, tmp_path / "bad",
                      TrainConfig(**{**cfg.__dict__, "share_lm_head": True}), (0, 1))  # fmt: skip


def test_sampled_softmax_scores_the_batch_columns_and_validates_on_all(tmp_path):
    """--lm-head-sample: a training batch's loss is the full-vocabulary TTT loss restricted
    to its columns (the frequent tokens, the batch's own tokens, the target's argmaxes, so
    no loss row loses its label), with gradients to match; at a sample as large as the
    vocabulary it is the full loss; validation always scores the whole vocabulary."""
    from tiny_models import build_target

    from eagle_vllm.train.eagle3 import Eagle3Trainer, collate_eagle3
    from eagle_vllm.train.trainer import TrainConfig

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    examples = _synthetic_examples(hidden, count=8)
    for ex in examples:  # short conversations, so a batch's columns are a real subset
        ex.input_ids = ex.input_ids % 40 + 4
    base = dict(share_lm_head=True, ttt_steps=3, noise="none", val_fraction=0.25)

    def trainer(sample: int, name: str) -> Eagle3Trainer:
        cfg = TrainConfig(**base, lm_head_sample=sample)
        return Eagle3Trainer(target, examples, tmp_path / name, cfg, (0, 1))

    full, sampled = trainer(0, "full"), trainer(8, "sampled")
    vocab = len(full.vocab_ids)
    batch = [0, 1]
    ids, mask, aux, last = collate_eagle3(sampled.train, batch)
    argmax = torch.cat([sampled._target_argmax(sampled.train[i]) for i in batch])
    columns = sampled.sampled_columns(ids, argmax)
    assert len(sampled.frequent_ids) == 8
    assert set(columns.tolist()) == set(sampled.frequent_ids.tolist()) | set(
        ids.flatten().tolist()
    ) | set(argmax.tolist())
    assert len(columns) < vocab // 2

    rows = sampled._losses(batch, sampled.train, train=True)
    rows["loss"].backward()
    grads = {k: p.grad.clone() for k, p in sampled.model.named_parameters() if p.grad is not None}
    sampled.model.zero_grad()
    # the same loss with the full model's logits cut to these columns
    n = ids.shape[1]
    logp, in_vocab, column = target_distributions(
        last[:, 1:].reshape(-1, hidden), sampled.target_lm_head, columns
    )
    assert bool(in_vocab.view(len(batch), n - 1)[mask[:, 1:]].all())  # every label kept
    logits = sampled.model.unroll(lambda t: sampled.embed[t], ids, aux, 3)
    dense = ttt_losses(
        [x[:, : n - 1, columns] for x in logits], logp.view(len(batch), n - 1, -1),
        column.view(len(batch), n - 1), mask[:, 1:], decay=0.8,
    )  # fmt: skip
    dense["loss"].backward()
    for key in ("loss", "acc_1", "acc_3", "ce_2"):
        torch.testing.assert_close(rows[key], dense[key])
    for k, p in sampled.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[k], p.grad, atol=1e-5, rtol=1e-4)
    whole = full._losses(batch, full.train, train=True)["loss"]
    assert not torch.allclose(rows["loss"], whole)  # the sample is not the whole softmax

    everything = trainer(vocab, "everything")
    torch.testing.assert_close(
        everything._losses(batch, everything.train, train=True)["loss"], whole
    )
    assert sampled.evaluate() == pytest.approx(full.evaluate(), rel=1e-6)
    with pytest.raises(ValueError, match="--lm-head-sample 8.*Fix: add --share-lm-head"):
        Eagle3Trainer(target, examples, tmp_path / "bad",
                      TrainConfig(ce_vocab=64, lm_head_sample=8), (0, 1))  # fmt: skip


def test_validation_scores_steps_beyond_the_trained_ones(tmp_path):
    """Validation unrolls eval_ttt_steps (4) steps when training unrolls fewer: it reports
    accuracy at every step, and its loss is still over the trained steps only."""
    from tiny_models import build_target

    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.trainer import TrainConfig

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    examples = _synthetic_examples(hidden, count=40)
    scores = {}
    for eval_steps in (2, 4):
        cfg = TrainConfig(ce_vocab=64, ttt_steps=2, eval_ttt_steps=eval_steps, noise="none",
                          val_fraction=0.25)  # fmt: skip
        trainer = Eagle3Trainer(target, examples, tmp_path / f"out{eval_steps}", cfg, (0, 1))
        scores[eval_steps] = trainer.evaluate()
    assert "val_acc_3" not in scores[2] and "val_acc_4" in scores[4]
    for key in ("val_loss", "val_acc_1", "val_acc_2", "val_ce_2"):
        assert scores[4][key] == pytest.approx(scores[2][key], rel=1e-5), key


def test_trainer_row_losses_equal_the_dense_loss(tmp_path):
    """The trainer runs both LM heads and the softmaxes on the loss rows only; the loss,
    its gradient and the per-step accuracies equal the dense form (every position scored,
    prompt and padding rows masked afterwards) on a batch with prompts and padding."""
    from tiny_models import build_target

    from eagle_vllm.train.eagle3 import Eagle3Trainer, collate_eagle3
    from eagle_vllm.train.features import Example
    from eagle_vllm.train.trainer import TrainConfig

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n, prompt in ((30, 9), (17, 4), (24, 12)):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[prompt:] = True
        examples.append(Example(torch.randint(4, 250, (n,), generator=gen), mask,
                                torch.randn(n, hidden, generator=gen),
                                torch.randn(n, 2 * hidden, generator=gen)))  # fmt: skip
    cfg = TrainConfig(ce_vocab=64, ttt_steps=3, ttt_feature_weight=0.3, ttt_topk=4,
                      ttt_topk_weight=0.5, noise="none")  # fmt: skip
    trainer = Eagle3Trainer(target, examples, tmp_path / "out", cfg, (0, 1))
    trainer.model.lm_head.weight.data.normal_(0, 0.5)  # disagree with the target somewhere
    batch = [0, 1, 2]
    rows = trainer._losses(batch, examples, train=True)
    rows["loss"].backward()
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()

    ids, mask, aux, last = collate_eagle3(examples, batch)
    b, n = ids.shape
    logp, _, column = target_distributions(
        last[:, 1:].reshape(-1, last.shape[-1]), trainer.target_lm_head, trainer.vocab_ids
    )
    logits, outs = trainer.model.unroll(lambda t: trainer.embed[t], ids, aux, 3, with_hidden=True)
    dense = ttt_losses(
        [x[:, : n - 1] for x in logits], logp.view(b, n - 1, -1), column.view(b, n - 1),
        mask[:, 1:], decay=cfg.ttt_decay, topk=4, topk_weight=0.5,
        hidden=[h[:, : n - 1] for h in outs], target_hidden=last[:, 1:], feature_weight=0.3,
    )  # fmt: skip
    dense["loss"].backward()
    for key in ("loss", "acc_1", "acc_2", "acc_3", "ce_3"):
        torch.testing.assert_close(rows[key], dense[key])
    for k, p in trainer.model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, atol=1e-5, rtol=1e-4)


def _synthetic_examples(hidden: int, count: int = 12, seed: int = 0):
    from eagle_vllm.train.features import Example

    gen = torch.Generator().manual_seed(seed)
    return [
        Example(
            input_ids=torch.randint(4, 250, (30,), generator=gen),
            loss_mask=torch.ones(30, dtype=torch.bool),
            hidden=torch.randn(30, hidden, generator=gen),
            aux=torch.randn(30, 2 * hidden, generator=gen),
        )
        for _ in range(count)
    ]


def _exported_head(tmp_path, name: str):
    """A tiny target, synthetic features, a 2-step config over a 64-token draft vocabulary,
    and a head trained with it and exported into ``tmp_path / name``."""
    from tiny_models import build_target

    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.trainer import TrainConfig

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    examples = _synthetic_examples(hidden)
    cfg = TrainConfig(max_steps=2, warmup_steps=1, tokens_per_batch=120, ce_vocab=64,
                      ttt_steps=2, eval_every=2, save_every=2, log_every=1, noise="none")  # fmt: skip
    trainer = Eagle3Trainer(target, examples, tmp_path / name, cfg, (0, 1))
    trainer.fit(progress=False)
    trainer.export("float32")
    return target, examples, cfg, trainer


def test_warm_start_restores_the_exported_head(tmp_path):
    """--init-from loads an exported head's weights: the LM-head rows, stored in ascending
    target id with d2t, come back in the trainer's draft-vocabulary order, so the
    warm-started head scores every token as the exported one did."""
    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.trainer import TrainConfig

    target, examples, cfg, first = _exported_head(tmp_path, "first")
    assert not torch.equal(first.vocab_ids, first.vocab_ids.sort().values)  # rows reordered

    warm = TrainConfig(**{**cfg.__dict__, "init_from": str(tmp_path / "first"), "lr": 1e-4})
    second = Eagle3Trainer(target, examples, tmp_path / "second", warm, (0, 1))
    assert second.step == 0  # a new schedule, not a resume
    # the warm start keeps the head's draft vocabulary, held in ascending target id
    assert torch.equal(second.vocab_ids, first.vocab_ids.sort().values)
    for key, value in first.model.state_dict().items():
        if key == "lm_head.weight":  # the row of each target id is the same
            value = value[first.row_of[second.vocab_ids]]
        torch.testing.assert_close(second.model.state_dict()[key], value, atol=0, rtol=0)

    fresh = Eagle3Trainer(target, examples, tmp_path / "fresh", cfg, (0, 1))
    assert not torch.equal(fresh.model.fc.weight, first.model.fc.weight)


def test_warm_start_refuses_a_head_that_does_not_fit(tmp_path):
    from tiny_models import build_target

    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.trainer import TrainConfig

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    examples = _synthetic_examples(hidden)
    cfg = TrainConfig(max_steps=1, warmup_steps=1, tokens_per_batch=120, ce_vocab=64,
                      ttt_steps=2, noise="none")  # fmt: skip
    first = Eagle3Trainer(target, examples, tmp_path / "first", cfg, (0, 1))
    first.export("float32")

    other_vocab = TrainConfig(**{**cfg.__dict__, "ce_vocab": 32, "init_from": str(first.out)})
    with pytest.raises(ValueError, match="drafts 64 tokens.*Fix: pass --ce-vocab 64"):
        Eagle3Trainer(target, examples, tmp_path / "v", other_vocab, (0, 1))
    # three target layers fused instead of two: fc has another shape
    three = [e.__class__(e.input_ids, e.loss_mask, e.hidden, torch.cat([e.aux, e.hidden], -1))
             for e in examples]  # fmt: skip
    with pytest.raises(ValueError, match="fc.weight.*--aux-layers"):
        Eagle3Trainer(target, three, tmp_path / "l",
                      TrainConfig(**{**cfg.__dict__, "init_from": str(first.out)}), (0, 1, 1))  # fmt: skip
    with pytest.raises(ValueError, match="--init-from: no"):
        Eagle3Trainer(target, examples, tmp_path / "m",
                      TrainConfig(**{**cfg.__dict__, "init_from": str(tmp_path / "none")}), (0, 1))  # fmt: skip


def test_warm_start_keeps_the_draft_vocabulary_over_other_data(tmp_path):
    """Training on from a head over more or other data keeps that head's draft vocabulary
    (the new data's most frequent tokens differ) and starts from its exact scores."""
    from tiny_models import build_target

    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.trainer import TrainConfig, frequent_tokens

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    old_data = _synthetic_examples(hidden)
    # new data: other tokens, most of them outside the first head's vocabulary
    new_data = [e.__class__((e.input_ids + 97) % 250 + 4, e.loss_mask, e.hidden, e.aux)
                for e in _synthetic_examples(hidden, seed=1)]  # fmt: skip
    cfg = TrainConfig(max_steps=2, warmup_steps=1, tokens_per_batch=120, ce_vocab=64,
                      ttt_steps=2, noise="none")  # fmt: skip
    first = Eagle3Trainer(target, old_data, tmp_path / "first", cfg, (0, 1))
    first.fit(progress=False)
    first.export("float32")
    merged = old_data + new_data
    assert set(frequent_tokens(merged, 256, 64).tolist()) != set(first.vocab_ids.tolist())

    warm = TrainConfig(**{**cfg.__dict__, "init_from": str(first.out), "val_split": "prompt"})
    second = Eagle3Trainer(target, merged, tmp_path / "second", warm, (0, 1))
    assert set(second.vocab_ids.tolist()) == set(first.vocab_ids.tolist())
    ids, _, aux, _ = collate_eagle3(first.val, list(range(len(first.val))))
    embeds = lambda t: first.embed[t]  # noqa: E731
    with torch.no_grad():
        before = first.model.unroll(embeds, ids, aux, 2)
        after = second.model.unroll(embeds, ids, aux, 2)
    for a, b in zip(before, after):  # the same scores, columns in each trainer's order
        torch.testing.assert_close(b, a[..., first.row_of[second.vocab_ids]], atol=1e-5, rtol=0)


def _with_prompt(prompt: list[int], answer_len: int = 6):
    from eagle_vllm.train.features import Example

    n = len(prompt) + answer_len
    mask = torch.zeros(n, dtype=torch.bool)
    mask[len(prompt) :] = True
    ids = torch.tensor(prompt + [7] * answer_len)
    return Example(ids, mask, torch.zeros(n, 4))


def test_prompt_validation_split_is_stable_as_data_grows():
    """val_split=prompt: a conversation validates or trains by its first prompt alone, so
    adding a data source never moves one across, and a conversation two sources share
    (the same prompt, another answer) lands on one side; about the asked fraction
    validates. random: the seeded shuffle's first fraction, as before."""
    from eagle_vllm.train.trainer import validation_split

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 250, (8,), generator=gen).tolist() for _ in range(3000)]
    first = [_with_prompt(p) for p in prompts[:2000]]
    val, train = validation_split(first, 0.1, 0, "prompt")
    assert sorted(val + train) == list(range(2000))
    assert 150 < len(val) < 250, len(val)
    # another source: the same 1000 prompts answered anew, and 1000 new prompts
    second = [_with_prompt(p, answer_len=9) for p in prompts[1000:]]
    val2, _ = validation_split(first + second, 0.1, 5, "prompt")
    in_val = set(val2)
    assert {i for i in range(2000) if i in in_val} == set(val)
    for j in range(1000):  # the shared prompts: the same side in both sources
        assert (2000 + j in in_val) == (1000 + j in in_val)

    val_r, train_r = validation_split(first, 0.1, 0, "random")
    order = list(range(2000))
    import random

    random.Random(0).shuffle(order)
    assert (val_r, train_r) == (order[:200], order[200:])
    with pytest.raises(ValueError, match="val_split 'hash' is unknown"):
        validation_split(first, 0.1, 0, "hash")


def test_feature_cache_loads_memory_mapped(tmp_path):
    """A feature cache loads mapped (the default) with the same examples as read into
    memory; another run's cache is refused for another target or other layers."""
    from eagle_vllm.train.features import check_extra_cache, load_features

    gen = torch.Generator().manual_seed(0)
    payload = {
        "input_ids": [torch.randint(0, 99, (n,), generator=gen, dtype=torch.int32)
                      for n in (5, 9)],
        "loss_mask": [torch.rand(n, generator=gen) > 0.5 for n in (5, 9)],
        "hidden": [torch.randn(n, 8, generator=gen).bfloat16() for n in (5, 9)],
        "aux": [torch.randn(n, 16, generator=gen).bfloat16() for n in (5, 9)],
    }  # fmt: skip
    torch.save(payload, tmp_path / "shard-00000.pt")
    meta = {"fingerprint": "x", "target": "/models/tiny-target", "dtype": "bfloat16",
            "num_examples": 2, "num_tokens": 14, "num_shards": 1, "hidden_size": 8,
            "layers": [0, 1]}  # fmt: skip
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    mapped, read = load_features(tmp_path), load_features(tmp_path, mmap=False)
    for a, b in zip(mapped, read):
        for key in ("input_ids", "loss_mask", "hidden", "aux"):
            assert torch.equal(getattr(a, key), getattr(b, key))
    assert check_extra_cache(tmp_path, "/elsewhere/tiny-target", (0, 1)) == tmp_path
    with pytest.raises(ValueError, match="target '/models/tiny-target'.*Fix"):
        check_extra_cache(tmp_path, "/elsewhere/other", (0, 1))
    with pytest.raises(ValueError, match=r"layers \(0, 1\).*--aux-layers"):
        check_extra_cache(tmp_path, "/elsewhere/tiny-target", (0, 2))
    (tmp_path / "shard-00000.pt").unlink()
    with pytest.raises(ValueError, match="missing.*Fix: finish"):
        check_extra_cache(tmp_path, "/elsewhere/tiny-target", (0, 1))


def test_an_eagle1_run_reads_an_eagle3_feature_cache(tmp_path):
    """An EAGLE-3 cache holds the last hidden state too: an EAGLE-1 run over the same data
    uses it as it is (no target forward), and takes any finished cache as an extra one."""
    from eagle_vllm.train.features import (
        _fingerprint,
        check_extra_cache,
        extract_features,
        load_features,
    )
    from eagle_vllm.train.tokenize import TokenizedConversation

    gen = torch.Generator().manual_seed(1)
    convs = [TokenizedConversation(torch.randint(0, 99, (n,), generator=gen),
                                   torch.rand(n, generator=gen) > 0.5) for n in (5, 9)]  # fmt: skip
    payload = {
        "input_ids": [c.input_ids.to(torch.int32) for c in convs],
        "loss_mask": [c.loss_mask for c in convs],
        "hidden": [torch.randn(len(c.input_ids), 8, generator=gen).bfloat16() for c in convs],
        "aux": [torch.randn(len(c.input_ids), 16, generator=gen).bfloat16() for c in convs],
    }
    torch.save(payload, tmp_path / "shard-00000.pt")
    target = tmp_path / "no-such-target"  # loading it would fail: nothing may be computed
    meta = {"fingerprint": _fingerprint(target, convs, "bfloat16", (0, 1)),
            "target": str(target), "dtype": "bfloat16", "num_examples": 2, "num_tokens": 14,
            "num_shards": 1, "hidden_size": 8, "layers": [0, 1]}  # fmt: skip
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert extract_features(target, convs, tmp_path, progress=False) == tmp_path
    assert json.loads((tmp_path / "meta.json").read_text())["layers"] == [0, 1]
    for ex, hidden in zip(load_features(tmp_path), payload["hidden"]):
        assert torch.equal(ex.hidden, hidden)
    assert check_extra_cache(tmp_path, target, None) == tmp_path
    other = [TokenizedConversation(c.input_ids.flip(0), c.loss_mask) for c in convs]
    with pytest.raises(ValueError, match="other data.*Fix"):
        extract_features(target, other, tmp_path, progress=False)
    # features a bf16 forward computed are not mixed with fp32 ones
    with pytest.raises(ValueError, match="compute dtype.*Fix"):
        extract_features(target, convs, tmp_path, compute_dtype="bfloat16", progress=False)


def test_warm_start_of_an_eagle1_head(tmp_path):
    """The EAGLE-1 trainer takes --init-from too (its export is its module's state dict)."""
    from tiny_models import build_target

    from eagle_vllm.train.features import Example
    from eagle_vllm.train.trainer import TrainConfig, Trainer

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    examples = [Example(e.input_ids, e.loss_mask, e.hidden) for e in _synthetic_examples(hidden)]
    cfg = TrainConfig(max_steps=2, warmup_steps=1, tokens_per_batch=120, eval_every=2,
                      save_every=2, log_every=1)  # fmt: skip
    first = Trainer(target, examples, tmp_path / "first", cfg)
    first.fit(progress=False)
    first.export("float32")
    second = Trainer(target, examples, tmp_path / "second",
                     TrainConfig(**{**cfg.__dict__, "init_from": str(first.out)}))  # fmt: skip
    for key, value in first.model.state_dict().items():
        torch.testing.assert_close(second.model.state_dict()[key], value, atol=0, rtol=0)


def test_eagle1_warm_start_can_keep_the_draft_vocabulary_over_other_data(tmp_path):
    """--keep-init-vocab: an EAGLE-1 run over other data keeps the warm start's ranked
    draft vocabulary (the served draft_vocab: N is its first N), exports it unchanged, and
    refuses a ranking of another length; without it the new data's ranking is taken."""
    from tiny_models import build_target

    from eagle_vllm.models.checkpoint import DRAFT_VOCAB_FILE
    from eagle_vllm.train.features import Example
    from eagle_vllm.train.trainer import TrainConfig, Trainer

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    old_data = [Example(e.input_ids, e.loss_mask, e.hidden) for e in _synthetic_examples(hidden)]
    new_data = [Example((e.input_ids + 97) % 250 + 4, e.loss_mask, e.hidden)
                for e in _synthetic_examples(hidden, seed=1)]  # fmt: skip
    cfg = TrainConfig(max_steps=1, warmup_steps=1, tokens_per_batch=120, ce_vocab=64)
    first = Trainer(target, old_data, tmp_path / "first", cfg)
    first.export("float32")
    ranked = json.loads((first.out / DRAFT_VOCAB_FILE).read_text())["token_ids"]

    warm = {**cfg.__dict__, "init_from": str(first.out)}
    moved = Trainer(target, new_data, tmp_path / "moved", TrainConfig(**warm))
    assert moved.vocab_ids.tolist() != ranked  # the new data ranks other tokens first
    kept = Trainer(target, new_data, tmp_path / "kept",
                   TrainConfig(**{**warm, "keep_init_vocab": True}))  # fmt: skip
    assert kept.vocab_ids.tolist() == ranked
    kept.export("float32")
    assert json.loads((kept.out / DRAFT_VOCAB_FILE).read_text())["token_ids"] == ranked
    for key, value in first.model.state_dict().items():  # the warm start itself
        torch.testing.assert_close(kept.model.state_dict()[key], value, atol=0, rtol=0)
    with pytest.raises(ValueError, match="ranks 64 tokens.*Fix: pass --ce-vocab 64"):
        Trainer(target, new_data, tmp_path / "v",
                TrainConfig(**{**warm, "keep_init_vocab": True, "ce_vocab": 32}))  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--val-split", "hash"], "--val-split 'hash' is unknown.*Fix: one of auto"),
        (["--regen-parts-only"], "--regen-parts-only reads.*Fix: add those two flags"),
        (["--extra-features", "nowhere"], "--extra-features 'nowhere': no meta.json.*Fix"),
        (["--share-lm-head", "--arch", "eagle3", "--ce-vocab", "64"], "--share-lm-head.*Fix"),
        (["--share-lm-head"], "--share-lm-head.*--arch eagle1.*Fix"),
        (["--lm-head-sample", "8192"], "--lm-head-sample 8192.*Fix: add --share-lm-head"),
        (["--keep-init-vocab"], "--keep-init-vocab.*Fix: add --init-from"),
        (["--keep-init-vocab", "--init-from", "h", "--arch", "eagle3"], "--keep-init-vocab.*Fix"),
    ],
)
def test_train_cli_refuses_bad_flags_before_any_work(tmp_path, flags, message):
    from eagle_vllm.train.main import main as train_main

    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        train_main(["--target", str(tmp_path / "t"), "--out", str(out), *flags])
    assert not out.exists()  # refused before anything was written


def test_compute_dtype_auto_is_bf16_only_where_the_cpu_multiplies_it(monkeypatch):
    from eagle_vllm import config
    from eagle_vllm.train.main import _compute_dtype

    monkeypatch.setattr(config, "cpu_has_bf16_gemm", lambda: True)
    assert _compute_dtype("auto") == "bfloat16"
    monkeypatch.setattr(config, "cpu_has_bf16_gemm", lambda: False)
    assert _compute_dtype("auto") == "float32"
    assert _compute_dtype("bfloat16") == "bfloat16" and _compute_dtype("float32") == "float32"


def test_eagle1_agreement_on_greedy_answers_is_the_validation_accuracy(tmp_path):
    """benchmarks/head_agreement.py scores an EAGLE-1 head at depth 1 against the answer's
    next token. On greedy answers (each token the target's argmax after the one before)
    that is the trainer's validation accuracy; with a draft vocabulary, tokens outside it
    count as misses and their share is reported."""
    import sys

    from tiny_models import build_target

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from head_agreement import score_eagle1_head

    from eagle_vllm.train.features import Example
    from eagle_vllm.train.trainer import TrainConfig, Trainer, load_target_embeddings

    target = build_target(tmp_path / "t", layers=2)
    _, _, lm_head = load_target_embeddings(target)
    hidden = lm_head.shape[1]
    gen = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(6):
        feats = torch.randn(24, hidden, generator=gen)
        ids = torch.cat(
            [torch.randint(4, 250, (1,), generator=gen), (feats @ lm_head.T).argmax(-1)[:-1]]
        )
        # answer positions, the last one without a next token to predict
        mask = (torch.arange(24) >= 5) & (torch.arange(24) < 23)
        examples.append(Example(ids, mask, feats))
    cfg = TrainConfig(max_steps=3, warmup_steps=1, tokens_per_batch=120, eval_every=3,
                      save_every=3, log_every=1, ce_vocab=0, noise="none")  # fmt: skip
    trained = Trainer(target, examples, tmp_path / "head", cfg)
    trained.fit(progress=False)
    trained.export("float32")
    vocab = torch.randperm(lm_head.shape[0], generator=gen)
    (trained.out / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab.tolist()}))

    full = score_eagle1_head(str(target), trained.out, examples, tmp_path / "s", draft_vocab=0)
    judge = Trainer(target, examples, tmp_path / "judge",
                    TrainConfig(**{**cfg.__dict__, "init_from": str(trained.out),
                                   "tokens_per_batch": 10_000}))  # fmt: skip
    judge.val = examples
    assert full["in_vocab"] == 1.0
    assert full["val_acc_1"] == pytest.approx(judge.evaluate()["val_acc"], abs=1e-6)

    keep = 40
    part = score_eagle1_head(str(target), trained.out, examples, tmp_path / "s", draft_vocab=keep)
    wanted = torch.cat([ex.input_ids[2:][ex.loss_mask[1:-1]] for ex in examples])
    assert part["in_vocab"] == pytest.approx(float(torch.isin(wanted, vocab[:keep]).float().mean()))
    assert part["val_acc_1"] <= part["recall_top3"] <= part["in_vocab"]
    assert full["val_acc_1"] < full["recall_top3"]


def test_features_can_be_computed_in_bf16(tmp_path):
    """--feature-compute-dtype bfloat16: the target's forward in bf16 gives the fp32 forward's
    features to bf16 rounding, and its cache says how it was computed."""
    from tiny_models import build_target

    from eagle_vllm.train.features import extract_features, load_features
    from eagle_vllm.train.tokenize import TokenizedConversation

    target = build_target(tmp_path / "t", layers=2)
    gen = torch.Generator().manual_seed(2)
    convs = [TokenizedConversation(torch.randint(0, 99, (n,), generator=gen),
                                   torch.ones(n, dtype=torch.bool)) for n in (7, 12)]  # fmt: skip
    fp32 = load_features(extract_features(target, convs, tmp_path / "fp32", progress=False))
    bf16 = load_features(
        extract_features(
            target, convs, tmp_path / "bf16", compute_dtype="bfloat16", progress=False
        )  # fmt: skip
    )
    for a, b in zip(fp32, bf16):
        assert not torch.equal(a.hidden, b.hidden)  # computed, not copied
        error = (b.hidden.float() - a.hidden.float()).norm() / a.hidden.float().norm()
        assert error < 0.06, error  # a few percent: bf16 rounding through the layers
    meta = json.loads((tmp_path / "bf16" / "meta.json").read_text())
    assert meta["compute_dtype"] == "bfloat16"
