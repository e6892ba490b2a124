"""Optional: replace the dataset's answers by the target's own answers, through vLLM.

A head learns the distribution it is trained on. ShareGPT answers were written
by another model; regenerating them with the target makes the training text the
text the head will have to predict at inference (SafeAILab does the same for
its released heads). Only the first user turn is kept and answered.
"""

from __future__ import annotations

from pathlib import Path


def regenerate_answers(
    target: str | Path,
    conversations: list[list[dict]],
    *,
    max_tokens: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
) -> list[list[dict]]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target), dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=seed
    )
    try:
        tokenizer = llm.get_tokenizer()
        firsts, kept = [], []
        for conv in conversations:
            # text first: transformers 5 returns a BatchEncoding (not ids) when tokenizing
            text = tokenizer.apply_chat_template(
                conv[:1], tokenize=False, add_generation_prompt=True
            )
            prompt_len = len(tokenizer(text, add_special_tokens=False).input_ids)
            if prompt_len + 8 < max_model_len:
                firsts.append(conv[:1])
                kept.append(conv)
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed if temperature else None
        )
        outputs = llm.chat(firsts, params, use_tqdm=True)
        return [
            [conv[0], {"role": "assistant", "content": out.outputs[0].text}]
            for conv, out in zip(kept, outputs)
            if out.outputs[0].text.strip()
        ]
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
