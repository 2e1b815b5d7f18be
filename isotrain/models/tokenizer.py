"""Load a local Hugging Face tokenizer, or train a small one for a freshly initialised model.

A trained tokenizer always has the same special tokens and a simple chat template, so that the
`text`, `prompt_completion` and `chat` data formats all work with it:

    ids 0..3   <unk> <s> (bos) </s> (eos) <pad>
    ids 4..6   <|system|> <|user|> <|assistant|>   (role markers of the chat template)
    then       the learned vocabulary
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path

from isotrain.errors import ConfigError

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, *ROLE_TOKENS]

# One turn is "<|role|>\ncontent\n"; assistant turns end with eos so a model learns to stop.
# The generation prompt opens an assistant turn exactly as a rendered assistant turn starts, so
# the tokens of a prompt are a prefix of the tokens of the full conversation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Files of which at least one must exist for a directory to hold a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def holds_tokenizer(directory: Path) -> bool:
    """Whether `directory` has at least one tokenizer file (a directory saved with save_pretrained does)."""
    return any((Path(directory) / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(path: str):
    """The tokenizer saved in the local directory `path`; never downloads.

    A tokenizer without a pad token gets pad = eos. That is safe here: padding positions carry
    label -100 and sit after every real token of their row, so under causal attention the pad id
    never reaches the loss; the id only has to exist in the vocabulary.
    """
    from transformers import AutoTokenizer

    directory = Path(path)
    if directory.is_file():
        raise ConfigError(f"tokenizer path {path!r} is a file; set tokenizer.path to the directory that holds it")
    if not directory.is_dir():
        raise ConfigError(
            f"tokenizer directory {path!r} does not exist; set tokenizer.path to a local tokenizer directory"
        )
    if not holds_tokenizer(directory):
        raise ConfigError(
            f"directory {path!r} holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...); "
            "set tokenizer.path to a directory saved with save_pretrained"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"tokenizer in {path!r} cannot be loaded ({err}); re-save it with save_pretrained") from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        raise ConfigError(f"the tokenizer in {path!r} has neither an eos nor a pad token; set its eos_token (the "
                          "token that ends a document, e.g. tokenizer.eos_token = '</s>') and save it with "
                          "save_pretrained")
    return tokenizer


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int):
    """A `PreTrainedTokenizerFast` trained on `texts`; the same texts always give the same tokenizer.

    kind="char": one token per distinct character (no merges, so digits never fuse — arithmetic
    tasks need that); `vocab_size` is ignored. kind="bpe": byte-level BPE of `vocab_size` tokens
    (special tokens included).
    """
    if kind == "char":
        backend = _char_backend(texts)
    elif kind == "bpe":
        backend = _bpe_backend(texts, vocab_size)
    else:
        raise ConfigError(f"tokenizer.type={kind!r} is not supported; use 'bpe' or 'char'")
    return _wrap(backend)


def _char_backend(texts: Iterable[str]):
    from tokenizers import Tokenizer, decoders, models

    # "\n" is always in the vocabulary because the chat template writes it around every turn.
    chars = sorted({"\n"}.union(*(set(text) for text in texts)) - set(SPECIAL_TOKENS))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + chars)}
    # A BPE model with no merges splits every string into single characters; characters never
    # seen in training become <unk>. No pre-tokenizer: spaces are ordinary characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return backend


def _bpe_backend(texts: Iterable[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ConfigError(
            f"tokenizer.vocab_size={vocab_size} is too small for a byte-level BPE tokenizer; "
            f"use at least {minimum} or tokenizer.type=char"
        )
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return backend


def _wrap(backend):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        # Decoding must give back the exact text (" ." must not become ".").
        clean_up_tokenization_spaces=False,
    )


def add_special_tokens(tokenizer, tokens: list[str]) -> int:
    """Register `tokens` as special tokens (kept whole, never split); returns how many are new.

    The caller resizes the model's embeddings when the count is positive. Special tokens the
    tokenizer already has stay special.
    """
    if not tokens:
        return 0
    # transformers 5 renamed the "keep the existing extra special tokens" flag.
    parameters = inspect.signature(tokenizer.add_special_tokens).parameters
    keep_flag = next(
        (name for name in ("replace_extra_special_tokens", "replace_additional_special_tokens") if name in parameters),
        None,
    )
    kwargs = {keep_flag: False} if keep_flag else {}
    return int(tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)}, **kwargs))
