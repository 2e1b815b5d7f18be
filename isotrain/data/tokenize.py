"""Turn validated rows into token ids and pre-shifted labels.

Labels are shifted here, once, so that the loss needs no shifting and a count of labels tells
exactly how many tokens are trained:

    labels[t] = input_ids[t + 1]   if token t + 1 is a target (completion, assistant turn, ...)
              = -100               otherwise, and always at the last position of a document.

A packed sequence therefore never has a label that crosses into the next document.

A document longer than data.max_seq_len (`overflow`):
    split:    consecutive pieces ids[k·L : (k+1)·L], L = max_seq_len, each with the labels of the whole
              document at the same positions. Every token is the input of one piece and every target is the
              label of one position, once: a piece's last label is the next piece's first token (the same
              document's next token, predicted from this piece's context). Positions and attention restart
              per piece. A final piece with no target (a lone eos) is left out.
    truncate: the first L tokens (their last label -100).
    drop:     the row is skipped and reported.
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
    num_examples: int = 0  # pieces included
    num_rows: int = 0  # rows kept
    num_truncated: int = 0  # rows cut to max_seq_len tokens
    num_split: int = 0  # rows split into pieces of at most max_seq_len tokens
    corpus_tokens: int = 0  # Σ tokens of the rows that tokenized, before any cut
    corpus_trained_tokens: int = 0  # Σ targets (labels != -100) of those rows, before any cut
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (row id, reason)


def tokenize_rows(rows: list[dict], row_ids: list[int], tokenizer, fmt: str, max_seq_len: int,
                  overflow: str = "truncate"):
    """(examples, stats) for rows already validated by `sources.read_rows` for format `fmt`; a row longer than
    `max_seq_len` is split, truncated or dropped by `overflow` (module docstring)."""
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
        labels = shifted_labels(ids, targets)
        stats.corpus_tokens += len(ids)
        stats.corpus_trained_tokens += int(np.count_nonzero(labels != IGNORE_INDEX))
        pieces = _fit(np.asarray(ids, dtype=np.int64), targets, labels, max_seq_len, overflow, stats)
        if isinstance(pieces, str):
            stats.skipped.append((row_id, pieces))
            continue
        examples.extend(Example(piece, piece_labels, row_id) for piece, piece_labels in pieces)
        stats.num_rows += 1
    stats.num_examples = len(examples)
    return examples, stats


def _fit(ids: np.ndarray, targets: list[bool], labels: np.ndarray, max_seq_len: int, overflow: str,
         stats: TokenizeStats) -> list[tuple[np.ndarray, np.ndarray]] | str:
    """The row's (ids, labels) pieces within max_seq_len by `overflow` (module docstring), or why it is skipped;
    counts the split and truncated rows in `stats`. Pieces without a target are left out."""
    if len(ids) <= max_seq_len:
        pieces = [(ids, labels)]
    elif overflow == "drop":
        return f"{len(ids)} tokens > data.max_seq_len={max_seq_len} (data.overflow=drop)"
    elif overflow == "split":
        pieces = [(ids[k : k + max_seq_len], labels[k : k + max_seq_len]) for k in range(0, len(ids), max_seq_len)]
        stats.num_split += 1
    else:
        pieces = [(ids[:max_seq_len], shifted_labels(ids[:max_seq_len], targets[:max_seq_len]))]
        stats.num_truncated += 1
    pieces = [(piece, piece_labels) for piece, piece_labels in pieces if (piece_labels != IGNORE_INDEX).any()]
    return pieces or f"no trained token within data.max_seq_len={max_seq_len}"


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
