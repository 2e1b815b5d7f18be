import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from isotrain.errors import ConfigError
from isotrain.models.tokenizer import SPECIAL_TOKENS, add_special_tokens, load_tokenizer, train_tokenizer

ARITHMETIC = ["12+34=46", "999+1=1000", "7+8=15"]
PROSE = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"] * 20


def test_char_tokenizer_gives_one_token_per_character_and_never_merges_digits():
    tokenizer = train_tokenizer(ARITHMETIC, "char", vocab_size=4096)
    distinct = set("".join(ARITHMETIC)) | {"\n"}  # "\n" is written by the chat template
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(distinct)
    ids = tokenizer("1234567890+=", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == list("1234567890+=")
    assert tokenizer.decode(ids) == "1234567890+="


def test_training_is_deterministic():
    for kind in ("char", "bpe"):
        first = train_tokenizer(PROSE, kind, vocab_size=300)
        second = train_tokenizer(list(PROSE), kind, vocab_size=300)
        assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_bpe_tokenizer_learns_merges_and_rejects_a_vocab_too_small_for_bytes():
    tokenizer = train_tokenizer(PROSE, "bpe", vocab_size=300)
    assert 256 < len(tokenizer) <= 300
    ids = tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    assert len(ids) < len("the cat sat")  # merges happened
    assert tokenizer.decode(ids) == "the cat sat"
    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size=100 is too small .* use at least 263"):
        train_tokenizer(PROSE, "bpe", vocab_size=100)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_and_load_round_trip(tmp_path, kind):
    tokenizer = train_tokenizer(PROSE + ARITHMETIC + ["a . b"], kind, vocab_size=300)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "the cat 12+34=46 <|user|> sat . on"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(tokenizer, name) is not None
    assert loaded.chat_template == tokenizer.chat_template
    assert load_tokenizer(str(tmp_path)).pad_token == "<pad>"


def test_chat_template_renders_turns_and_generation_prompt():
    tokenizer = train_tokenizer(ARITHMETIC + ["hi", "sum"], "char", vocab_size=0)
    messages = [
        {"role": "system", "content": "sum"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<s><|system|>\nsum\n<|user|>\n1+1\n<|assistant|>\n2\n</s>"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nsum\n<|user|>\n1+1\n<|assistant|>\n"
    role_ids = tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"])
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert all(role_id in ids for role_id in role_ids)  # role markers are single tokens


def test_add_special_tokens_counts_only_new_ones():
    tokenizer = train_tokenizer(ARITHMETIC, "char", vocab_size=0)
    size = len(tokenizer)
    assert add_special_tokens(tokenizer, ["<tool>", "<|user|>", "<answer>"]) == 2
    assert len(tokenizer) == size + 2
    assert add_special_tokens(tokenizer, ["<tool>"]) == 0
    assert add_special_tokens(tokenizer, []) == 0
    ids = tokenizer("1<tool>2<answer>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["1", "<tool>", "2", "<answer>"]
    # Earlier special tokens stay special (skipped when decoding).
    assert "<|user|>" in tokenizer.all_special_tokens and "<tool>" in tokenizer.all_special_tokens


def test_load_tokenizer_errors_name_the_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=rf"tokenizer directory '{missing}' does not exist; set tokenizer.path"):
        load_tokenizer(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"directory '{empty}' holds no tokenizer files"):
        load_tokenizer(str(empty))


def test_load_tokenizer_sets_pad_to_eos_when_missing(tmp_path):
    trained = train_tokenizer(ARITHMETIC, "char", vocab_size=0)
    no_pad = PreTrainedTokenizerFast(tokenizer_object=trained.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    no_pad.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "</s>" and loaded.pad_token_id == loaded.eos_token_id
