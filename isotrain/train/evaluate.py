"""Exact-match accuracy of greedy generations on prompt-completion rows."""

from __future__ import annotations

import torch


@torch.no_grad()
def exact_match(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 64) -> float:
    """Fraction of rows whose greedy completion, cut at end-of-sequence and stripped, equals `completion`."""
    if not rows:
        return 0.0
    model.eval()
    tokenizer.padding_side = "left"  # generation appends on the right, so prompts are left-padded
    device = next(model.parameters()).device
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    correct = 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        encoded = [bos + tokenizer.encode(row["prompt"], add_special_tokens=False) for row in batch]
        inputs = tokenizer.pad({"input_ids": encoded}, return_tensors="pt").to(device)
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        generated = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(text.strip() == row["completion"].strip() for text, row in zip(generated, batch))
    return correct / len(rows)
