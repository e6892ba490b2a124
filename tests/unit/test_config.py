"""Validation of the speculative config (``eagle_vllm.config``) and its front-end helpers.

Every error must name the offending key (or file) and say how to fix it. No
vLLM engine is started; only ``config.json`` files and tiny weights are read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny_models
import torch
from tiny_models import build_draft, build_target

from eagle_vllm.config import (
    ADDITIONAL_CONFIG_KEY,
    DEFAULTS,
    MAX_DRAFT_SLOTS,
    WORKER_CLS,
    EagleConfigError,
    EagleSpecConfig,
    is_eagle_vllm_request,
    parse_speculative_config,
    read_config_file,
    validate_against_target,
)
from eagle_vllm.integration import (
    apply_to_engine_args,
    resolve,
    speculative_config_arg,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cfg_models")
    target = build_target(root / "target", layers=1)
    # a stand-in "target" of another vocabulary (only config.json is read)
    other_vocab = root / "target_vocab300"
    other_vocab.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    cfg["vocab_size"] = 300
    (other_vocab / "config.json").write_text(json.dumps(cfg))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "HIDDEN", 128)
        draft_h128 = build_draft(root / "draft_h128", target)
    return {
        "target": target,
        "draft": build_draft(root / "draft", target),
        "draft_h128": draft_h128,
        "draft_vocab300": build_draft(root / "draft_vocab300", other_vocab),
    }


def assert_fix(exc: pytest.ExceptionInfo, key: str) -> str:
    msg = str(exc.value)
    assert f"'{key}'" in msg, msg
    assert "Fix:" in msg, msg
    return msg


def parse_err(config, key: str, **kw) -> str:
    with pytest.raises(EagleConfigError) as exc:
        parse_speculative_config(config, **kw)
    return assert_fix(exc, key)


# --------------------------------------------------------------------------
# keys and types
# --------------------------------------------------------------------------
def test_unknown_key(models):
    msg = parse_err({"method": "eagle", "model": str(models["draft"]), "depth": 3}, "depth")
    assert "unknown key" in msg
    assert "num_speculative_tokens" in msg  # lists the allowed keys


def test_unknown_key_reported_before_other_problems():
    parse_err({"methd": "eagle"}, "methd")


@pytest.mark.parametrize(
    "key,value",
    [
        ("num_speculative_tokens", "3"),
        ("num_speculative_tokens", 3.0),
        ("num_speculative_tokens", True),
        ("topk", False),
        ("topk", [2]),
        ("total_tokens", True),
        ("method", 1),
        ("method", True),
        ("model", 5),
        ("model", ["a"]),
        ("draft_sample_method", None),
    ],
)
def test_wrong_type(models, key, value):
    cfg = {"method": "eagle2", "model": str(models["draft"]), key: value}
    msg = parse_err(cfg, key)
    assert "expected" in msg and type(value).__name__ in msg


def test_path_object_is_accepted_for_model(models):
    cfg = parse_speculative_config({"method": "eagle", "model": models["draft"]})
    assert cfg.model == str(models["draft"])


def test_missing_method(models):
    msg = parse_err({"model": str(models["draft"])}, "method")
    assert "missing" in msg and "eagle2" in msg


def test_missing_model():
    msg = parse_err({"method": "eagle"}, "model")
    assert "missing" in msg


@pytest.mark.parametrize("method", ["medusa", "ngram", "EAGLE", "eagle3"])
def test_unknown_method(models, method):
    msg = parse_err({"method": method, "model": str(models["draft"])}, "method")
    assert method in msg


def test_missing_draft_folder(tmp_path):
    missing = tmp_path / "no_such_draft"
    msg = parse_err({"method": "eagle", "model": str(missing)}, "model")
    assert str(missing) in msg and "does not exist" in msg


def test_draft_folder_without_config_json(tmp_path):
    (tmp_path / "empty_draft").mkdir()
    msg = parse_err({"method": "eagle", "model": str(tmp_path / "empty_draft")}, "model")
    assert "config.json" in msg


def test_draft_folder_without_weights(tmp_path, models):
    bare = tmp_path / "bare_draft"
    bare.mkdir()
    shutil.copy(models["draft"] / "config.json", bare / "config.json")
    with pytest.raises(ValueError, match="has no weights.*Fix:"):
        parse_speculative_config({"method": "eagle", "model": str(bare)})


# --------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------
def test_relative_model_resolves_against_yaml_folder(tmp_path, models, monkeypatch):
    shutil.copytree(models["draft"], tmp_path / "draft")
    (tmp_path / "configs").mkdir()
    spec = tmp_path / "configs" / "spec.yaml"
    spec.write_text("method: eagle\nmodel: ../draft\nnum_speculative_tokens: 2\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the working directory must not matter
    cfg = parse_speculative_config(str(spec))
    assert Path(cfg.model) == (tmp_path / "draft").resolve()
    assert cfg.source == str(spec)
    assert cfg.num_speculative_tokens == 2
    # a Path works too
    assert parse_speculative_config(spec) == cfg
    # from the config's own folder, `../draft` names nothing
    monkeypatch.chdir(tmp_path / "configs")
    (tmp_path / "configs" / "d.yaml").write_text("method: eagle\nmodel: draft\n")
    msg = parse_err("d.yaml", "model")
    assert str((tmp_path / "configs" / "draft").resolve()) in msg


def test_relative_model_in_dict_resolves_against_cwd(tmp_path, models, monkeypatch):
    shutil.copytree(models["draft"], tmp_path / "d")
    monkeypatch.chdir(tmp_path)
    cfg = parse_speculative_config({"method": "eagle", "model": "d"})
    assert Path(cfg.model) == (tmp_path / "d").resolve()
    assert cfg.source is None


def test_yaml_home_expansion(tmp_path, models, monkeypatch):
    shutil.copytree(models["draft"], tmp_path / "d")
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = parse_speculative_config({"method": "eagle", "model": "~/d"})
    assert Path(cfg.model) == (tmp_path / "d").resolve()


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: eagle\nmodel: [unclosed\n")
    with pytest.raises(EagleConfigError) as exc:
        parse_speculative_config(str(bad))
    msg = str(exc.value)
    assert str(bad) in msg and "not valid YAML" in msg and "Fix:" in msg


@pytest.mark.parametrize(
    "text,kind", [("- method: eagle\n- model: x\n", "list"), ("", "NoneType"), ("eagle\n", "str")]
)
def test_yaml_not_a_mapping(tmp_path, text, kind):
    f = tmp_path / "list.yml"
    f.write_text(text)
    with pytest.raises(EagleConfigError) as exc:
        parse_speculative_config(f)
    msg = str(exc.value)
    assert "mapping" in msg and kind in msg and "Fix:" in msg and str(f) in msg


def test_json_file(tmp_path, models):
    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"method": "eagle2", "model": str(models["draft"]), "topk": 3}))
    cfg = parse_speculative_config(f)
    assert (cfg.method, cfg.topk, cfg.total_tokens) == ("eagle2", 3, 16)
    assert read_config_file(f)["topk"] == 3


def test_malformed_json(tmp_path):
    f = tmp_path / "spec.JSON"
    f.write_text('{"method": "eagle",}')
    with pytest.raises(EagleConfigError) as exc:
        parse_speculative_config(f)
    assert "not valid JSON" in str(exc.value) and "Fix:" in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(EagleConfigError, match="does not exist.*Fix:"):
        parse_speculative_config(str(tmp_path / "nope.yaml"))


def test_not_dict_or_path():
    with pytest.raises(EagleConfigError, match="Fix:"):
        parse_speculative_config(42)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------
def test_num_speculative_tokens_zero(models):
    for method in ("eagle", "eagle2"):
        msg = parse_err(
            {"method": method, "model": str(models["draft"]), "num_speculative_tokens": 0},
            "num_speculative_tokens",
        )
        assert "below 1" in msg


def test_topk_zero(models):
    parse_err({"method": "eagle2", "model": str(models["draft"]), "topk": 0}, "topk")
    parse_err({"method": "eagle", "model": str(models["draft"]), "topk": 0}, "topk")


def test_root_topk(models):
    d = str(models["draft"])
    cfg = parse_speculative_config({"method": "eagle2", "model": d, "topk": 2})
    assert cfg.root_topk == 2  # as wide as the beam unless asked
    wide = {"method": "eagle2", "model": d, "num_speculative_tokens": 2, "topk": 2}
    cfg = parse_speculative_config({**wide, "root_topk": 6})
    # the root's 6 children and 2 * 2 grandchildren: 11 nodes, the default total's cap
    assert (cfg.root_topk, cfg.total_tokens) == (6, 11)
    assert parse_speculative_config({**wide, "root_topk": 6, "total_tokens": 11})
    msg = parse_err({**wide, "root_topk": 6, "total_tokens": 12}, "total_tokens")
    assert "root_topk 6" in msg
    msg = parse_err({**wide, "root_topk": 1}, "root_topk")
    assert "below topk 2" in msg and "root_topk >= 2" in msg
    msg = parse_err({"method": "eagle", "model": d, "root_topk": 3}, "root_topk")
    assert "chain" in msg
    chain = {"method": "eagle2", "model": d, "topk": 1, "total_tokens": 4, "root_topk": 3}
    msg = parse_err({**chain, "draft_sample_method": "sample"}, "draft_sample_method")
    assert "root_topk 3" in msg
    # a wider root makes branches: the tree path (tree attention, KV compaction) serves it
    assert parse_speculative_config(chain).uses_trees
    assert EagleSpecConfig.from_dict(cfg.to_dict()).root_topk == 6


def test_topk_above_one_with_eagle(models):
    msg = parse_err({"method": "eagle", "model": str(models["draft"]), "topk": 2}, "topk")
    assert "eagle2" in msg
    # topk 1 is fine for a chain
    assert (
        parse_speculative_config({"method": "eagle", "model": str(models["draft"]), "topk": 1}).topk
        == 1
    )


def test_eagle_total_tokens_must_match_chain(models):
    d = str(models["draft"])
    parse_err(
        {"method": "eagle", "model": d, "num_speculative_tokens": 3, "total_tokens": 8},
        "total_tokens",
    )
    cfg = parse_speculative_config(
        {"method": "eagle", "model": d, "num_speculative_tokens": 3, "total_tokens": 4}
    )
    assert cfg.total_tokens == 4


@pytest.mark.parametrize("total", [1, 0, -3])
def test_eagle2_total_tokens_below_two(models, total):
    msg = parse_err(
        {"method": "eagle2", "model": str(models["draft"]), "total_tokens": total},
        "total_tokens",
    )
    assert "below 2" in msg


@pytest.mark.parametrize("depth,topk", [(1, 1), (1, 4), (2, 2), (3, 3), (4, 4)])
def test_eagle2_total_tokens_reachable(models, depth, topk):
    max_nodes = 1 + topk + (depth - 1) * topk * topk
    base = {
        "method": "eagle2",
        "model": str(models["draft"]),
        "num_speculative_tokens": depth,
        "topk": topk,
    }
    cfg = parse_speculative_config({**base, "total_tokens": max_nodes})
    assert cfg.num_draft_slots == max_nodes - 1
    msg = parse_err({**base, "total_tokens": max_nodes + 1}, "total_tokens")
    assert str(max_nodes) in msg


def test_eagle2_total_tokens_minimum(models):
    cfg = parse_speculative_config(
        {"method": "eagle2", "model": str(models["draft"]), "total_tokens": 2}
    )
    assert cfg.num_draft_slots == 1


def test_too_many_drafts(models):
    d = str(models["draft"])
    # chain: at the limit is fine, one more is not
    assert (
        parse_speculative_config(
            {"method": "eagle", "model": d, "num_speculative_tokens": MAX_DRAFT_SLOTS}
        ).num_draft_slots
        == MAX_DRAFT_SLOTS
    )
    msg = parse_err(
        {"method": "eagle", "model": d, "num_speculative_tokens": MAX_DRAFT_SLOTS + 1},
        "num_speculative_tokens",
    )
    assert str(MAX_DRAFT_SLOTS) in msg
    # tree: depth 10, topk 4 reaches 149 nodes
    tree = {"method": "eagle2", "model": d, "num_speculative_tokens": 10, "topk": 4}
    assert parse_speculative_config({**tree, "total_tokens": MAX_DRAFT_SLOTS + 1}).total_tokens == (
        MAX_DRAFT_SLOTS + 1
    )
    msg = parse_err({**tree, "total_tokens": MAX_DRAFT_SLOTS + 2}, "total_tokens")
    assert "exceed" in msg


def test_unknown_draft_sample_method(models):
    msg = parse_err(
        {"method": "eagle", "model": str(models["draft"]), "draft_sample_method": "multinomial"},
        "draft_sample_method",
    )
    assert "greedy" in msg


def test_sample_drafting_is_for_chains_only(models):
    d = str(models["draft"])
    cfg = parse_speculative_config({"method": "eagle", "model": d, "draft_sample_method": "sample"})
    assert cfg.draft_sample_method == "sample"
    tree = {"method": "eagle2", "model": d, "topk": 4, "draft_sample_method": "sample"}
    msg = parse_err(tree, "draft_sample_method")
    assert "topk" in msg and "greedy" in msg
    one = {"method": "eagle2", "model": d, "topk": 1, "total_tokens": 4}
    assert parse_speculative_config({**one, "draft_sample_method": "sample"}).topk == 1


def test_defaults_eagle(models):
    cfg = parse_speculative_config({"method": "eagle", "model": str(models["draft"])})
    assert cfg == EagleSpecConfig(
        method="eagle",
        model=str(models["draft"]),
        num_speculative_tokens=DEFAULTS["eagle"]["num_speculative_tokens"],
        topk=1,
        total_tokens=DEFAULTS["eagle"]["num_speculative_tokens"] + 1,
        draft_sample_method="sample",  # measured: higher acceptance at T > 0 (docs §6)
    )
    assert cfg.num_speculative_tokens == 3 and cfg.num_draft_slots == 3


def test_defaults_eagle2(models):
    cfg = parse_speculative_config({"method": "eagle2", "model": str(models["draft"])})
    assert (cfg.num_speculative_tokens, cfg.topk, cfg.total_tokens) == (4, 4, 16)
    assert cfg.draft_sample_method == "greedy"
    assert cfg.num_draft_slots == 15


def test_input_dict_not_mutated(models):
    spec = {"method": "eagle"}
    parse_speculative_config(spec, speculative_model=str(models["draft"]))
    assert spec == {"method": "eagle"}


def test_speculative_model(models):
    d = str(models["draft"])
    cfg = parse_speculative_config({"method": "eagle"}, speculative_model=d)
    assert cfg.model == d
    # the same folder twice is fine, two different ones are not
    parse_speculative_config({"method": "eagle", "model": d}, speculative_model=d)
    msg = parse_err({"method": "eagle", "model": "/elsewhere"}, "model", speculative_model=d)
    assert "given twice" in msg


# --------------------------------------------------------------------------
# against the target
# --------------------------------------------------------------------------
def test_matching_target(models):
    t = str(models["target"])
    cfg = parse_speculative_config({"method": "eagle2", "model": str(models["draft"])}, target=t)
    validate_against_target(cfg, t, max_model_len=512)


def test_hidden_size_mismatch(models):
    t = str(models["target"])
    spec = {"method": "eagle", "model": str(models["draft_h128"])}
    msg = parse_err(spec, "model", target=t)
    assert "hidden_size 128" in msg and "256" in msg and t in msg
    # without a target the draft alone is valid; validate_against_target catches it
    cfg = parse_speculative_config(spec)
    with pytest.raises(EagleConfigError) as exc:
        validate_against_target(cfg, t)
    assert_fix(exc, "model")


def test_vocab_mismatch(models):
    t = str(models["target"])
    spec = {"method": "eagle", "model": str(models["draft_vocab300"])}
    msg = parse_err(spec, "model", target=t)
    assert "vocab_size 300" in msg and str(tiny_models.VOCAB_WORDS + 4) in msg
    with pytest.raises(EagleConfigError) as exc:
        validate_against_target(parse_speculative_config(spec), t)
    assert_fix(exc, "model")


def test_target_text_config(models, tmp_path):
    """Multimodal-style configs keep the LM's sizes under ``text_config``."""
    cfg = json.loads((models["target"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llava", "text_config": {**cfg, "hidden_size": 512}})
    )
    spec = parse_speculative_config({"method": "eagle", "model": str(models["draft"])})
    with pytest.raises(EagleConfigError, match="hidden_size 256.*512"):
        validate_against_target(spec, str(tmp_path))


def test_unknown_target_is_not_checked_here(models, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = parse_speculative_config({"method": "eagle", "model": str(models["draft_h128"])})
    validate_against_target(spec, "no-such-org/no-such-model-eagle-vllm-test")


@pytest.mark.parametrize(
    "spec,key,ok_len,bad_len",
    [
        ({"method": "eagle", "num_speculative_tokens": 5}, "num_speculative_tokens", 7, 6),
        ({"method": "eagle2", "total_tokens": 16}, "total_tokens", 17, 16),
    ],
)
def test_max_model_len_too_small(models, spec, key, ok_len, bad_len):
    t = str(models["target"])
    cfg = parse_speculative_config({**spec, "model": str(models["draft"])}, target=t)
    validate_against_target(cfg, t, max_model_len=ok_len)
    with pytest.raises(EagleConfigError) as exc:
        validate_against_target(cfg, t, max_model_len=bad_len)
    msg = assert_fix(exc, key)
    assert f"max_model_len {bad_len}" in msg


# --------------------------------------------------------------------------
# mapping onto vLLM
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,slots",
    [
        ({"method": "eagle"}, 3),
        ({"method": "eagle", "num_speculative_tokens": 5}, 5),
        ({"method": "eagle2"}, 15),
        ({"method": "eagle2", "num_speculative_tokens": 3, "topk": 2, "total_tokens": 8}, 7),
    ],
)
def test_engine_kwargs(models, spec, slots):
    d = str(models["draft"])
    cfg = parse_speculative_config({**spec, "model": d})
    kw = cfg.engine_kwargs()
    assert set(kw) == {"speculative_config", "additional_config", "worker_cls"}
    assert kw["speculative_config"] == {
        "method": "eagle",
        "model": d,
        "num_speculative_tokens": cfg.total_tokens - 1,
        "disable_eagle_block_drop": True,  # the drafter needs no recomputed cached block
    }
    assert kw["speculative_config"]["num_speculative_tokens"] == slots
    assert kw["worker_cls"] == WORKER_CLS == "eagle_vllm.engine.worker.EagleWorker"
    assert set(kw["additional_config"]) == {ADDITIONAL_CONFIG_KEY}
    plugin = kw["additional_config"][ADDITIONAL_CONFIG_KEY]
    assert plugin == cfg.to_dict()
    json.dumps(plugin)  # must survive vLLM's config hashing / IPC
    assert EagleSpecConfig.from_dict(plugin) == cfg


def test_is_eagle_vllm_request(tmp_path):
    assert is_eagle_vllm_request("configs/eagle.yaml")
    assert is_eagle_vllm_request(tmp_path / "spec.yaml")
    assert not is_eagle_vllm_request({"method": "eagle", "model": "x"})
    assert not is_eagle_vllm_request({"method": "eagle", "num_speculative_tokens": 3})
    assert not is_eagle_vllm_request({"method": "ngram", "num_speculative_tokens": 3})
    assert is_eagle_vllm_request({"method": "eagle2", "model": "x"})
    assert is_eagle_vllm_request({"method": "eagle", "topk": 1})
    assert is_eagle_vllm_request({"method": "eagle", "total_tokens": 4})
    assert is_eagle_vllm_request({"method": "eagle", "draft_sample_method": "greedy"})
    assert is_eagle_vllm_request({"_eagle_vllm_source": "/x/spec.yaml"})
    assert not is_eagle_vllm_request(None)
    assert not is_eagle_vllm_request({})


def test_speculative_config_arg(tmp_path, monkeypatch):
    assert speculative_config_arg('{"method": "ngram", "num_speculative_tokens": 2}') == {
        "method": "ngram",
        "num_speculative_tokens": 2,
    }
    assert speculative_config_arg('  {"method": "eagle2"} ') == {"method": "eagle2"}
    f = tmp_path / "spec.yaml"
    f.write_text("method: eagle\n")
    monkeypatch.chdir(tmp_path)
    out = speculative_config_arg("spec.yaml")
    assert out == {"_eagle_vllm_source": str(f.resolve())}
    assert is_eagle_vllm_request(out)
    for garbage in ["{not json", "{'method': 'eagle'}", "no/such/file.yaml", "method=eagle"]:
        with pytest.raises(EagleConfigError, match="Fix:"):
            speculative_config_arg(garbage)


def test_resolve(models, tmp_path):
    d, t = str(models["draft"]), str(models["target"])
    assert resolve(None, target=t) is None
    assert resolve({"method": "eagle", "model": d, "num_speculative_tokens": 2}) is None
    assert resolve({"method": "ngram", "num_speculative_tokens": 2}) is None
    f = tmp_path / "spec.yaml"
    f.write_text(f"method: eagle2\nmodel: {d}\n")
    expected = parse_speculative_config(str(f)).engine_kwargs()
    assert resolve(speculative_config_arg(str(f)), target=t) == expected
    assert resolve(f, target=t) == expected
    assert resolve(str(f), target=t, max_model_len=512) == expected
    with pytest.raises(EagleConfigError, match="max_model_len 8"):
        resolve(str(f), target=t, max_model_len=8)


def _engine_args(**kw):
    base = dict(
        additional_config=None,
        speculative_config=None,
        model=None,
        max_model_len=None,
        worker_cls="auto",
    )
    return SimpleNamespace(**{**base, **kw})


def test_apply_to_engine_args(models, tmp_path):
    d, t = str(models["draft"]), str(models["target"])
    f = tmp_path / "spec.yaml"
    f.write_text(f"method: eagle\nmodel: {d}\nnum_speculative_tokens: 2\n")

    args = _engine_args(
        speculative_config=speculative_config_arg(str(f)),
        model=t,
        additional_config={"other": 1},
    )
    apply_to_engine_args(args)
    assert args.speculative_config == {"method": "eagle", "model": d, "num_speculative_tokens": 2,
                                       "disable_eagle_block_drop": True}  # fmt: skip
    assert args.worker_cls == WORKER_CLS
    assert args.additional_config["other"] == 1
    assert args.additional_config[ADDITIONAL_CONFIG_KEY]["num_speculative_tokens"] == 2
    # a second call (already resolved) changes nothing
    snapshot = dict(vars(args))
    apply_to_engine_args(args)
    assert vars(args) == snapshot

    # vLLM's built-in EAGLE passes through untouched
    builtin = {"method": "eagle", "model": d, "num_speculative_tokens": 2}
    args = _engine_args(speculative_config=dict(builtin), model=t)
    apply_to_engine_args(args)
    assert args.speculative_config == builtin and args.worker_cls == "auto"

    # a foreign worker_cls is refused
    args = _engine_args(speculative_config=str(f), model=t, worker_cls="my.Worker")
    with pytest.raises(EagleConfigError, match="worker_cls.*Fix:"):
        apply_to_engine_args(args)

    # bad configs fail here, before any engine exists
    args = _engine_args(
        speculative_config={"method": "eagle2", "model": str(models["draft_h128"])}, model=t
    )
    with pytest.raises(EagleConfigError, match="hidden_size"):
        apply_to_engine_args(args)


# -- draft_vocab (reduced draft vocabulary) ------------------------------------
def _with_draft_vocab(models, tmp_path, ids) -> Path:
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint

    path = tmp_path / "draft_dv"
    shutil.copytree(models["draft"], path)
    (path / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
    inspect_draft_checkpoint.cache_clear()
    return path


def test_draft_vocab_auto_full_and_number(models, tmp_path):
    draft = _with_draft_vocab(models, tmp_path, list(range(100, 0, -1)))
    base = {"method": "eagle", "model": str(draft)}
    assert parse_speculative_config(base).draft_vocab == 100  # auto: the head's list
    assert parse_speculative_config({**base, "draft_vocab": "full"}).draft_vocab == 0
    assert parse_speculative_config({**base, "draft_vocab": 40}).draft_vocab == 40
    assert (
        parse_speculative_config({"method": "eagle", "model": str(models["draft"])}).draft_vocab
        == 0
    )
    with pytest.raises(EagleConfigError, match="'draft_vocab': 101 is outside 1..100"):
        parse_speculative_config({**base, "draft_vocab": 101})
    with pytest.raises(EagleConfigError, match="'draft_vocab': unknown value 'most'"):
        parse_speculative_config({**base, "draft_vocab": "most"})
    with pytest.raises(EagleConfigError, match="lacks.*Fix: use 'full'.*--ce-vocab"):
        parse_speculative_config(
            {"method": "eagle", "model": str(models["draft"]), "draft_vocab": 8}
        )
    assert is_eagle_vllm_request({"method": "eagle", "draft_vocab": "full"})


def test_draft_vocab_context_is_on_wherever_the_vocabulary_is_reduced(models, tmp_path):
    draft = _with_draft_vocab(models, tmp_path, list(range(100, 0, -1)))
    base = {"method": "eagle", "model": str(draft)}
    assert parse_speculative_config(base).draft_vocab_context  # auto: reduced, so on
    assert parse_speculative_config({**base, "draft_vocab": 40}).draft_vocab_context
    assert not parse_speculative_config({**base, "draft_vocab_context": False}).draft_vocab_context
    assert not parse_speculative_config({**base, "draft_vocab": "full"}).draft_vocab_context
    with pytest.raises(EagleConfigError, match="'draft_vocab_context'.*drafts a full one.*Fix"):
        parse_speculative_config({**base, "draft_vocab": "full", "draft_vocab_context": True})
    with pytest.raises(EagleConfigError, match="'draft_vocab_context'.*Fix"):  # no list at all
        parse_speculative_config(
            {"method": "eagle", "model": str(models["draft"]), "draft_vocab_context": True}
        )
    with pytest.raises(EagleConfigError, match="'draft_vocab_context': expected bool, got str"):
        parse_speculative_config({**base, "draft_vocab_context": "yes"})
    with pytest.raises(EagleConfigError, match="'draft_vocab_context'.*method 'suffix'"):
        parse_speculative_config({"method": "suffix", "draft_vocab_context": False})
    assert is_eagle_vllm_request({"method": "eagle", "draft_vocab_context": False})
    # the other keys still refuse booleans
    with pytest.raises(EagleConfigError, match="'topk': expected int, got bool"):
        parse_speculative_config({**base, "method": "eagle2", "topk": True})


def test_draft_dtype_values_and_the_cpus_that_can_take_bfloat16(models, monkeypatch):
    import eagle_vllm.config as config_module
    from eagle_vllm.config import resolve_draft_dtype

    base = {"method": "eagle2", "model": str(models["draft"])}
    assert parse_speculative_config(base).draft_dtype == "model"
    assert parse_speculative_config({**base, "draft_dtype": "auto"}).draft_dtype == "auto"
    msg = parse_err({**base, "draft_dtype": "fp8"}, "draft_dtype")
    assert "unknown value 'fp8'" in msg and "'bfloat16'" in msg
    parse_err({"method": "suffix", "draft_dtype": "bfloat16"}, "draft_dtype")
    bf16, fp32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(config_module, "cpu_has_bf16_gemm", lambda: False)
    monkeypatch.setattr(config_module, "cpu_has_int8_gemm", lambda: False)
    monkeypatch.setattr(config_module, "_has_cuda", lambda: False)
    msg = parse_err({**base, "draft_dtype": "bfloat16"}, "draft_dtype")
    assert "AVX-512 BF16" in msg and "draft_dtype: auto" in msg
    with pytest.raises(EagleConfigError, match="AVX-512 BF16"):
        resolve_draft_dtype("bfloat16", fp32, "cpu")  # the worker checks again
    msg = parse_err({**base, "draft_dtype": "int8"}, "draft_dtype")
    assert "fbgemm" in msg and "a CPU without it" in msg and "draft_dtype: auto" in msg
    assert resolve_draft_dtype("auto", fp32, "cpu") is None
    monkeypatch.setattr(config_module, "cpu_has_int8_gemm", lambda: True)
    assert parse_speculative_config({**base, "draft_dtype": "int8"}).draft_dtype == "int8"
    assert resolve_draft_dtype("auto", fp32, "cpu") is torch.qint8  # no bf16: int8
    assert resolve_draft_dtype("int8", fp32, "cpu") is torch.qint8
    assert resolve_draft_dtype("int8", bf16, "cpu") is torch.qint8  # asked for: even so
    with pytest.raises(EagleConfigError, match="a GPU"):
        resolve_draft_dtype("int8", fp32, "cuda")
    assert resolve_draft_dtype("bfloat16", fp32, "cuda") is bf16
    monkeypatch.setattr(config_module, "cpu_has_bf16_gemm", lambda: True)
    assert parse_speculative_config({**base, "draft_dtype": "bfloat16"}).draft_dtype == "bfloat16"
    assert resolve_draft_dtype("auto", fp32, "cpu") is bf16
    assert resolve_draft_dtype("bfloat16", fp32, "cpu") is bf16
    assert resolve_draft_dtype("auto", fp32, "cuda") is None  # GPUs serve in bf16 anyway
    assert resolve_draft_dtype("model", fp32, "cpu") is None
    assert resolve_draft_dtype("bfloat16", bf16, "cpu") is None  # already bf16


def test_a_bf16_target_on_a_cpu_without_bf16_gemms_is_warned_about(monkeypatch):
    """``--dtype auto`` serves SmolLM2 in bfloat16; on an AVX2-only CPU every verified
    token then costs a token's worth of matrix products, and the user is told to serve
    in float32."""
    import eagle_vllm.config as config_module
    from eagle_vllm.config import slow_target_dtype_warning

    monkeypatch.setattr(config_module, "cpu_has_bf16_gemm", lambda: False)
    warning = slow_target_dtype_warning(torch.bfloat16, "cpu")
    assert warning is not None and "--dtype float32" in warning and "AVX-512 BF16" in warning
    assert slow_target_dtype_warning(torch.float32, "cpu") is None
    assert slow_target_dtype_warning(torch.bfloat16, "cuda") is None
    monkeypatch.setattr(config_module, "cpu_has_bf16_gemm", lambda: True)
    assert slow_target_dtype_warning(torch.bfloat16, "cpu") is None


@pytest.mark.parametrize("ids", [[1, 1, 2], [0, 99999], [], "nope"])
def test_bad_draft_vocab_file(models, tmp_path, ids):
    from eagle_vllm.models.checkpoint import DraftCheckpointError

    draft = _with_draft_vocab(models, tmp_path, ids)
    with pytest.raises(DraftCheckpointError, match="draft_vocab.json"):
        parse_speculative_config({"method": "eagle", "model": str(draft)})


def test_pipeline_parallelism_is_refused(models, tmp_path):
    d, t = str(models["draft"]), str(models["target"])
    f = tmp_path / "spec.yaml"
    f.write_text(f"method: eagle2\nmodel: {d}\n")
    args = _engine_args(speculative_config=str(f), model=t, pipeline_parallel_size=2)
    with pytest.raises(EagleConfigError, match="pipeline_parallel_size 2.*Fix: use tensor"):
        apply_to_engine_args(args)
    # other engines are not ours to judge
    args = _engine_args(speculative_config=None, model=t, pipeline_parallel_size=2)
    apply_to_engine_args(args)


def test_ray_on_cpu_gets_the_plugins_executor_only_for_eagle_configs(models, tmp_path):
    """vLLM 0.32 refuses Ray on its CPU platform; an eagle_vllm config asking for Ray gets
    the plugin's CPU Ray executor as the engine's executor class, and nothing changes for
    other engines (no vLLM function is patched)."""
    from vllm.v1.executor.abstract import Executor

    d, t = str(models["draft"]), str(models["target"])
    f = tmp_path / "spec.yaml"
    f.write_text(f"method: eagle2\nmodel: {d}\n")
    get_class = Executor.get_class
    args = _engine_args(speculative_config=str(f), model=t, distributed_executor_backend="ray")
    apply_to_engine_args(args)
    assert args.distributed_executor_backend.__name__ == "CPURayExecutor"
    assert issubclass(args.distributed_executor_backend, Executor)
    assert args.distributed_executor_backend.uses_ray
    args = _engine_args(speculative_config=None, model=t, distributed_executor_backend="ray")
    apply_to_engine_args(args)
    assert args.distributed_executor_backend == "ray"
    assert Executor.get_class is get_class


def test_gpu_platforms_are_refused_before_workers_start(models, tmp_path, monkeypatch):
    """Until the Triton tree kernel is wired into vLLM's GPU backends, a GPU engine would
    verify trees with causal masks: refused up front, with the way out."""
    from vllm.platforms import current_platform

    d, t = str(models["draft"]), str(models["target"])
    f = tmp_path / "spec.yaml"
    f.write_text(f"method: eagle2\nmodel: {d}\n")
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    args = _engine_args(speculative_config=str(f), model=t)
    with pytest.raises(EagleConfigError, match="CPU backend only.*Fix: run on CPU"):
        apply_to_engine_args(args)
    apply_to_engine_args(_engine_args(speculative_config=None, model=t))  # not ours


def test_custom_logits_processors_are_refused_before_workers_start(models, tmp_path):
    d, t = str(models["draft"]), str(models["target"])
    f = tmp_path / "spec.yaml"
    f.write_text(f"method: eagle\nmodel: {d}\n")
    args = _engine_args(speculative_config=str(f), model=t, logits_processors=["pkg.Proc"])
    with pytest.raises(EagleConfigError, match="logits_processors.*Fix: drop"):
        apply_to_engine_args(args)
    args = _engine_args(speculative_config=None, model=t, logits_processors=["pkg.Proc"])
    apply_to_engine_args(args)  # not ours


@pytest.mark.parametrize(
    "name", ["eagle.yaml", "eagle2.yaml", "eagle2-auto.yaml", "eagle2-suffix.yaml"]
)
def test_shipped_configs_load_the_committed_reference_head(name):
    """configs/*.yaml point at heads/smollm2-135m-instruct-eagle, which is in the repo."""
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint

    root = Path(__file__).resolve().parents[2]
    cfg = parse_speculative_config(root / "configs" / name)
    info = inspect_draft_checkpoint(cfg.model)
    assert info.hidden_size == 576 and info.vocab_size == 49152 and not info.fc_bias
    # the 4096 most frequent of the head's 16384 ranked tokens (the configs' comment)
    assert info.draft_vocab_size == 16384 and cfg.draft_vocab == 4096


# --------------------------------------------------------------------------
# total_tokens: auto (load-aware sizing)
# --------------------------------------------------------------------------
def test_total_tokens_auto(models):
    d = str(models["draft"])
    cfg = parse_speculative_config(
        {"method": "eagle2", "model": d, "num_speculative_tokens": 3, "total_tokens": "auto"}
    )
    assert cfg.auto_size and cfg.total_tokens == DEFAULTS["eagle2"]["total_tokens"]
    assert cfg.num_draft_slots == cfg.total_tokens - 1  # vLLM reserves the largest tree
    cfg = parse_speculative_config(
        {"method": "eagle2", "model": d, "total_tokens": "auto", "max_total_tokens": 24}
    )
    assert cfg.auto_size and cfg.total_tokens == 24
    chain = parse_speculative_config({"method": "eagle", "model": d, "total_tokens": "auto"})
    assert chain.auto_size and chain.total_tokens == chain.num_speculative_tokens + 1
    fixed = parse_speculative_config({"method": "eagle2", "model": d, "total_tokens": 8})
    assert not fixed.auto_size
    assert is_eagle_vllm_request({"method": "eagle", "max_total_tokens": 8})


def test_total_tokens_auto_bad_values(models):
    d = str(models["draft"])
    msg = parse_err({"method": "eagle2", "model": d, "total_tokens": "big"}, "total_tokens")
    assert "auto" in msg
    msg = parse_err(
        {"method": "eagle2", "model": d, "total_tokens": 8, "max_total_tokens": 12},
        "max_total_tokens",
    )
    assert "total_tokens: auto" in msg
    msg = parse_err(
        {
            "method": "eagle2",
            "model": d,
            "num_speculative_tokens": 2,
            "topk": 2,
            "total_tokens": "auto",
            "max_total_tokens": 50,
        },
        "max_total_tokens",
    )
    assert "exceeds" in msg


def test_sizing_profile(models, tmp_path):
    """total_tokens: auto may start from an `eagle-vllm calibrate` profile: read and
    checked at parse time (relative to the config file), carried to the workers as data."""
    from eagle_vllm.sizing import TreeSizer

    d = str(models["draft"])
    base = {"method": "eagle2", "model": d, "num_speculative_tokens": 2, "topk": 2,
            "total_tokens": "auto", "max_total_tokens": 4}  # fmt: skip
    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    sizer.observe_verify(1, 1, 0.04)
    sizer.observe_draft(1, 0, 0.001)
    (tmp_path / "profile.json").write_text(json.dumps(sizer.export_profile()))
    config = tmp_path / "auto.yaml"
    config.write_text(json.dumps({**base, "sizing_profile": "profile.json"}))
    cfg = parse_speculative_config(config)
    assert cfg.sizing_profile["verify_seconds"] == {"1,1": 0.04}
    assert EagleSpecConfig.from_dict(cfg.to_dict()).sizing_profile == cfg.sizing_profile
    assert is_eagle_vllm_request({"method": "eagle", "sizing_profile": "p.json"})

    msg = parse_err({**base, "sizing_profile": str(tmp_path / "none.json")}, "sizing_profile")
    assert "does not exist" in msg and "eagle-vllm calibrate" in msg
    (tmp_path / "bad.json").write_text("{not json")
    parse_err({**base, "sizing_profile": str(tmp_path / "bad.json")}, "sizing_profile")
    other = {**base, "max_total_tokens": 5, "sizing_profile": str(tmp_path / "profile.json")}
    msg = parse_err(other, "sizing_profile")
    assert "made for" in msg and "(2, 2, 2, 4)" in msg and ".." not in msg
    fixed = {**base, "total_tokens": 4, "sizing_profile": str(tmp_path / "profile.json")}
    del fixed["max_total_tokens"]
    assert "total_tokens: auto" in parse_err(fixed, "sizing_profile")


def test_shipped_auto_config_parses():
    root = Path(__file__).resolve().parents[2]
    cfg = parse_speculative_config(root / "configs" / "eagle2-auto.yaml")
    assert cfg.auto_size and cfg.method == "eagle2" and cfg.total_tokens >= 8
    assert cfg.suffix is not None  # on: it pays (BENCHMARKS.md, hybrid drafting)


def test_shipped_suffix_configs_parse():
    root = Path(__file__).resolve().parents[2]
    cfg = parse_speculative_config(root / "configs" / "suffix.yaml")
    assert cfg.method == "suffix" and cfg.suffix.cache_requests == 1000
    hybrid = parse_speculative_config(root / "configs" / "eagle2-suffix.yaml")
    assert hybrid.suffix is not None and hybrid.total_tokens == 12


# --------------------------------------------------------------------------
# the suffix section and method suffix
# --------------------------------------------------------------------------
def test_suffix_section_in_every_head_method(models, tmp_path):
    d = str(models["draft"])
    chain = parse_speculative_config(
        {"method": "eagle", "model": d, "num_speculative_tokens": 3, "suffix": {"max_nodes": 5}}
    )
    assert chain.suffix.max_nodes == 5 and chain.total_tokens == 3 + 1 + 5
    assert chain.uses_trees  # suffix branches make the chain a tree
    tree = parse_speculative_config(
        {"method": "eagle2", "model": d, "num_speculative_tokens": 2, "topk": 2,
         "total_tokens": 12, "suffix": {"max_depth": 6, "min_prob": 0.2, "spec_factor": 2}}
    )  # fmt: skip
    assert (tree.suffix.max_depth, tree.suffix.min_prob, tree.total_tokens) == (6, 0.2, 12)
    assert tree.suffix.spec_factor == 2 and chain.suffix.spec_factor == 1.0
    assert not tree.suffix.expand  # EAGLE passes expand suffix nodes only when told to
    on = parse_speculative_config({**base_tree(d), "suffix": {"expand": True}})
    assert on.suffix.expand
    auto = parse_speculative_config(
        {"method": "eagle2", "model": d, "total_tokens": "auto", "max_total_tokens": 16,
         "suffix": {"cache_requests": 0}}
    )  # fmt: skip
    assert auto.auto_size and auto.suffix.cache_requests == 0
    # the round trip workers see
    assert EagleSpecConfig.from_dict(tree.to_dict()) == tree
    # past responses need the salt-carrying scheduler; without a cache nothing changes
    assert "scheduler_cls" in tree.engine_kwargs()
    assert "scheduler_cls" not in auto.engine_kwargs()


def base_tree(draft: str) -> dict:
    return {"method": "eagle2", "model": draft, "num_speculative_tokens": 2, "topk": 2,
            "total_tokens": 12}  # fmt: skip


def test_suffix_nodes_raise_the_tree_bound(models):
    d = str(models["draft"])
    base = {"method": "eagle2", "model": d, "num_speculative_tokens": 1, "topk": 2}
    parse_err({**base, "total_tokens": 5}, "total_tokens")  # 1 + 2 nodes at most
    cfg = parse_speculative_config({**base, "total_tokens": 5, "suffix": {"max_nodes": 2}})
    assert cfg.total_tokens == 5


@pytest.mark.parametrize(
    "section,key",
    [
        ({"max_nodes": 0}, "suffix.max_nodes"),
        ({"max_depth": 0}, "suffix.max_depth"),
        ({"cache_requests": -1}, "suffix.cache_requests"),
        ({"min_prob": 0.0}, "suffix.min_prob"),
        ({"min_prob": 1.5}, "suffix.min_prob"),
        ({"min_prob": "high"}, "suffix.min_prob"),
        ({"spec_factor": 0}, "suffix.spec_factor"),
        ({"spec_factor": -1.5}, "suffix.spec_factor"),
        ({"spec_factor": "deep"}, "suffix.spec_factor"),
        ({"max_nodes": True}, "suffix.max_nodes"),
        ({"expand": "yes"}, "suffix.expand"),
        ({"expand": 1}, "suffix.expand"),
        ({"depth": 4}, "suffix.depth"),
        ({"seed_corpus": "missing.jsonl"}, "suffix.seed_corpus"),
        ({"seed_tokens": 0}, "suffix.seed_tokens"),
    ],
)
def test_bad_suffix_sections(models, section, key):
    parse_err({"method": "suffix", "suffix": section}, key)
    d = str(models["draft"])
    parse_err({"method": "eagle2", "model": d, "suffix": section}, key)


def test_suffix_section_must_be_a_mapping():
    parse_err({"method": "suffix", "suffix": [1, 2]}, "suffix")


def test_method_suffix_needs_no_head():
    cfg = parse_speculative_config({"method": "suffix"})
    assert not cfg.uses_head and cfg.uses_trees
    assert cfg.total_tokens == cfg.suffix.max_nodes + 1
    spec = cfg.vllm_speculative_config()
    assert spec["method"] == "custom_class" and spec["num_speculative_tokens"] == 8


@pytest.mark.parametrize(
    "key,value",
    [("model", "x"), ("num_speculative_tokens", 3), ("topk", 2), ("total_tokens", 8),
     ("draft_sample_method", "greedy"), ("draft_vocab", "full")],
)  # fmt: skip
def test_method_suffix_refuses_head_keys(key, value):
    msg = parse_err({"method": "suffix", key: value}, key)
    assert "method 'suffix'" in msg


def test_suffix_seed_corpus_resolves_against_the_config_file(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"token_ids": [1, 2, 3]}\n')
    path = tmp_path / "suffix.yaml"
    path.write_text("method: suffix\nsuffix:\n  seed_corpus: corpus.jsonl\n  seed_tokens: 100\n")
    cfg = parse_speculative_config(path)
    assert cfg.suffix.seed_corpus == str((tmp_path / "corpus.jsonl").resolve())


def test_a_plain_suffix_dict_stays_vllms_unless_it_has_a_section():
    from eagle_vllm.config import is_eagle_vllm_request

    assert not is_eagle_vllm_request({"method": "suffix", "num_speculative_tokens": 4})
    assert is_eagle_vllm_request({"method": "suffix", "suffix": {}})


# --------------------------------------------------------------------------
# EAGLE-3 heads: the head type comes from the checkpoint, the method is the algorithm
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory, models) -> Path:
    from tiny_models import build_eagle3_draft

    root = tmp_path_factory.mktemp("cfg_eagle3")
    return build_eagle3_draft(root / "e3", models["target"], aux_layers=(0, 0, 0), draft_vocab=64)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle2"])
def test_eagle3_head_detected_for_every_method(models, eagle3_head, method):
    cfg = parse_speculative_config(
        {"method": method, "model": str(eagle3_head)}, target=str(models["target"])
    )
    assert cfg.head_type == "eagle3"
    assert cfg.method == ("eagle2" if method == "eagle2" else "eagle")  # eagle3: the chain
    vllm_cfg = cfg.engine_kwargs()["speculative_config"]
    # vLLM's eagle3 method makes its runner collect the target's auxiliary layers
    assert vllm_cfg["method"] == "eagle3"
    assert EagleSpecConfig.from_dict(cfg.to_dict()) == cfg


def test_eagle1_head_keeps_vllm_method_eagle(models):
    cfg = parse_speculative_config({"method": "eagle2", "model": str(models["draft"])})
    assert cfg.head_type == "eagle1"
    assert cfg.engine_kwargs()["speculative_config"]["method"] == "eagle"


def test_eagle3_method_with_an_eagle1_head(models):
    msg = parse_err({"method": "eagle3", "model": str(models["draft"])}, "method")
    assert "EAGLE-1 head" in msg and "use method 'eagle'" in msg


def test_draft_vocab_with_an_eagle3_head(models, eagle3_head):
    msg = parse_err(
        {"method": "eagle2", "model": str(eagle3_head), "draft_vocab": 32}, "draft_vocab"
    )
    assert "own vocabulary (64 tokens" in msg


def test_eagle3_head_reading_layers_the_target_lacks(models, eagle3_head, tmp_path):
    head = tmp_path / "e3"
    shutil.copytree(eagle3_head, head)
    cfg = json.loads((head / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 5]  # the target has 1 layer
    (head / "config.json").write_text(json.dumps(cfg))
    msg = parse_err({"method": "eagle", "model": str(head)}, "model", target=str(models["target"]))
    assert "[0, 1, 5]" in msg and "has 1" in msg


def test_plain_vllm_eagle3_dict_stays_vllms(eagle3_head):
    """{"method": "eagle3", ...} without plugin-only keys is vLLM's own EAGLE-3 (the
    benchmark baseline); a file path or a plugin key routes it to the plugin."""
    assert not is_eagle_vllm_request({"method": "eagle3", "model": str(eagle3_head)})
    assert is_eagle_vllm_request({"method": "eagle3", "model": str(eagle3_head), "topk": 1})


def test_shipped_eagle3_config_loads_the_committed_eagle3_head():
    """configs/eagle2-eagle3.yaml points at heads/smollm2-135m-instruct-eagle3 (speculators
    format): an EAGLE-3 head over target layers 2, 15 and 27 with an 8192-token draft vocab."""
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint

    root = Path(__file__).resolve().parents[2]
    cfg = parse_speculative_config(root / "configs" / "eagle2-eagle3.yaml")
    info = inspect_draft_checkpoint(cfg.model)
    assert info.head_type == "eagle3" and info.speculators_format
    assert info.aux_layer_ids == (2, 15, 27) and info.head_vocab_size == 8192
    assert info.hidden_size == 576 and info.vocab_size == 49152
