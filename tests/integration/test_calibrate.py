"""``eagle-vllm calibrate``: a profile measured by one engine seeds the next one."""

from __future__ import annotations

import json
import os

import pytest
from conftest import ENGINE_KW, shutdown

pytestmark = pytest.mark.vllm


def test_calibrate_writes_a_profile_that_an_engine_starts_from(tiny, tmp_path):
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.calibrate import calibrate, write_calibrated_config
    from eagle_vllm.config import parse_speculative_config
    from eagle_vllm.sizing import TreeSizer

    config = tmp_path / "auto.yaml"
    spec = {"method": "eagle2", "model": str(tiny["draft_noisy"]), "num_speculative_tokens": 2,
            "topk": 2, "total_tokens": "auto", "max_total_tokens": 4}  # fmt: skip
    config.write_text(json.dumps(spec))
    prompts = [" ".join(f"w{(3 * i + j) % 200}" for j in range(12)) for i in range(8)]
    out = tmp_path / "profiles" / "tiny.json"
    profile = calibrate(
        str(tiny["target"]), str(config), out, concurrency=(1, 4), max_tokens=40,
        prompts=prompts, **ENGINE_KW,
    )  # fmt: skip
    assert json.loads(out.read_text()) == profile
    buckets = {int(key.split(",")[0]) for key in profile["verify_seconds"]}
    assert {1, 4} <= buckets, profile["verify_seconds"]  # (and the tail of a batch)
    # the sweep ran every arm at each level: every tree size and pass count is measured,
    # also those the free sizer would not have tried
    arms = TreeSizer(max_passes=2, topk=2, max_nodes=4).arms
    for bucket in (1, 4):
        for table in ("", "_sampled"):
            verified = {f"{bucket},{m}" for _, m in arms}
            drafted = {f"{bucket},{d}" for d, _ in arms}
            assert verified <= set(profile["verify_seconds" + table]), (bucket, table)
            assert drafted <= set(profile["draft_seconds" + table]), (bucket, table)
    assert profile["acceptance"]["trials"][2][2] > 0  # two-pass trees verified at depth 2
    assert profile["acceptance"]["trials"][2][1] > 0  # drafted trees were verified
    # T=1 requests (the default temperatures are 0 and 1) kept their own acceptance: the
    # runner told the sizer which requests sample
    assert profile["acceptance_sampled"]["trials"][2][1] > 0
    # and the steps with a sampled request kept their own costs (the runner tells the
    # sizer each step's mode)
    assert {1, 4} <= {int(key.split(",")[0]) for key in profile["verify_seconds_sampled"]}
    assert profile["calibration"]["concurrency"] == [1, 4]
    assert profile["calibration"]["visits"] == 3

    # the config `--write-config` writes (absolute paths: it lives in another folder)
    spec["model"] = os.path.relpath(tiny["draft_noisy"], tmp_path)  # relative to the config
    config.write_text(json.dumps(spec))
    served = write_calibrated_config(config, out, tmp_path / "elsewhere" / "served.yaml")
    parsed = parse_speculative_config(served)
    assert parsed.sizing_profile == json.loads(out.read_text())
    assert parsed.model == str(tiny["draft_noisy"].resolve())
    llm = LLM(str(tiny["target"]), speculative_config=str(served), **ENGINE_KW)
    try:
        table = llm.collective_rpc("eagle_vllm_sizing")[0]
        # before any request: the arms the calibration measured have costs already
        bucket_1 = table["buckets"].get(1) or table["buckets"].get("1")
        assert any(v["seconds"] is not None for v in bucket_1.values()), table
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        llm.generate(prompts[:1], params, use_tqdm=False)
        history = llm.collective_rpc("eagle_vllm_sizing")[0]["history"]
    finally:
        shutdown(llm)
    # the first step's choice is the profile's: its best arm, or, where a tree wins, no
    # drafts probed first (its cost is the profile's); not the first arm to explore
    local = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    local.load_profile(profile)
    first = local.choose(1)
    assert first.kind in ("best", "probe"), first
    assert tuple(history[0]) == (1, *first.arm), history[:4]
