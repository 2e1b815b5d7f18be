"""The bundled task: two-number addition as prompt-completion rows ("37+48=" -> "85").

Held-out evaluation pairs never occur in the training rows, so exact match measures learning,
not memorisation; chance level is about 1/199 for two-digit operands. Regenerate the shipped
files with `python -m isotrain.tasks.arithmetic`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from isotrain.recipes import RECIPES_DIR


def addition_rows(max_operand: int = 99, num_eval: int = 200, seed: int = 0) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in pairs]
    return rows[num_eval:], rows[:num_eval]


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    train_rows, eval_rows = addition_rows()
    write_jsonl(train_rows, RECIPES_DIR / "data" / "addition_train.jsonl")
    write_jsonl(eval_rows, RECIPES_DIR / "data" / "addition_eval.jsonl")
    print(f"wrote {len(train_rows)} training and {len(eval_rows)} held-out rows to {RECIPES_DIR / 'data'}")


if __name__ == "__main__":
    main()
