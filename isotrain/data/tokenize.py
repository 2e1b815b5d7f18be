"""Turn validated rows into token ids and pre-shifted labels.

Labels are shifted here, once, so that the loss needs no shifting and a count of labels tells
exactly how many tokens are trained:

    labels[t] = input_ids[t + 1]   if token t + 1 is a target (completion, assistant turn, ...)
              = -100               otherwise, and always at the last position of a document.

A packed sequence therefore never has a label that crosses into the next document.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from jinja2 import TemplateError

IGNORE_INDEX = -100


@dataclass
class Example:
    input_ids: np.ndarray  # int64 [n]
    labels: np.ndarray  # int64 [n], pre-shifted (see module docstring)
    row_id: int  # line or row number of the source row


@dataclass
class TokenizeStats:
    num_examples: int = 0
    num_truncated: int = 0  # rows cut to max_seq_len tokens
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (row id, reason)


def tokenize_rows(rows: list[dict], row_ids: list[int], tokenizer, fmt: str, max_seq_len: int):
    """(examples, stats) for rows already validated by `sources.read_rows` for format `fmt`."""
    if fmt == "text":
        documents = _text_documents(rows, tokenizer)
    elif fmt == "prompt_completion":
        documents = _prompt_completion_documents(rows, tokenizer)
    elif fmt == "chat":
        documents = [_chat_document(row["messages"], tokenizer) for row in rows]
    else:
        raise ValueError(f"unknown data format {fmt!r}")

    stats = TokenizeStats()
    examples = []
    for row_id, document in zip(row_ids, documents):
        if isinstance(document, str):  # a reason why this row cannot be tokenized
            stats.skipped.append((row_id, document))
            continue
        ids, targets = document
        if len(ids) > max_seq_len:
            ids, targets = ids[:max_seq_len], targets[:max_seq_len]
            stats.num_truncated += 1
        labels = shifted_labels(ids, targets)
        if not (labels != IGNORE_INDEX).any():
            stats.skipped.append((row_id, f"no trained token within data.max_seq_len={max_seq_len}"))
            continue
        examples.append(Example(np.asarray(ids, dtype=np.int64), labels, row_id))
    stats.num_examples = len(examples)
    return examples, stats


def shifted_labels(ids: list[int], targets: list[bool]) -> np.ndarray:
    """labels[t] = ids[t+1] where token t+1 is a target, else -100; the last label is -100."""
    ids_array = np.asarray(ids, dtype=np.int64)
    target_array = np.asarray(targets, dtype=bool)
    labels = np.full(len(ids_array), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(target_array[1:], ids_array[1:], IGNORE_INDEX)
    return labels


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    # Special tokens are added by hand below: tokenizers disagree on whether they add bos/eos.
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _text_documents(rows: list[dict], tokenizer):
    """bos + text + eos; every token after bos is a target."""
    bos, eos = _bos(tokenizer), _eos(tokenizer)
    for tokens in _encode_many(tokenizer, [row["text"] for row in rows]):
        ids = bos + tokens + eos
        yield ids, [False] * len(bos) + [True] * (len(tokens) + len(eos))


def _prompt_completion_documents(rows: list[dict], tokenizer):
    """bos + prompt + completion + eos; only completion and eos tokens are targets.

    Prompt and completion are tokenized separately so that the boundary between them is exact
    (a merge across it would make one token half prompt, half completion).
    """
    bos, eos = _bos(tokenizer), _eos(tokenizer)
    prompts = _encode_many(tokenizer, [row["prompt"] for row in rows])
    completions = _encode_many(tokenizer, [row["completion"] for row in rows])
    for prompt, completion in zip(prompts, completions):
        ids = bos + prompt + completion + eos
        yield ids, [False] * (len(bos) + len(prompt)) + [True] * (len(completion) + len(eos))


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# What a user's Jinja chat template can raise on a conversation it does not expect (templates
# often `raise_exception(...)` on role orders they reject); such a row is skipped and reported.
_TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError, IndexError)


def _chat_document(messages: list[dict], tokenizer):
    """(ids, targets) of a conversation whose assistant turns are the targets, or a skip reason.

    The span of assistant turn i is found by rendering, not by searching for marker strings:
        prompt_i = render(messages[:i], add_generation_prompt=True)
        upto_i   = render(messages[:i + 1])
    tokens [len(prompt_i), len(upto_i)) of the full rendering are turn i (content and the
    template's end-of-turn tokens). This holds only if prompt_i is a token prefix of upto_i and
    upto_i of the full rendering; a template or tokenizer that breaks that is reported.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return "the tokenizer has no chat_template; use a tokenizer with one or data.format=text"
    try:
        full = _render(tokenizer, messages, add_generation_prompt=False)
        targets = [False] * len(full)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
            upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
            if upto[: len(prompt)] != prompt or full[: len(upto)] != upto or len(upto) == len(prompt):
                return f"chat template does not render assistant turn {i} as a token-prefix extension of the chat"
            targets[len(prompt) : len(upto)] = [True] * (len(upto) - len(prompt))
    except _TEMPLATE_ERRORS as err:
        return f"chat template failed to render the messages ({type(err).__name__}: {err})"
    return full, targets
