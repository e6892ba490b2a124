"""The EAGLE-1 head's training-time test: the unrolled steps are the tree drafter's deeper
nodes, and the trainer trains and validates over them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_train_eagle3 import CONFIG, node_attention

from eagle_vllm.train.head import EagleHead

torch.set_num_threads(1)


def _head(seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(CONFIG)
    for p in head.parameters():  # larger than the init, so every path matters
        p.data.normal_(0, 0.3)
    return head


def _draft_node(head, embeds, feature, position, prefix_kv, ancestors_kv):
    """One EAGLE-1 draft node as the plugin drafts it: fc([embed ; feature]) attends to
    the prefix's draft KV (first pass, positions before the root's) and to its ancestors'
    KV and its own; returns (f̂, (k, v))."""
    layer = head.layers[0]
    x = head.fc(torch.cat([embeds, feature], -1))[None, None]
    out, kv = node_attention(layer.self_attn, x, position, prefix_kv, ancestors_kv)
    h = x + out
    return (h + layer.mlp(layer.post_attention_layernorm(h)))[0, 0], kv


@pytest.mark.parametrize("steps", [1, 3])
def test_unroll_equals_drafting_node_by_node(steps):
    """Step s of the unroll at row i is the draft node at depth s+1 under root i: the true
    token s further on, the previous step's f̂, position i+s, attention over the prefix's
    draft KV up to i and then its ancestors. Step 0 is the plain forward."""
    head = _head()
    n = 9
    torch.manual_seed(1)
    embed = torch.randn(CONFIG["vocab_size"], 32)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, n))
    features = torch.randn(1, n, 32)
    empty = torch.zeros(1, 4, 0, 8)
    with torch.no_grad():
        got = head.unroll(lambda t: embed[t], tokens, features, steps)
        torch.testing.assert_close(
            got[0], head(embed[tokens], features, torch.arange(n)[None]), atol=0, rtol=0
        )
        padded = F.pad(tokens[0], (0, steps))
        prefix_k, prefix_v = [], []
        for j in range(n):  # the first pass: every position's step-0 K/V
            _, (k, v) = _draft_node(head, embed[padded[j]], features[0, j], j, (empty, empty), [])
            prefix_k.append(k)
            prefix_v.append(v)
        for i in range(n):
            prefix = (torch.cat([empty, *prefix_k[:i]], 2), torch.cat([empty, *prefix_v[:i]], 2))
            feature, ancestors = features[0, i], []
            for s in range(steps):
                feature, kv = _draft_node(
                    head, embed[padded[i + s]], feature, i + s, prefix, ancestors
                )
                ancestors.append(kv)
                torch.testing.assert_close(got[s][0, i], feature, atol=1e-4, rtol=1e-4)


def _trainer(tmp_path, **overrides):
    from test_train_eagle3 import _synthetic_examples
    from tiny_models import build_target

    from eagle_vllm.train.features import Example
    from eagle_vllm.train.trainer import TrainConfig, Trainer

    target = build_target(tmp_path / "t", layers=2)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    examples = [Example(e.input_ids, e.loss_mask, e.hidden) for e in _synthetic_examples(hidden)]
    cfg = TrainConfig(**{"max_steps": 2, "warmup_steps": 1, "tokens_per_batch": 120,
                         "eval_every": 2, "save_every": 2, "log_every": 1, "noise": "none",
                         "val_fraction": 0.25, **overrides})  # fmt: skip
    return Trainer(target, examples, tmp_path / "out", cfg)


def test_eagle1_defaults_to_one_step_and_validates_four(tmp_path):
    """``ttt_steps`` 0 is the head's default: plain EAGLE-1 training (one step) here, five
    for EAGLE-3; validation still scores the deeper drafts (``eval_ttt_steps``) while its
    loss stays the trained steps'."""
    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.trainer import Trainer

    assert Trainer.default_ttt_steps == 1 and Eagle3Trainer.default_ttt_steps == 5
    trainer = _trainer(tmp_path)
    assert trainer.cfg.ttt_steps == 1
    batch = list(range(len(trainer.train)))
    train_parts = trainer._losses(batch, trainer.train, train=True)
    assert "acc_2" not in train_parts
    val_parts = trainer._losses(batch, trainer.train, train=False)
    assert {"acc_1", "acc_2", "acc_3", "acc_4"} <= val_parts.keys()
    torch.testing.assert_close(val_parts["loss"], train_parts["loss"])
    assert val_parts["acc_1"] == train_parts["acc"]


def test_unrolled_loss_weights_each_step_by_the_decay(tmp_path):
    """With ``ttt_steps`` k the loss is the decay-weighted mean of the k steps' EAGLE-1
    losses, each step scoring row j from its output at row j - s."""
    from eagle_vllm.train.trainer import collate, eagle_loss

    trainer = _trainer(tmp_path, ttt_steps=3, ttt_decay=0.5)
    batch = list(range(len(trainer.train)))
    got = trainer._losses(batch, trainer.train, train=True)
    ids, mask, feats = collate(trainer.train, batch)
    with torch.no_grad():
        outputs = trainer.model.unroll(lambda t: trainer.embed[t], ids[:, 1:], feats[:, :-1], 3)
    next_rows = trainer.row_of[F.pad(ids[:, 2:], (0, 1))]
    next_rows[:, -1] = -1
    b, j = mask[:, 1:].nonzero(as_tuple=True)
    losses = []
    for s, f_hat in enumerate(outputs):
        keep = j >= s
        part = eagle_loss(f_hat[b[keep], j[keep] - s], feats[:, 1:][b[keep], j[keep]],
                          next_rows[b[keep], j[keep]], trainer.lm_head,
                          ce_weight=trainer.cfg.ce_weight, ce_labels=trainer.cfg.ce_labels)  # fmt: skip
        losses.append(part["loss"])
        torch.testing.assert_close(got[f"acc_{s + 1}"], part["acc"])
    want = (losses[0] + 0.5 * losses[1] + 0.25 * losses[2]) / 1.75
    torch.testing.assert_close(got["loss"].detach(), want)


def test_eagle1_training_time_test_trains_and_logs_each_step(tmp_path):
    """A run with ttt_steps 3 trains (the loss falls over a few steps on fixed data), logs
    validation agreement per unrolled step, records its steps in the export and plots
    them."""
    from eagle_vllm.train.trainer import plot_curves

    trainer = _trainer(tmp_path, ttt_steps=3, max_steps=12, eval_every=12, lr=3e-3)
    batch = list(range(len(trainer.train)))
    with torch.no_grad():
        before = float(trainer._losses(batch, trainer.train, train=False)["loss"])
    last = trainer.fit(progress=False)
    with torch.no_grad():
        after = float(trainer._losses(batch, trainer.train, train=False)["loss"])
    assert after < before
    assert {"val_acc_1", "val_acc_2", "val_acc_3", "val_acc_4"} <= last.keys()
    out = trainer.export("float32")
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_vllm"]["train_config"]["ttt_steps"] == 3
    plot_curves(trainer.log_path, out / "training_curves.png")
    assert (out / "training_curves.png").stat().st_size > 0


def test_negative_ttt_steps_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--ttt-steps -1.*Fix"):
        _trainer(tmp_path, ttt_steps=-1)
