"""``eagle-vllm calibrate``'s loop, against a stand-in engine: a sweep at every level and
temperature, batches until it is done, and a suffix source that starts every batch cold."""

from __future__ import annotations

import types

import pytest


class StandInLLM:
    """Records what ``calibrate`` asks of an engine; a sweep of ``sweep_steps`` steps
    runs ``steps_per_generate`` of them per ``generate`` call."""

    sweep_steps = 7
    steps_per_generate = 3

    def __init__(self, target, speculative_config=None, **kwargs):
        self.events: list[tuple] = []
        self.left = 0
        self.llm_engine = types.SimpleNamespace(
            engine_core=types.SimpleNamespace(shutdown=lambda: None)
        )
        StandInLLM.last = self

    def collective_rpc(self, method, args=(), kwargs=None):
        if method == "eagle_vllm_sizing_sweep":
            if args:
                self.events.append(("sweep", *args))
                self.left = self.sweep_steps
            return [self.left]
        if method == "eagle_vllm_suffix":
            self.events.append(("suffix", dict(kwargs or {})))
            return [{}]
        if method == "eagle_vllm_sizing_profile":
            return [{"eagle_vllm_sizing_profile": 1}]
        raise AssertionError(f"unexpected rpc {method}")

    def generate(self, prompts, params, use_tqdm=False):
        self.events.append(("generate", tuple(prompts), params.temperature))
        self.left = max(0, self.left - self.steps_per_generate)
        return []


@pytest.fixture
def auto_config(monkeypatch):
    """Any config parses as one with ``total_tokens: auto``."""
    import eagle_vllm.config

    monkeypatch.setattr(
        eagle_vllm.config,
        "parse_speculative_config",
        lambda config, target=None: types.SimpleNamespace(auto_size=True),
    )


def test_calibrate_sweeps_each_level_with_a_cold_suffix_cache_per_batch(
    monkeypatch, tmp_path, auto_config
):
    import eagle_vllm
    from eagle_vllm.calibrate import calibrate

    monkeypatch.setattr(eagle_vllm, "LLM", StandInLLM)
    prompts = [f"p{i}" for i in range(10)]
    calibrate("target", "auto.yaml", tmp_path / "profile.json", concurrency=(1, 4),
              prompts=prompts, temperatures=(0.0, 1.0), visits=2, steps_per_visit=3)  # fmt: skip
    events = StandInLLM.last.events
    sweeps = [e for e in events if e[0] == "sweep"]
    assert sweeps == [("sweep", 2, 3)] * 4  # every level at every temperature
    generates = [e for e in events if e[0] == "generate"]
    # 7 sweep steps at 3 a batch: 3 batches per level and temperature
    assert len(generates) == 3 * 4
    for i, event in enumerate(events):
        if event[0] == "generate":  # the suffix cache is emptied before every batch
            assert events[i - 1] == ("suffix", {"clear_cache": True})
    # the batches of one level take the next prompts, not the same ones again
    level_1 = [e[1] for e in generates[3:6]]
    assert all(len(b) == 4 for b in level_1) and len({p for b in level_1 for p in b}) == 10


def test_calibrate_refuses_bad_sweep_settings_before_starting_an_engine(
    monkeypatch, tmp_path, auto_config
):
    import eagle_vllm
    from eagle_vllm.calibrate import calibrate

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(eagle_vllm, "LLM", no_engine)
    for visits, steps in ((-1, 3), (3, 0)):
        with pytest.raises(ValueError, match="visits"):
            calibrate("target", "auto.yaml", tmp_path / "p.json", visits=visits,
                      steps_per_visit=steps)  # fmt: skip
