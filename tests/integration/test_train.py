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


def test_trainer_eagle3_features_equal_what_the_plugin_feeds_the_draft(
    chat_target, tmp_path, monkeypatch
):
    """EAGLE-3: the layer inputs the trainer caches (transformers' hidden_states[j]) equal
    the auxiliary hidden states vLLM's target forward hands the plugin's drafter."""
    from tiny_models import build_eagle3_draft
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.engine.proposer import EagleTreeProposer
    from eagle_vllm.train.features import load_target, target_features

    head = build_eagle3_draft(tmp_path / "e3", chat_target, aux_layers=(0, 1))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    seen = []
    original = EagleTreeProposer.propose

    def recording_propose(self, num_speculative_tokens, target_token_ids, target_positions,
                          target_hidden_states, *args, **kwargs):  # fmt: skip
        seen.append(target_hidden_states.clone())
        return original(self, num_speculative_tokens, target_token_ids, target_positions,
                        target_hidden_states, *args, **kwargs)  # fmt: skip

    monkeypatch.setattr(EagleTreeProposer, "propose", recording_propose)
    prompt = [5 + (7 * i) % 200 for i in range(37)]
    llm = LLM(model=str(chat_target), speculative_model=str(head), **ENGINE_KW)
    try:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0))
    finally:
        shutdown(llm)
    model = load_target(chat_target, "float32")
    _, aux = target_features(model, [torch.tensor(prompt)], layers=(0, 1))[0]
    torch.testing.assert_close(aux, seen[0].float(), atol=1e-4, rtol=1e-4)


def _write_target_conversations(chat_target, path, rng) -> None:
    """48 conversations: random prompts answered by the target itself (greedy)."""
    prompts = [[4 + rng.randrange(250) for _ in range(rng.randrange(4, 12))] for _ in range(48)]
    answers = _greedy_continuations(chat_target, prompts, 40)

    def words(ids):
        return " ".join(f"w{i - 4}" for i in ids if i >= 4)

    path.write_text(
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


def _train_on_over_more_data(chat_target, args, head, tmp_path, rng, capsys) -> None:
    """A second run over new conversations (half of them the first run's prompts answered
    again) with the first run's features beside them (--extra-features) and its head as
    the start: both caches train, the split goes by prompt, the draft vocabulary stays."""
    from safetensors.torch import load_file

    from eagle_vllm.train.main import main as train_main

    data = tmp_path / "more.jsonl"
    _write_target_conversations(chat_target, data, rng)
    first_rows = (tmp_path / "conversations.jsonl").read_text().splitlines()
    new_rows = data.read_text().splitlines()
    data.write_text("\n".join(first_rows[:24] + new_rows[:24]) + "\n")
    cut = args.index("--features-dir")
    more = args[:cut] + args[cut + 2 :]
    more[more.index(str(tmp_path / "conversations.jsonl"))] = str(data)
    more[more.index("--max-steps") + 1] = "8"
    more[more.index("--eval-every") + 1] = "8"
    out = tmp_path / "head3-more"
    with pytest.raises(SystemExit, match="--extra-features.*no meta.json"):
        train_main([*more, "--features-dir", str(tmp_path / "features-more"),
                    "--extra-features", str(tmp_path / "nowhere"), "--out", str(out)])  # fmt: skip
    capsys.readouterr()
    train_main([*more, "--features-dir", str(tmp_path / "features-more"),
                "--extra-features", str(tmp_path / "features"), "--init-from", str(head),
                "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "96 conversations from 2 feature caches" in printed, printed
    assert json.loads((out / "train_args.json").read_text())["val_split"] == "prompt"
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 8 and "val_acc_1" in log[-1], log[-1]
    assert torch.equal(load_file(str(out / "model.safetensors"))["d2t"],
                       load_file(str(head / "model.safetensors"))["d2t"])  # fmt: skip


def test_train_tiny_eagle3_head_with_ttt_loads_in_plugin_and_stock_vllm(
    chat_target, tmp_path, capsys
):
    """--arch eagle3: features of target layers (0, 1), a 3-step training-time test over a
    200-token draft vocabulary; the loss falls, per-step accuracy is logged (validation to
    step 4), ``--evaluate-only`` scores the exported head as training last did, and the
    speculators-format export drafts in the plugin's tree and in stock vLLM's eagle3 chain
    (the same chain, the same tau), both giving the target's greedy output."""
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint
    from eagle_vllm.train.main import main as train_main

    rng = random.Random(0)
    data = tmp_path / "conversations.jsonl"
    _write_target_conversations(chat_target, data, rng)
    out = tmp_path / "head3"
    args = ["--arch", "eagle3", "--aux-layers", "0,1", "--ttt-steps", "3", "--ce-vocab", "200",
            "--target", str(chat_target), "--data", str(data),
            "--num-conversations", "48", "--max-steps", "60", "--lr", "3e-3",
            "--warmup-steps", "5", "--tokens-per-batch", "512", "--eval-every", "30",
            "--log-every", "1", "--save-every", "30", "--feature-dtype", "float32",
            "--export-dtype", "float32", "--val-fraction", "0.1", "--noise", "none",
            "--features-dir", str(tmp_path / "features")]  # fmt: skip
    train_main([*args, "--out", str(out)])
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    first, last = log[0], log[-1]
    assert last["step"] == 60 and last["loss"] < 0.5 * first["loss"], (first, last)
    assert {"val_acc_1", "val_acc_2", "val_acc_3", "val_acc_4"} <= set(last), last
    assert last["val_acc_1"] > 0.5, last
    capsys.readouterr()
    scratch = tmp_path / "evaluate"
    scratch.mkdir()
    (scratch / "conversations.jsonl").write_text((out / "conversations.jsonl").read_text())
    train_main([*args, "--out", str(scratch), "--init-from", str(out), "--evaluate-only"])
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("val_loss", "val_acc_1", "val_acc_4"):
        assert scored[key] == pytest.approx(last[key], abs=1e-4), (key, scored, last)
    assert not (scratch / "train_log.jsonl").exists()
    assert (out / "training_curves.png").stat().st_size > 1000
    _train_on_over_more_data(chat_target, args, out, tmp_path, rng, capsys)
    info = inspect_draft_checkpoint(str(out))
    assert info.head_type == "eagle3" and info.speculators_format
    assert info.aux_layer_ids == (0, 1) and info.head_vocab_size == 200

    held_out = [{"prompt_token_ids": [4 + rng.randrange(250) for _ in range(8)]} for _ in range(6)]
    params = SamplingParams(max_tokens=32, temperature=0)
    vanilla = LLM(model=str(chat_target), **ENGINE_KW)
    expected = [o.outputs[0].token_ids for o in vanilla.generate(held_out, params)]
    shutdown(vanilla)
    results = {}
    for name, spec in {
        "plugin-chain": {"method": "eagle3", "num_speculative_tokens": 3,
                         "draft_sample_method": "greedy"},
        "plugin-tree": {"method": "eagle2", "num_speculative_tokens": 3, "topk": 2,
                        "total_tokens": 8},
    }.items():  # fmt: skip
        llm = LLM(model=str(chat_target), speculative_model=str(out),
                  speculative_config=spec, **ENGINE_KW)  # fmt: skip
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(held_out, params)]
            results[name] = mean_acceptance_length(spec_metrics(llm))
        finally:
            shutdown(llm)
        assert got == expected, name
    import vllm

    stock = vllm.LLM(
        model=str(chat_target),
        speculative_config={"method": "eagle3", "model": str(out), "num_speculative_tokens": 3},
        **ENGINE_KW,
    )
    try:
        stock_got = [o.outputs[0].token_ids for o in stock.generate(held_out, params)]
        results["stock-chain"] = mean_acceptance_length(spec_metrics(stock))
    finally:
        shutdown(stock)
    print(f"trained tiny EAGLE-3 head: {results}")
    assert stock_got == expected
    assert results["plugin-chain"] > 1.5, results  # a trained head is accepted
    assert abs(results["stock-chain"] - results["plugin-chain"]) < 0.05, results
    assert results["plugin-tree"] >= results["plugin-chain"] - 0.05, results


def test_train_tiny_head_loss_falls_and_loads_in_vllm(chat_target, tmp_path):
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.models.checkpoint import inspect_draft_checkpoint
    from eagle_vllm.train.main import main as train_main

    rng = random.Random(0)
    data = tmp_path / "conversations.jsonl"
    _write_target_conversations(chat_target, data, rng)
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
