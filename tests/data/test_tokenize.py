import numpy as np
import pytest

from isotrain.data.tokenize import IGNORE_INDEX, tokenize_rows
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
