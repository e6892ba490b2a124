"""``inspect_draft_checkpoint`` on SafeAILab-layout drafts built by ``tests/tiny_models``.

The function is ``lru_cache``d by path, so every case writes its own folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import HIDDEN, SPECIALS, VOCAB_WORDS, build_draft, build_target

from eagle_vllm.models.checkpoint import (
    DraftCheckpointError,
    DraftInfo,
    inspect_draft_checkpoint,
)

torch.set_num_threads(1)

VOCAB = VOCAB_WORDS + len(SPECIALS)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("ckpt_target") / "target", layers=1)


def inspect(path: Path) -> DraftInfo:
    return inspect_draft_checkpoint(str(path))


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    return torch.load(path / "pytorch_model.bin", weights_only=True)


def rewrite(path: Path, weights: dict[str, torch.Tensor] | None = None, **cfg_changes) -> None:
    """Replace the weights (same format as before) and/or edit config.json."""
    if weights is not None:
        weights = {k: v.contiguous() for k, v in weights.items()}
        if (path / "model.safetensors").is_file():
            save_file(weights, str(path / "model.safetensors"))
        else:
            torch.save(weights, path / "pytorch_model.bin")
    if cfg_changes:
        cfg = json.loads((path / "config.json").read_text())
        for k, v in cfg_changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (path / "config.json").write_text(json.dumps(cfg))


def check_error(path: Path, *fragments: str) -> str:
    with pytest.raises(DraftCheckpointError) as exc:
        inspect(path)
    msg = str(exc.value)
    assert "Fix:" in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


# --------------------------------------------------------------------------
# valid checkpoints
# --------------------------------------------------------------------------
@pytest.mark.parametrize("bin_format", [False, True], ids=["safetensors", "bin"])
@pytest.mark.parametrize("fc_bias", [None, 0.1], ids=["nobias", "bias"])
@pytest.mark.parametrize("with_embed", [False, True], ids=["noembed", "embed"])
def test_variants(tmp_path, target, bin_format, fc_bias, with_embed):
    draft = build_draft(
        tmp_path / "draft",
        target,
        kind="oracle",
        fc_bias=fc_bias,
        with_embed=with_embed,
        bin_format=bin_format,
    )
    info = inspect(draft)
    weights_name = "pytorch_model.bin" if bin_format else "model.safetensors"
    assert info == DraftInfo(
        path=str(draft),
        weights_file=str(draft / weights_name),
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_layers=1,
        fc_bias=fc_bias is not None,
        has_embed_tokens=with_embed,
        has_draft_vocab_map=False,
    )


@pytest.mark.parametrize("bin_format", [False, True], ids=["safetensors", "bin"])
def test_model_prefixed_keys(tmp_path, target, bin_format):
    draft = build_draft(
        tmp_path / "draft", target, fc_bias=0.1, with_embed=True, bin_format=bin_format
    )
    plain = inspect(draft)
    prefixed = tmp_path / "prefixed"
    shutil.copytree(draft, prefixed)
    rewrite(prefixed, {f"model.{k}": v for k, v in load_weights(draft).items()})
    assert "model.fc.weight" in load_weights(prefixed)
    info = inspect(prefixed)
    assert info.fc_bias and info.has_embed_tokens
    assert (info.hidden_size, info.vocab_size, info.num_layers) == (
        plain.hidden_size,
        plain.vocab_size,
        plain.num_layers,
    )


def test_bias_false_in_config_but_fc_bias_in_weights(tmp_path, target):
    """The weights decide: SafeAILab's ``bias`` key is about fc only."""
    draft = build_draft(tmp_path / "draft", target, fc_bias=0.1)
    rewrite(draft, bias=False)
    assert inspect(draft).fc_bias


def test_no_bias_key_in_config(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    rewrite(draft, bias=None)
    assert not inspect(draft).fc_bias


def test_safetensors_preferred_over_bin(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    torch.save({"garbage": torch.zeros(1)}, draft / "pytorch_model.bin")
    assert inspect(draft).weights_file == str(draft / "model.safetensors")


def test_draft_vocab_map(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    w = load_weights(draft)
    w["d2t"] = torch.zeros(VOCAB, dtype=torch.long)
    rewrite(draft, w)
    assert inspect(draft).has_draft_vocab_map


def test_num_layers_from_weights_when_config_lacks_it(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    rewrite(draft, num_hidden_layers=None)
    assert inspect(draft).num_layers == 1


def test_cached_by_path(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    assert inspect(draft) is inspect(draft)


# --------------------------------------------------------------------------
# broken checkpoints
# --------------------------------------------------------------------------
@pytest.mark.parametrize("bin_format", [False, True], ids=["safetensors", "bin"])
def test_no_weights(tmp_path, target, bin_format):
    draft = build_draft(tmp_path / "draft", target, bin_format=bin_format)
    (draft / ("pytorch_model.bin" if bin_format else "model.safetensors")).unlink()
    check_error(draft, "has no weights", "model.safetensors", "pytorch_model.bin")


def test_missing_config(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    (draft / "config.json").unlink()
    check_error(draft, "config.json")


def test_invalid_config_json(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    (draft / "config.json").write_text("{not json")
    check_error(draft, "config.json")


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size"])
def test_config_lacks_sizes(tmp_path, target, key):
    draft = build_draft(tmp_path / "draft", target)
    rewrite(draft, **{key: None})
    check_error(draft, "hidden_size/vocab_size")


def test_no_fc_weight(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    w = load_weights(draft)
    del w["fc.weight"]
    rewrite(draft, w)
    check_error(draft, "no fc.weight")


@pytest.mark.parametrize(
    "shape", [(HIDDEN, HIDDEN), (2 * HIDDEN, HIDDEN), (HIDDEN, 3 * HIDDEN), (128, 256)]
)
@pytest.mark.parametrize("bin_format", [False, True], ids=["safetensors", "bin"])
def test_wrong_fc_shape(tmp_path, target, shape, bin_format):
    draft = build_draft(tmp_path / "draft", target, bin_format=bin_format)
    w = load_weights(draft)
    w["fc.weight"] = torch.zeros(shape)
    rewrite(draft, w)
    check_error(draft, f"shape {list(shape)}", f"[{HIDDEN}, {2 * HIDDEN}]")


def test_config_hidden_size_disagrees_with_weights(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    rewrite(draft, hidden_size=128)
    check_error(draft, "fc.weight", "[128, 256]")


@pytest.mark.parametrize("bin_format", [False, True], ids=["safetensors", "bin"])
def test_bias_true_without_fc_bias(tmp_path, target, bin_format):
    draft = build_draft(tmp_path / "draft", target, bin_format=bin_format)
    rewrite(draft, bias=True)
    check_error(draft, '"bias": true', "fc.bias")


@pytest.mark.parametrize("shape", [(VOCAB + 1, HIDDEN), (VOCAB, HIDDEN // 2), (HIDDEN, VOCAB)])
def test_embed_shape_mismatch(tmp_path, target, shape):
    draft = build_draft(tmp_path / "draft", target, with_embed=True)
    w = load_weights(draft)
    w["embed_tokens.weight"] = torch.zeros(shape)
    rewrite(draft, w)
    check_error(draft, "embed_tokens.weight", f"{list(shape)}", f"[{VOCAB}, {HIDDEN}]")


def test_embed_mismatch_from_config_vocab(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target, with_embed=True)
    rewrite(draft, vocab_size=VOCAB + 10)
    check_error(draft, "embed_tokens.weight", f"[{VOCAB + 10}, {HIDDEN}]")


def test_layers_disagree_with_config(tmp_path, target):
    draft = build_draft(tmp_path / "draft", target)
    rewrite(draft, num_hidden_layers=2)
    check_error(draft, "layers [0]", "num_hidden_layers=2")


def test_errors_are_not_cached(tmp_path, target):
    """A fixed checkpoint is re-read, not answered from the cache."""
    draft = build_draft(tmp_path / "draft", target)
    rewrite(draft, bias=True)
    check_error(draft, "fc.bias")
    rewrite(draft, bias=False)
    assert not inspect(draft).fc_bias


# --------------------------------------------------------------------------
# EAGLE-3 heads (speculators format and SafeAILab's midlayer layout)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["speculators", "safeailab"])
@pytest.mark.parametrize("draft_vocab", [None, 100], ids=["fullvocab", "d2t"])
def test_eagle3_layouts(tmp_path, target, layout, draft_vocab):
    from tiny_models import build_eagle3_draft

    draft = build_eagle3_draft(
        tmp_path / "e3", target, layout=layout, draft_vocab=draft_vocab, aux_layers=(0, 0, 0)
    )
    info = inspect(draft)
    assert info.head_type == "eagle3" and info.num_layers == 1 and not info.fc_bias
    assert info.aux_layer_ids == (0, 0, 0) and info.num_aux_layers == 3
    assert info.head_vocab_size == (draft_vocab or VOCAB)
    assert info.has_draft_vocab_map == (draft_vocab is not None)
    assert info.speculators_format == (layout == "speculators")
    assert (info.hidden_size, info.vocab_size) == (HIDDEN, VOCAB)


def test_eagle3_default_layers_when_config_names_none(tmp_path, target):
    from tiny_models import build_eagle3_draft

    draft = build_eagle3_draft(tmp_path / "e3", target, aux_layers=(0, 0, 0))
    rewrite(draft, eagle_aux_hidden_state_layer_ids=None)
    info = inspect(draft)
    assert info.aux_layer_ids is None and info.num_aux_layers == 3


def _eagle3(tmp_path, target, **kw):
    from tiny_models import build_eagle3_draft

    return build_eagle3_draft(tmp_path / "e3", target, aux_layers=(0, 0, 0), **kw)


def test_eagle3_fc_width_must_match_layer_count(tmp_path, target):
    draft = _eagle3(tmp_path, target)
    rewrite(draft, eagle_aux_hidden_state_layer_ids=[0, 0])
    check_error(draft, "fc.weight", f"[{HIDDEN}, {2 * HIDDEN}]", "eagle_aux_hidden_state_layer_ids")


@pytest.mark.parametrize("ids", [[], "2", [1, -1]])
def test_eagle3_bad_layer_ids(tmp_path, target, ids):
    draft = _eagle3(tmp_path, target)
    rewrite(draft, eagle_aux_hidden_state_layer_ids=ids)
    if ids == []:  # empty: the target's default layers, as in vLLM
        assert inspect(draft).aux_layer_ids is None
    else:
        check_error(draft, "eagle_aux_hidden_state_layer_ids")


def test_eagle3_reduced_vocab_needs_d2t(tmp_path, target):
    draft = _eagle3(tmp_path, target, draft_vocab=100)
    w = load_weights(draft)
    del w["d2t"]
    rewrite(draft, w)
    check_error(draft, "d2t", "[100]")


def test_eagle3_draft_vocab_size_must_match_lm_head(tmp_path, target):
    draft = _eagle3(tmp_path, target, draft_vocab=100)
    rewrite(draft, draft_vocab_size=120)
    check_error(draft, "draft_vocab_size 120", "100 rows")


def test_eagle3_with_fc_bias_is_refused(tmp_path, target):
    draft = _eagle3(tmp_path, target)
    w = load_weights(draft)
    w["fc.bias"] = torch.zeros(HIDDEN)
    rewrite(draft, w)
    check_error(draft, "fc.bias")


def test_speculators_config_over_eagle1_weights_is_refused(tmp_path, target):
    """A folder that mixes the types: an EAGLE-3 (speculators) config, EAGLE-1 weights."""
    e3 = _eagle3(tmp_path, target)
    draft = build_draft(tmp_path / "e1", target)
    shutil.copy(e3 / "config.json", draft / "config.json")
    check_error(draft, "speculators eagle3 config but EAGLE-1 weights")


def test_other_speculators_types_are_refused(tmp_path, target):
    draft = _eagle3(tmp_path, target)
    rewrite(draft, speculators_model_type="mlp")
    check_error(draft, "speculators 'mlp'", "EAGLE-1 and EAGLE-3")


def test_eagle3_two_layers_refused(tmp_path, target):
    draft = _eagle3(tmp_path, target)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["transformer_layer_config"]["num_hidden_layers"] = 2
    (draft / "config.json").write_text(json.dumps(cfg))
    check_error(draft, "num_hidden_layers=2")


def test_eagle3_q_proj_must_read_embed_and_feature(tmp_path, target):
    draft = _eagle3(tmp_path, target)
    w = load_weights(draft)
    w["layers.0.self_attn.q_proj.weight"] = torch.zeros(HIDDEN, HIDDEN)
    rewrite(draft, w)
    check_error(draft, "q_proj.weight", f"{2 * HIDDEN} wide")


@pytest.mark.parametrize(
    "head", [{"shared_lm_head": True}, {}, {"draft_vocab": 100}], ids=["shared", "own", "d2t"]
)
def test_eagle3_ranked_draft_vocab_only_over_the_whole_vocabulary(tmp_path, target, head):
    """A draft_vocab.json ranking is for heads over the whole vocabulary (the target's
    shared LM head, or an own one as large); a head with a reduced vocabulary (d2t)
    refuses it."""
    draft = _eagle3(tmp_path, target, **head)
    (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(40))}))
    if "draft_vocab" in head:
        check_error(draft, "draft_vocab.json", "100-token vocabulary", "Fix: delete")
    else:
        assert inspect(draft).draft_vocab_size == 40
