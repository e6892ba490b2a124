"""``eagle-vllm train`` end to end on a tiny target, and the feature contract.

* The features the trainer computes (transformers, last hidden state) equal, for
  the same tokens, the target hidden states the plugin's proposer receives
  inside vLLM: otherwise a head would be trained on inputs it never sees.
* A few dozen training steps make the loss fall; the exported checkpoint loads
  in the plugin (and, having no fc.bias, in vLLM's built-in EAGLE) and generates
  exactly the target's greedy output.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics

pytestmark = pytest.mark.vllm

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_target(tiny, tmp_path_factory):
    """The tiny context-dependent target with a chat template (needed for the loss mask)."""
    path = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny["target"], path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return path


def _greedy_continuations(target, prompts: list[list[int]], length: int) -> list[list[int]]:
    """What the target itself writes (so the head trains on the target's own text)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=length, do_sample=False)
            out.append(gen[0, len(p) :].tolist())
    return out


def test_trainer_features_equal_what_the_plugin_feeds_the_draft(chat_target, tiny, monkeypatch):
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.engine.proposer import EagleTreeProposer
    from eagle_vllm.train.features import load_target, target_features

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # runner in this process
    seen = []
    original = EagleTreeProposer.propose

    def recording_propose(
        self,
        num_speculative_tokens,
        target_token_ids,
        target_positions,
        target_hidden_states,
        *args,
        **kwargs,
    ):
        seen.append(
            (target_token_ids.clone(), target_positions.clone(), target_hidden_states.clone())
        )
        return original(
            self,
            num_speculative_tokens,
            target_token_ids,
            target_positions,
            target_hidden_states,
            *args,
            **kwargs,
        )

    monkeypatch.setattr(EagleTreeProposer, "propose", recording_propose)
    prompt = [5 + (7 * i) % 200 for i in range(37)]
    llm = LLM(model=str(chat_target), speculative_model=str(tiny["draft_noisy"]), **ENGINE_KW)
    try:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0))
    finally:
        shutdown(llm)
    tokens, positions, hidden = seen[0]  # the prefill step
    assert tokens.tolist() == prompt and positions.tolist() == list(range(len(prompt)))
    ours = target_features(load_target(chat_target, "float32"), [torch.tensor(prompt)])[0]
    torch.testing.assert_close(ours, hidden.float(), atol=1e-4, rtol=1e-4)


def test_train_tiny_head_loss_falls_and_loads_in_vllm(chat_target, tmp_path):
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint
    from eagle_vllm.train.main import main as train_main

    rng = random.Random(0)
    prompts = [[4 + rng.randrange(250) for _ in range(rng.randrange(4, 12))] for _ in range(48)]
    answers = _greedy_continuations(chat_target, prompts, 40)

    def words(ids):
        return " ".join(f"w{i - 4}" for i in ids if i >= 4)

    data = tmp_path / "conversations.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": words(p)},
                        {"role": "assistant", "content": words(a)},
                    ]
                }
            )
            + "\n"
            for p, a in zip(prompts, answers)
        )
    )
    out = tmp_path / "head"
    args = [
        "--target",
        str(chat_target),
        "--out",
        str(out),
        "--data",
        str(data),
        "--num-conversations",
        "48",
        "--max-steps",
        "60",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "5",
        "--tokens-per-batch",
        "512",
        "--eval-every",
        "30",
        "--log-every",
        "1",
        "--save-every",
        "30",
        "--feature-dtype",
        "float32",
        "--export-dtype",
        "float32",
        "--val-fraction",
        "0.1",
    ]
    train_main(args)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    first, last = log[0], log[-1]
    assert last["step"] == 60
    assert last["loss"] < 0.5 * first["loss"], (first, last)
    vals = [r["val_acc"] for r in log if "val_acc" in r]
    assert vals[-1] > 0.5, vals
    assert (out / "training_curves.png").stat().st_size > 1000
    info = inspect_draft_checkpoint(str(out))
    assert not info.fc_bias and info.num_layers == 1

    # Resuming after the end is a no-op that keeps the step count.
    train_main(args)
    assert json.loads((out / "config.json").read_text())["eagle_vllm"]["trained_steps"] == 60

    held_out = [{"prompt_token_ids": [4 + rng.randrange(250) for _ in range(8)]} for _ in range(6)]
    params = SamplingParams(max_tokens=32, temperature=0)
    vanilla = LLM(model=str(chat_target), **ENGINE_KW)
    expected = [o.outputs[0].token_ids for o in vanilla.generate(held_out, params)]
    shutdown(vanilla)
    llm = LLM(
        model=str(chat_target),
        speculative_model=str(out),
        speculative_config={"method": "eagle", "num_speculative_tokens": 3},
        **ENGINE_KW,
    )
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(held_out, params)]
        tau = mean_acceptance_length(spec_metrics(llm))
    finally:
        shutdown(llm)
    assert got == expected
    print(f"trained tiny head: tau={tau:.2f} (3 drafts)")
    assert tau > 1.5, tau  # a trained head is accepted (a random one gives ~1.0)

    # No fc.bias, so vLLM's own EAGLE loads it too (SafeAILab layout, stock loader).
    import vllm

    stock = vllm.LLM(
        model=str(chat_target),
        speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 3},
        **ENGINE_KW,
    )
    try:
        stock_got = [o.outputs[0].token_ids for o in stock.generate(held_out, params)]
        stock_tau = mean_acceptance_length(spec_metrics(stock))
    finally:
        shutdown(stock)
    assert stock_got == expected
    assert abs(stock_tau - tau) < 0.05, (stock_tau, tau)  # same head, same chain
