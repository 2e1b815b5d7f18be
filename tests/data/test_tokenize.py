import numpy as np
import pytest

from isotrain.data.tokenize import IGNORE_INDEX, shifted_labels, tokenize_rows
from isotrain.models.tokenizer import train_tokenizer

X = IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["abcdefghijklmnopqrstuvwxyz 0123456789+="], "char", vocab_size=0)


def ids(tokenizer, text):
    return tokenizer.convert_tokens_to_ids(list(text))


def test_text_labels_are_shifted_and_eos_is_trained(tok):
    [example], stats = tokenize_rows([{"text": "ab"}], [7], tok, "text", max_seq_len=16)
    a, b = ids(tok, "ab")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert example.input_ids.tolist() == [bos, a, b, eos]
    assert example.labels.tolist() == [a, b, eos, X]
    assert example.input_ids.dtype == np.int64 and example.labels.dtype == np.int64
    assert example.row_id == 7 and stats.num_examples == 1 and stats.num_truncated == 0


def test_prompt_tokens_are_masked_hand_checked(tok):
    [example], _ = tokenize_rows([{"prompt": "1+2=", "completion": "3"}], [1], tok, "prompt_completion", 16)
    one, plus, two, eq, three = ids(tok, "1+2=3")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert example.input_ids.tolist() == [bos, one, plus, two, eq, three, eos]
    # labels[t] is the target predicted at t: "3" (after "=") and eos are trained, nothing else.
    assert example.labels.tolist() == [X, X, X, X, three, eos, X]


def test_truncation_is_counted_and_keeps_the_last_label_ignored(tok):
    rows = [{"text": "abcdefghij"}, {"text": "ab"}]
    examples, stats = tokenize_rows(rows, [1, 2], tok, "text", max_seq_len=5)
    assert [len(e.input_ids) for e in examples] == [5, 4]
    assert stats.num_truncated == 1
    assert examples[0].labels.tolist() == ids(tok, "abcd") + [X]


def test_row_with_nothing_trained_after_truncation_is_skipped_and_reported(tok):
    rows = [{"prompt": "abcdefgh", "completion": "z"}, {"prompt": "a", "completion": "b"}]
    examples, stats = tokenize_rows(rows, [3, 4], tok, "prompt_completion", max_seq_len=6)
    assert [e.row_id for e in examples] == [4]
    assert stats.skipped == [(3, "no trained token within data.max_seq_len=6")]
    assert stats.num_truncated == 1


def test_chat_trains_only_assistant_turns(tok):
    messages = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    [example], stats = tokenize_rows([{"messages": messages}], [1], tok, "chat", max_seq_len=64)
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert example.input_ids.tolist() == tok(rendered, add_special_tokens=False)["input_ids"]
    targets = [int(t) for t in example.labels if t != X]
    # Each assistant turn: content, the template's "\n" and the eos that ends the turn.
    assert tok.decode(targets) == "2\n</s>4\n</s>"
    # The label at position t predicts input t+1.
    trained = np.flatnonzero(example.labels != X)
    assert (example.labels[trained] == example.input_ids[trained + 1]).all()
    assert stats.skipped == []


def test_chat_row_whose_template_breaks_prefixes_is_skipped(tok):
    broken = train_tokenizer(["abc\n:"], "char", vocab_size=0)
    # The generation prompt differs from how an assistant turn starts.
    broken.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>:' }}{% endif %}"
    )
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    examples, stats = tokenize_rows(rows, [5], broken, "chat", max_seq_len=64)
    assert examples == []
    reason = "chat template does not render assistant turn 1 as a token-prefix extension of the chat"
    assert stats.skipped == [(5, reason)]


def test_chat_masking_with_a_byte_level_bpe_tokenizer():
    bpe = train_tokenizer(["the sum of one and one is two\n"] * 30, "bpe", vocab_size=300)
    messages = [
        {"role": "user", "content": "the sum of one and one"},
        {"role": "assistant", "content": "is two"},
        {"role": "user", "content": "and one and two"},
        {"role": "assistant", "content": "the sum is"},
    ]
    [example], stats = tokenize_rows([{"messages": messages}], [1], bpe, "chat", max_seq_len=256)
    targets = [int(t) for t in example.labels if t != X]
    assert bpe.decode(targets) == "is two\n</s>the sum is\n</s>"


# Chat rows are tokenized a chunk at a time (every rendering in one batch call); this is the conversation-at-a-time
# implementation it replaced, kept as the reference the batched one must equal exactly.
def _reference_chat_document(messages, tokenizer):
    from jinja2 import TemplateError

    def render(messages, add_generation_prompt):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if getattr(tokenizer, "chat_template", None) is None:
        return "the tokenizer has no chat_template; use a tokenizer with one or data.format=text"
    try:
        full = render(messages, add_generation_prompt=False)
        targets = [False] * len(full)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = render(messages[:i], add_generation_prompt=True)
            upto = render(messages[: i + 1], add_generation_prompt=False)
            if upto[: len(prompt)] != prompt or full[: len(upto)] != upto or len(upto) == len(prompt):
                return f"chat template does not render assistant turn {i} as a token-prefix extension of the chat"
            targets[len(prompt) : len(upto)] = [True] * (len(upto) - len(prompt))
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as err:
        return f"chat template failed to render the messages ({type(err).__name__}: {err})"
    return full, targets


def _conversations(num, seed=0):
    """Conversations of 1 to 4 exchanges, some with a system turn, some ending on a user turn."""
    import random

    rng = random.Random(seed)
    words = ["the", "sum", "of", "one", "and", "two", "is", "three", "1+1", "=2"]
    say = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))  # noqa: E731
    conversations = []
    for _ in range(num):
        messages = [{"role": "system", "content": say()}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(1, 4)):
            messages += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
        conversations.append(messages[:-1] if rng.random() < 0.2 else messages)
    return conversations


_BREAKS_PREFIXES = (  # the generation prompt differs from how an assistant turn starts
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>:' }}{% endif %}"
)
_THREE = "{% if messages|length == 3 %}{{ raise_exception('no three') }}{% endif %}"
_REFUSES_THREE = (  # renders like the char tokenizer's own template, but refuses a 3-message prefix
    _THREE +
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", ["own", "breaks_prefixes", "refuses_three", "breaks_and_refuses", "none"])
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_batched_chat_equals_the_conversation_at_a_time_reference(kind, template):
    texts = ["the sum of one and two is three 1+1=2 <|:>\n"] * 30
    tokenizer = train_tokenizer(texts, kind, vocab_size=300)
    tokenizer.chat_template = {"own": tokenizer.chat_template, "breaks_prefixes": _BREAKS_PREFIXES,
                               "refuses_three": _REFUSES_THREE, "none": None,
                               "breaks_and_refuses": _THREE + _BREAKS_PREFIXES,
                               }[template]
    conversations = _conversations(120, seed=len(kind) + len(template))
    examples, stats = tokenize_rows([{"messages": m} for m in conversations], list(range(120)), tokenizer, "chat",
                                    max_seq_len=10_000)
    expected = [(row_id, _reference_chat_document(m, tokenizer)) for row_id, m in enumerate(conversations)]
    # A conversation without an assistant turn has nothing to train: skipped after tokenization.
    expected = [(row_id, doc if isinstance(doc, str) or any(doc[1]) else
                 "no trained token within data.max_seq_len=10000") for row_id, doc in expected]
    assert stats.skipped == [(row_id, doc) for row_id, doc in expected if isinstance(doc, str)]
    kept = [(row_id, doc) for row_id, doc in expected if not isinstance(doc, str)]
    assert [e.row_id for e in examples] == [row_id for row_id, _ in kept]
    for example, (_, (ids, targets)) in zip(examples, kept):
        assert example.input_ids.tolist() == ids
        assert example.labels.tolist() == shifted_labels(ids, targets).tolist()
    # Each variant exercises what it is named for.
    reasons = {reason.split(" (")[0].split(" turn")[0] for _, reason in stats.skipped} - {"no trained token within data.max_seq_len=10000"}
    assert reasons == {"own": set(), "breaks_prefixes": {"chat template does not render assistant"},
                       "refuses_three": {"chat template failed to render the messages"},
                       "breaks_and_refuses": {"chat template does not render assistant",
                                              "chat template failed to render the messages"},
                       "none": {"the tokenizer has no chat_template; use a tokenizer with one or data.format=text"},
                       }[template]
    assert len(examples) > {"own": 60, "refuses_three": 5}.get(template, -1)
