"""Mistakes about the model, its files and its sequence lengths: each is one sentence, before any training step.

Refusals come before any work, so they run in this process through the CLI's own entry point (exit code and
stderr as a user sees them); runs that must train are real `isotrain` processes, side by side."""

from __future__ import annotations

import functools
import json
import subprocess

import pytest
import yaml

from helpers import HANG_S, TINY_RUN, assert_error_sentence, run_concurrently
from zygote import fork_ranks, run_isotrain, shared_zygote
from test_cli_errors import TINY_RL

FIRST_STEP = [*TINY_RUN, "train.max_steps=1"]

# name -> (overrides, the exact sentence after "error: ")
REFUSED = {
    "encoder model": (["model.config.model_type=bert"],
                      "model_type 'bert' of model.config is an encoder whose attention sees later tokens, so it would "
                      "not learn to predict the next token; use a decoder model type such as llama, qwen2 or qwen3"),
    "no causal class": (["model.config.model_type=t5"],
                        "model_type 't5' of model.config has no causal-LM class in transformers; isotrain trains "
                        "causal LMs: use a decoder model type such as llama, qwen2 or qwen3"),
    "no layers": (["model.config.num_hidden_layers=-1"],
                  "model.config.num_hidden_layers=-1 is invalid; set it to at least 1"),
    "heads do not divide hidden": (["model.config.num_attention_heads=5"],
                                   "model.config is invalid: the hidden size (64) is not a multiple of the number of "
                                   "attention heads (5); fix model.config"),
    "kv heads do not divide heads": (["model.config.num_key_value_heads=3"],
                                     "model.config.num_attention_heads=4 is not divisible by num_key_value_heads=3; "
                                     "choose a number of key/value heads that divides the number of heads"),
    "sequence beyond positions": (["model.config.max_position_embeddings=8", "data.max_seq_len=16"],
                                  "data.max_seq_len=16 is more than the 8 positions of model.config "
                                  "(max_position_embeddings); lower data.max_seq_len to at most 8 or raise "
                                  "model.config.max_position_embeddings"),
    "sdpa where the model has none": (["model.config.model_type=gemma2", "model.config.head_dim=16",
                                       "model.attn_implementation=sdpa"],
                                      "model.attn_implementation='sdpa' is not supported by gemma2 models in "
                                      "transformers; set model.attn_implementation=eager or leave it unset"),
    "eval prompt beyond positions": (["eval.path=isotrain/recipes/data/addition_eval.jsonl",
                                      "eval.max_new_tokens=60"],
                                     "the prompt '97+70=' of eval.path='isotrain/recipes/data/addition_eval.jsonl' "
                                     "has 7 tokens, and with eval.max_new_tokens=60 its sequence reaches 67, more "
                                     "than the model's 64 positions; lower eval.max_new_tokens or remove the longest "
                                     "prompts"),
    "tensor parallel on one process": (["parallel.tp=2"],
                                       "parallel.tp=2 needs a multiple of 2 processes, but 1 process was launched; "
                                       "launch a multiple of 2 (torchrun --nproc-per-node 2) or lower that degree"),
    "ignore_keys without load_only": (["checkpoint.ignore_keys=[lm_head.*]"],
                                      "checkpoint.ignore_keys applies to a partial start "
                                      "from a checkpoint's weights; set checkpoint.load_only=model too (a full "
                                      "resume restores every tensor)"),
}


def _tokenizer_without_eos_or_pad(directory) -> str:
    from isotrain.models.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["1+1=2", "2+2=4"], "char", 0)
    tokenizer.eos_token = None
    tokenizer.pad_token = None
    tokenizer.save_pretrained(directory)
    return str(directory)


def cli(capsys, argv: list[str]) -> subprocess.CompletedProcess:
    """`isotrain <argv>` in this process: its exit code, stdout and stderr."""
    from isotrain.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, exited.value.code, out.out, out.err)


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_before_any_step(capsys, tmp_path, name):
    assert_error_sentence(cli(capsys, ["train", *FIRST_STEP, *REFUSED[name][0], f"output_dir={tmp_path}"]),
                          REFUSED[name][1])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_missing_eval_file_is_named_as_such_before_training(capsys, tmp_path):
    proc = cli(capsys, ["train", *FIRST_STEP, "eval.path=/nonexistent/eval.jsonl", f"output_dir={tmp_path}"])
    assert_error_sentence(proc, "eval.path '/nonexistent/eval.jsonl' does not exist; point eval.path at a .jsonl, "
                          ".jsonl.gz, .json or .parquet file, a glob or directory of such shards, or a "
                          "directory saved with datasets.save_to_disk")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_broken_config_json_is_named_not_blamed_on_the_tokenizer(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": \n')
    proc = cli(capsys, ["train", *FIRST_STEP, "model.config=null", f"model.name_or_path={tmp_path}",
                        f"output_dir={tmp_path / 'run'}"])
    assert_error_sentence(proc, f"{tmp_path / 'config.json'} is not valid JSON (Expecting value: line 2 column 1 "
                          "(char 40)); fix the file or re-save the model with save_pretrained")


def test_a_tokenizer_without_eos_or_pad_is_refused(capsys, tmp_path):
    path = _tokenizer_without_eos_or_pad(tmp_path / "tokenizer")
    proc = cli(capsys, ["train", *FIRST_STEP, f"tokenizer.path={path}", f"output_dir={tmp_path / 'run'}"])
    assert_error_sentence(proc, f"the tokenizer in {path!r} has neither an eos nor a pad token; set its eos_token "
                          "(the token that ends a document, e.g. tokenizer.eos_token = '</s>') and save it with "
                          "save_pretrained")


def test_config_show_refuses_world_size_zero(capsys):
    assert_error_sentence(cli(capsys, ["config", "show", "--world-size", "0"]),
                          "--world-size 0 is invalid; pass the number of processes, 1 or more")


def test_an_rl_prompt_and_its_response_must_fit_data_max_seq_len(capsys, tmp_path):
    from isotrain.recipes import default_rl_recipe_path

    recipe = yaml.safe_load(default_rl_recipe_path().read_text())
    data_path = str((default_rl_recipe_path().parent / recipe["data"]["path"]).resolve())
    proc = cli(capsys, [*TINY_RL, "data.max_seq_len=10", "rl.max_new_tokens=5", f"output_dir={tmp_path}"])
    assert_error_sentence(proc, f"the prompt '70+82=' of data.path={data_path!r} has 7 tokens, and with "
                          "rl.max_new_tokens=5 its sequence reaches 12, more than data.max_seq_len=10; lower "
                          "rl.max_new_tokens or remove the longest prompts")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs that must work: the default data.max_seq_len shrinks to a small model; Gemma2 gets eager attention."""
    from isotrain.recipes import RECIPES_DIR, default_recipe_path

    root = tmp_path_factory.mktemp("early")
    recipe = yaml.safe_load(default_recipe_path().read_text())
    del recipe["data"]["max_seq_len"]  # left at its default (512)
    recipe["model"]["config"] = {"model_type": "gpt2", "n_positions": 8, "n_embd": 64, "n_layer": 2, "n_head": 4}
    for section in ("data", "eval"):
        recipe[section]["path"] = str(RECIPES_DIR / recipe[section]["path"])
    gpt2 = root / "gpt2.yaml"
    gpt2.write_text(yaml.safe_dump(recipe))
    commands = {
        "gpt2 with 8 positions": ["train", str(gpt2), *FIRST_STEP, f"output_dir={root / 'gpt2'}"],
        "gemma2 by default": ["train", *FIRST_STEP, "model.config.model_type=gemma2", "model.config.head_dim=16",
                              f"output_dir={root / 'gemma2'}"],
    }
    result = run_concurrently({name: functools.partial(run_isotrain, command) for name, command in commands.items()})
    result["root"] = root
    return result


def test_the_default_max_seq_len_fits_a_small_model(runs):
    proc = runs["gpt2 with 8 positions"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((runs["root"] / "gpt2" / "config.yaml").read_text())
    assert saved["data"]["max_seq_len"] == 8


def test_gemma2_trains_with_eager_attention_by_default(runs):
    proc = runs["gemma2 by default"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((runs["root"] / "gemma2" / "model" / "config.json").read_text())
    assert config["model_type"] == "gemma2"


def test_a_first_save_that_fails_does_not_claim_earlier_checkpoints(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(20)))
    run_dir = tmp_path / "run"
    # The model file (~300 KB) exceeds the limit; the tokenizer, data cache and config files do not. The run is
    # forked from the zygote, which sets that file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) in it alone.
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    forked = fork_ranks(shared_zygote(), 1, ["train", *FIRST_STEP, "data.format=prompt_completion",
                                             f"data.path={data}", f"output_dir={run_dir}", "checkpoint.every_steps=1"],
                        [out], max_file_bytes={0: 100_000}, errs=[err])
    forked.finish(HANG_S)
    stderr = err.read_text()
    assert forked.exit_codes() == [2] and "Traceback" not in stderr, stderr[-3000:]
    message = " ".join(stderr.split())
    assert message.startswith(f"error: checkpoint step 1 was not saved: rank 0 could not write {run_dir}"), message
    assert message.endswith("(File too large); free disk space or fix the path"), message


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("qwen2") / "run"
    proc = run_isotrain(["train", *FIRST_STEP, "model.config.model_type=qwen2", "checkpoint.every_steps=1",
                         f"output_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir / "checkpoints" / "step-00000001"


def test_load_only_checks_names_both_ways_and_ignore_keys_loads_the_rest(qwen2_checkpoint, tmp_path):
    """Qwen2 has attention biases a Llama of the same sizes lacks: dropping them silently would start the run
    from a different function than the checkpoint's."""
    common = ["train", *FIRST_STEP, f"checkpoint.resume={qwen2_checkpoint}", "checkpoint.load_only=model"]
    runs = run_concurrently({
        "strict": functools.partial(run_isotrain, [*common, f"output_dir={tmp_path / 'strict'}"]),
        "ignored": functools.partial(run_isotrain, [*common, "checkpoint.ignore_keys=['*_proj.bias']",
                                                    f"output_dir={tmp_path / 'ignored'}"]),
    })
    assert_error_sentence(runs["strict"], f"checkpoint {qwen2_checkpoint} holds 6 tensor(s) the model does not "
                          "have, first 'model.layers.0.self_attn.k_proj.bias'; it was saved from a different model: "
                          "resume with the checkpoint's model.config or set checkpoint.resume=never, or list them in "
                          "checkpoint.ignore_keys to load the rest on purpose")
    proc = runs["ignored"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensors matching checkpoint.ignore_keys keep their fresh values" in proc.stdout
    # What was loaded is the checkpoint's: the embedding (trained one step from the same seed's init) matches.
    from safetensors.torch import load_file

    saved = load_file(qwen2_checkpoint / "model.safetensors")
    assert not any(name.endswith("_proj.bias") for name in load_file(tmp_path / "ignored" / "checkpoints" /
                                                                      "step-00000001" / "model.safetensors"))
    assert sum(name.endswith("_proj.bias") for name in saved) == 6


def test_packing_is_refused_for_rl(capsys, tmp_path):
    assert_error_sentence(cli(capsys, [*TINY_RL, "data.packing=true", f"output_dir={tmp_path}"]),
                          "data.packing=true does not apply to RL, whose rows are one prompt and its sampled response "
                          "each; remove data.packing from the RL config")


def test_a_chunked_loss_is_refused_for_rl(capsys, tmp_path):
    assert_error_sentence(cli(capsys, [*TINY_RL, "train.loss_chunk_tokens=64", f"output_dir={tmp_path}"]),
                          "train.loss_chunk_tokens=64 applies to the SFT cross-entropy only, and RL's losses are not "
                          "chunked; remove train.loss_chunk_tokens from the RL config")


def test_a_chunked_loss_is_refused_for_embed(capsys, tmp_path):
    bert = ["model.config.model_type=bert", "model.config.hidden_size=32", "model.config.num_hidden_layers=1",
            "model.config.num_attention_heads=2", "model.config.intermediate_size=64", "eval.path=null"]
    assert_error_sentence(cli(capsys, ["embed", *bert, "train.loss_chunk_tokens=64", f"data.path={tmp_path / 'x.jsonl'}",
                                       f"output_dir={tmp_path / 'run'}"]),
                          "train.loss_chunk_tokens=64 applies to the SFT cross-entropy only, and isotrain embed has no "
                          "vocabulary logits; remove train.loss_chunk_tokens")
    assert not (tmp_path / "run").exists()
