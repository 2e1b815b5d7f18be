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
from itertools import chain

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


@dataclass
class Pieces:
    """Consecutive examples as flat arrays: example e is tokens [offsets[e], offsets[e + 1]), offsets = cumsum of
    lengths. What a chunk of rows becomes, written to a store without one Python object per example."""

    input_ids: np.ndarray  # int64 [T]
    labels: np.ndarray  # int64 [T], pre-shifted per row
    lengths: np.ndarray  # int64 [E]
    row_ids: np.ndarray  # int64 [E]

    def examples(self) -> list[Example]:
        bounds = np.concatenate([[0], np.cumsum(self.lengths)]).tolist()
        return [Example(self.input_ids[a:b], self.labels[a:b], int(row_id))
                for a, b, row_id in zip(bounds[:-1], bounds[1:], self.row_ids)]


def tokenize_rows(rows: list[dict], row_ids: list[int], tokenizer, fmt: str, max_seq_len: int,
                  overflow: str = "truncate"):
    """(examples, stats) for rows already validated by `sources.read_rows` for format `fmt`; a row longer than
    `max_seq_len` is split, truncated or dropped by `overflow` (module docstring)."""
    pieces, stats = tokenize_chunk(rows, row_ids, tokenizer, fmt, max_seq_len, overflow)
    return pieces.examples(), stats


def tokenize_chunk(rows: list[dict], row_ids: list[int], tokenizer, fmt: str, max_seq_len: int,
                   overflow: str = "truncate") -> tuple[Pieces, TokenizeStats]:
    """tokenize_rows as flat arrays: the rows' (ids, targets) are concatenated, their labels shifted and their
    pieces cut with whole-array operations; only the per-row bookkeeping is a Python loop."""
    stats = TokenizeStats()
    if fmt == "text":
        ids, targets, lengths = _text_documents(rows, tokenizer)
        kept_ids = list(row_ids)
    else:
        if fmt == "prompt_completion":
            documents = list(_prompt_completion_documents(rows, tokenizer))
        elif fmt == "chat":
            documents = _chat_documents([row["messages"] for row in rows], tokenizer)
        else:
            raise ValueError(f"unknown data format {fmt!r}")
        stats.skipped = [(row_id, doc) for row_id, doc in zip(row_ids, documents) if isinstance(doc, str)]
        kept = [(row_id, doc) for row_id, doc in zip(row_ids, documents) if not isinstance(doc, str)]
        kept_ids = [row_id for row_id, _ in kept]
        lengths = np.array([len(doc[0]) for _, doc in kept], dtype=np.int64)
        ids = np.fromiter(chain.from_iterable(doc[0] for _, doc in kept), dtype=np.int64, count=int(lengths.sum()))
        targets = np.fromiter(chain.from_iterable(doc[1] for _, doc in kept), dtype=bool, count=len(ids))
    return _cut(ids, targets, lengths, kept_ids, max_seq_len, overflow, stats)


def _cut(ids: np.ndarray, targets: np.ndarray, lengths: np.ndarray, row_ids: list[int], max_seq_len: int,
         overflow: str, stats: TokenizeStats) -> tuple[Pieces, TokenizeStats]:
    """The rows' pieces within max_seq_len by `overflow` (module docstring), with the rows' shifted labels; rows
    skipped (with their reason) and rows split or truncated are counted in `stats`. Pieces without a target are
    left out."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(targets[1:], ids[1:], IGNORE_INDEX)
    labels[ends[lengths > 0] - 1] = IGNORE_INDEX  # a row's last label; never one of the next row's tokens
    trained = np.concatenate([[0], np.cumsum(labels != IGNORE_INDEX)])  # trained[t]: targets before position t
    stats.corpus_tokens += int(lengths.sum())
    stats.corpus_trained_tokens += int(trained[-1])
    piece_starts, piece_lengths, piece_rows = [], [], []
    no_target = f"no trained token within data.max_seq_len={max_seq_len}"
    for row_id, start, n in zip(row_ids, starts.tolist(), lengths.tolist()):
        if n <= max_seq_len:
            cuts = [(start, n)]
        elif overflow == "drop":
            stats.skipped.append((row_id, f"{n} tokens > data.max_seq_len={max_seq_len} (data.overflow=drop)"))
            continue
        elif overflow == "split":
            cuts = [(a, min(max_seq_len, start + n - a)) for a in range(start, start + n, max_seq_len)]
        else:
            labels[start + max_seq_len - 1] = IGNORE_INDEX  # the truncated row's last label
            cuts = [(start, max_seq_len)]
        stats.num_split += n > max_seq_len and overflow == "split"
        stats.num_truncated += n > max_seq_len and overflow == "truncate"
        cuts = [(a, m) for a, m in cuts if trained[a + m] - trained[a]
                and not (overflow == "truncate" and n > max_seq_len and trained[a + m - 1] == trained[a])]
        if not cuts:
            stats.skipped.append((row_id, no_target))
            continue
        stats.num_rows += 1
        piece_starts.extend(a for a, _ in cuts)
        piece_lengths.extend(m for _, m in cuts)
        piece_rows.extend([row_id] * len(cuts))
    stats.skipped.sort()
    piece_lengths = np.array(piece_lengths, dtype=np.int64)
    if len(piece_lengths) == len(lengths) and np.array_equal(piece_lengths, lengths):
        index = slice(None)  # every row whole: no copy
    else:
        offsets = np.cumsum(piece_lengths) - piece_lengths
        index = np.repeat(np.array(piece_starts, dtype=np.int64) - offsets, piece_lengths) + \
            np.arange(int(piece_lengths.sum()), dtype=np.int64)
    stats.num_examples = len(piece_lengths)
    return Pieces(ids[index], labels[index], piece_lengths, np.array(piece_rows, dtype=np.int64)), stats


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


def _text_documents(rows: list[dict], tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, targets, lengths) of the rows as bos + text + eos, flat; every token after bos is a target."""
    tokens, counts = _encode_flat(tokenizer, [row["text"] for row in rows])
    bos, eos = _bos(tokenizer), _eos(tokenizer)
    lengths = counts + len(bos) + len(eos)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    ids = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
    targets = np.ones(len(ids), dtype=bool)
    special = np.zeros(len(ids), dtype=bool)
    if bos:
        ids[starts], targets[starts], special[starts] = bos[0], False, True
    if eos:
        ids[ends - 1], special[ends - 1] = eos[0], True
    ids[~special] = tokens
    return ids, targets, lengths


def _encode_lists(tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text, without special tokens. A fast tokenizer's Rust backend encodes the batch on every
    core (`encode_batch_fast` skips the character offsets, which nothing here reads); its ids are the tokenizer's
    own call's, which sets the backend's truncation and padding off first, so the backend is called directly only
    when those are off."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None and texts:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
    return _encode_many(tokenizer, texts)


def _encode_flat(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of all texts concatenated, tokens per text), without special tokens (`_encode_lists`)."""
    encoded = _encode_lists(tokenizer, texts)
    counts = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    return np.fromiter(chain.from_iterable(encoded), dtype=np.int64, count=int(counts.sum())), counts


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


# What a user's Jinja chat template can raise on a conversation it does not expect (templates
# often `raise_exception(...)` on role orders they reject); such a row is skipped and reported.
_TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError, IndexError)
_NO_CHAT_TEMPLATE = "the tokenizer has no chat_template; use a tokenizer with one or data.format=text"


def _chat_documents(conversations: list[list[dict]], tokenizer) -> list:
    """[(ids, targets) of a conversation whose assistant turns are the targets, or a skip reason] per conversation.

    The span of assistant turn i is found by rendering, not by searching for marker strings:
        prompt_i = render(messages[:i], add_generation_prompt=True)
        upto_i   = render(messages[:i + 1])
    tokens [len(prompt_i), len(upto_i)) of the full rendering are turn i (content and the
    template's end-of-turn tokens). This holds only if prompt_i is a token prefix of upto_i and
    upto_i of the full rendering; a template or tokenizer that breaks that is reported.

    The templates are rendered in Python, conversation by conversation; every rendering of the chunk is then
    encoded in one batch call (on every core), and the prefix checks run on the results in the order a
    conversation-at-a-time pass would make them, so each conversation gets the same ids, targets or reason.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return [_NO_CHAT_TEMPLATE] * len(conversations)
    rendered = [_chat_renderings(messages, tokenizer) for messages in conversations]
    encoded = iter(_encode_lists(tokenizer, [text for texts, _, _ in rendered for text in texts]))
    return [_chat_targets([next(encoded) for _ in texts], turns, error) for texts, turns, error in rendered]


def _chat_renderings(messages: list[dict], tokenizer) -> tuple[list[str], list[int], str | None]:
    """(texts, assistant turns, error): texts are the full rendering, then prompt_i and upto_i of each assistant
    turn i, in order, up to the first rendering the template refused (error: its reason, else None)."""
    def render(upto: int | None, add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    texts = []
    try:
        texts.append(render(None, False))
        for i in turns:
            texts.append(render(i, True))
            texts.append(render(i + 1, False))
    except _TEMPLATE_ERRORS as err:
        return texts, turns, f"chat template failed to render the messages ({type(err).__name__}: {err})"
    return texts, turns, None


def _chat_targets(encoded: list[list[int]], turns: list[int], error: str | None):
    """(ids, targets) from the encoded renderings of `_chat_renderings`, or the first reason to skip the row: a turn
    that is not a token-prefix extension before the template's error, if any, else that error."""
    if not encoded:
        return error
    full = encoded[0]
    targets = [False] * len(full)
    for k, i in enumerate(turns[: (len(encoded) - 1) // 2]):
        prompt, upto = encoded[1 + 2 * k], encoded[2 + 2 * k]
        if upto[: len(prompt)] != prompt or full[: len(upto)] != upto or len(upto) == len(prompt):
            return f"chat template does not render assistant turn {i} as a token-prefix extension of the chat"
        targets[len(prompt) : len(upto)] = [True] * (len(upto) - len(prompt))
    return error or (full, targets)
