"""Pipeline parallelism (parallel.pp): a Hugging Face causal LM split into stages, one per rank (1F1B, GPipe) or
several (interleaved 1F1B, the zero-bubble schedules), run by the schedules of `torch.distributed.pipelining`.

Stages. Stage s of `pp` holds the decoder layers `stage_layers(L, pp, s)`, an even split in order (the first L mod
pp stages take one more), or parallel.pp_split's count for it; the first stage also holds the input embedding, the
last the final norm and the LM head, and the loss is computed there. The model stays the Hugging Face model with its
own names, as torchtitan keeps its model and deletes what a stage does not own: the layers of other stages become
`PassThrough` (no parameters), a later stage's embedding is removed and an earlier stage's final norm is the
identity and its head a `HandOff` (those pieces: parallel/pp_stages.py; `apply_pp` cuts with them). So
`named_parameters()`, the optimizer and the checkpoint see exactly this stage's tensors under the names one process
uses, and a model built on meta materialises only them (models/build.py).

Several stages per rank (`interleaved_1f1b`, `interleaved_zb`, parallel.pp_stages_per_rank = V): the layers split
into pp·V stages and rank r holds stages r, r + pp, ... (`rank_stages`), all in its one model as above; each of its
stages runs a `stage_view` (parallel/pp_stages.py) of that model, which shares its parameters and lets the rank's
other stages' layers pass through. The V-shaped schedules (`zbv`, `dualpipev`: V = 2) place stages r and 2·pp - 1 - r
on rank r, so rank 0 holds the first and the last stage: the embedding, the final norm and the head are in its one
model (a tied weight is one weight there, with nothing to sum). The zero-bubble schedules split each backward into an
input half and a weight half (torch keeps the graph from one to the other); the gradients they accumulate are the
same sums.

Data parallelism beside it (a `pp × dp` mesh, parallel/mesh.py): the DP ranks of one stage hold the same stage and
run different micro-batches. Every stage runs the Hugging Face model's own top-level forward, so that FSDP2, which
wraps it as its root, gathers the root's tensors (embedding, final norm, head) there as it does without a pipeline;
its gradients are reduce-scattered over the stage's DP ranks at every micro-batch's backward (a sum of sums). A rank
of several stages (interleaved) cannot share one root between them: each of its stages is an FSDP2 root of its own,
the `StageModule` over that stage's view (`shard_stages`, parallel/apply.py), made once when FSDP2 is applied and
kept on the model (`stage_roots`); the schedule then gathers and frees each stage's parameters itself (its UNSHARD
and RESHARD actions), accumulates the stage's unsharded gradients over the step's micro-batches and reduce-scatters
them once, after the stage's last backward (its REDUCE_GRAD: FSDP2's post-backward, the sum over the stage's DP
ranks taken exactly once, never divided: SCALE_GRADS, and FSDP2's divide factor 1). DDP
is not wrapped around a stage (a schedule bypasses its forward): the stage's gradients are summed over its DP
replicas once, after the schedule (parallel/apply.py `sync_replica_grads`).

Tied embeddings (`tie_word_embeddings`, one weight for the input embedding and the LM head): the first stage looks
tokens up in it and the last stage computes the logits with it, so each of the two keeps a copy, under the input
embedding's name as one process names it (the last stage keeps its `embed_tokens` module, unused by its forward, whose
weight is the head's). The copies start equal, and their gradients, each stage's part of the one gradient, are summed
over the two stages (`sync_tied_grads`, over the group of the first and last stage ranks of each pipeline, as
Megatron's embedding group) before the norm and the update, so that both take the same step and stay identical; the
gradient norm counts the weight once (`tied_parameters`) and a checkpoint holds it once (checkpoint/state.py).

Math (invariant 1). The schedule runs the batch plan's gradient-accumulation micro-batches m = 1..M; the loss of
each is

    loss_m = Σ_{t ∈ m} w_t · ℓ_t / D          D = global denominator, all-reduced before the first backward

and the schedule is built with `scale_grads=False`, so the stages' gradients sum to ∇ Σ_m loss_m, the gradient of
the global mean, exactly as gradient accumulation on one process. torch's default, `scale_grads=True`, divides every
gradient once more by M: the gradient of another objective (tests/train/test_pipeline_parallel.py shows that it
fails the equivalence test).

Mixture-of-experts models. A stage's term of the objective is not a function of the last stage's logits: each
stage forms the router terms of its own MoE layers (train/pipeline_step.py) and attaches them to its output with
`with_side_loss`, whose backward gives the term the gradient 1 beside the output's own; the terms carry the global
normalisation, so the stages' terms add up to one process's. A forward-only schedule (no loss function) runs the
routing pre-pass that gives the global counts first (a several-stage schedule's order without its backward actions;
its last stage forms no logits, which the schedule would keep until its next step). A
rank of several stages (every several-stage schedule) forms each held stage's terms against that stage's own layers
(`moe_layer_rows`, `routing_stage`); under a zero-bubble schedule the output carrying them is a copy, not a view
(SPLIT_BACKWARD). A stage whose layers are all dense routes nothing and adds no term. Expert parallelism beside the
pipeline shards a stage's experts over an EP group of that stage's DP ranks (parallel/mesh.py), which run the same
schedule and so meet in the same all-to-alls.

The chunked loss (train.loss_chunk_tokens) runs inside the last stage's forward, as on one process: that stage's
output is then the micro-batch's Σ_t w_t·ℓ_t (`head_loss`, StageModule), never its logits. LoRA adds a stage's
adapters while `whole_model` (parallel/pp_stages.py) stands in the other stages' modules, so that they draw one
process's initial values.

Shapes. A stage receives activations into buffers whose shape it infers at its first micro-batch, so the micro-batches
of one step are padded to the same length (right padding, label -100: causal attention lets no real token see it,
and it trains nothing), and a stage and its schedule are built once for each shape and reused (`Pipeline`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from isotrain.parallel.dims import V_SHAPED
from isotrain.parallel.pp_stages import HandOff, PassThrough, base_model, stage_layers, stage_view, ties_embeddings

SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # the zero-bubble schedules: input and weight halves
SCALE_GRADS = False  # never rescale: each micro-batch's loss already carries the global normalisation
# parallel.pp_schedule -> its class in torch.distributed.pipelining (torch >= 2.11 has them all)
SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                    "dualpipev": "ScheduleDualPipeV"}


def rank_stages(rank: int, pp: int, per_rank: int = 1, schedule: str = "1f1b") -> list[int]:
    """The stages of the pipeline rank `rank`: `per_rank` of the pp·per_rank stages, in torch's loop order (rank r
    holds stages r, r + pp, r + 2·pp, ...), so that consecutive stages sit on consecutive ranks; or under a V-shaped
    schedule (zbv, dualpipev: two stages per rank) stages r and 2·pp - 1 - r, so that rank 0 holds the first and the
    last stage and rank pp - 1 the two in the middle, which hand on to each other without a send."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


def last_stage_rank(pp: int, schedule: str = "1f1b") -> int:
    """The pipeline rank of the last stage (final norm, head, loss): rank 0 under a V-shaped schedule, else pp - 1."""
    return 0 if schedule in V_SHAPED else pp - 1


def apply_pp(model: nn.Module, rank: int, pp: int, per_rank: int = 1, split: Sequence[int] | None = None,
             schedule: str = "1f1b") -> None:
    """Keep only this rank's stages of a causal LM (on meta or materialised), under the full model's names: the layers
    of each of its `per_rank` stages (parallel.pp_stages_per_rank; `split`: parallel.pp_split, the layers of each
    stage), the input embedding on the rank of the first stage (rank 0) and the final norm and head on the rank of the
    last (`last_stage_rank`)."""
    base = base_model(model)
    num_stages = pp * per_rank
    own = {index for stage in rank_stages(rank, pp, per_rank, schedule)
           for index in stage_layers(len(base.layers), num_stages, stage, split)}
    for index in range(len(base.layers)):
        if index not in own:
            base.layers[index] = PassThrough()
    last = last_stage_rank(pp, schedule)
    if rank > 0 and not (rank == last and ties_embeddings(model)):  # a tied head keeps its weight's first name
        base.embed_tokens = None
    if rank != last:  # the top-level forward still runs on every stage (module docstring): identities, not None
        base.norm = nn.Identity()
        model.lm_head = HandOff()


STAGE_ROOTS = "_isotrain_stage_roots"  # an attribute of the Hugging Face model, not a submodule (names unchanged)


def stage_roots(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 roots of this rank's stages (interleaved schedules beside FSDP2: one `StageModule` per stage, kept
    outside the model's module tree so that its parameter names stay one process's); [] for any other layout."""
    return model.__dict__.get(STAGE_ROOTS, [])


def keep_stage_roots(model: nn.Module, roots: list[nn.Module]) -> None:
    model.__dict__[STAGE_ROOTS] = list(roots)


def tied_parameters(model: nn.Module, stage: int, pp: int, schedule: str = "1f1b") -> list[nn.Parameter]:
    """The parameters of this stage that another stage holds a copy of: the tied embedding, on the first and the last
    stage (`model`: the Hugging Face model, FSDP2's or not). A V-shaped schedule holds both on rank 0: one weight, no
    copy."""
    if pp == 1 or schedule in V_SHAPED or stage not in (0, pp - 1) or not ties_embeddings(model):
        return []
    return [model.get_input_embeddings().weight]


def sync_tied_grads(model: nn.Module, stage: int, pp: int, group) -> None:
    """Sum the tied embedding's gradient over its two copies (`group`: this pipeline's first and last stage ranks),
    so that each holds the whole gradient. Both copies have the same layout (replicated, or the same FSDP2 or TP boxes
    on each stage's mesh, once a gradient is laid out as its weight), so the local parts are summed as they are."""
    import torch.distributed as dist

    if group is None:  # a middle stage, or a V-shaped schedule (one copy: parallel/mesh.py makes no group)
        return
    for param in tied_parameters(model, stage, pp):
        if not param.requires_grad:  # frozen (LoRA) on both stages alike
            continue
        if param.grad is None:  # (both stages use it in every micro-batch; zeros keep the collective matched)
            param.grad = torch.zeros_like(param)
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            # TP: the vocabulary-parallel lookup's gradient comes back replicated (or partial): the weight's rows first
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


class _SideLoss(torch.autograd.Function):
    """`tensor` unchanged in the forward; in the backward, `loss` receives the gradient 1 beside the tensor's own, so
    a stage's term of the objective (an MoE stage's router terms) backpropagates with the stage's backward, whatever
    the schedule (Megatron's MoEAuxLossAutoScaler, without a scale: the term carries the global normalisation)."""

    @staticmethod
    def forward(ctx, tensor, loss, copy):
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return tensor.clone() if copy else tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device), None


def with_side_loss(tensor: torch.Tensor, loss: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """`tensor`, whose backward also backpropagates the scalar `loss` (see _SideLoss); `copy`: as a tensor of its own,
    not a view (a zero-bubble schedule, SPLIT_BACKWARD, detaches a stage's outputs in place after their input half)."""
    return _SideLoss.apply(tensor, loss, copy)


class StageModule(nn.Module):
    """One stage's forward: token ids (first stage) or the previous stage's hidden states in, hidden states out, or
    the logits on the last stage (an earlier stage's head hands the hidden states on). `kwargs` (position ids, an
    attention mask) are the micro-batch's own, given to every stage by the schedule; transformers builds the causal mask and
    the rotary embeddings from them on each stage. An MoE model's micro-batch also carries `router_mask` (its input
    tokens): the stage then returns its routers' logits to the pipeline's `router_fn`, which may attach the stage's
    router terms to the output (`with_side_loss`); a stage whose layers are all dense has none and adds no term.
    With the chunked loss (train.loss_chunk_tokens) the last stage's micro-batch also carries its index,
    `micro_batch`: the last stage then runs the pipeline's `head_loss`, which computes the micro-batch's weighted loss
    sum inside the model's forward, and returns that scalar instead of the logits (which are never formed whole)."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int, per_rank: int = 1, owner=None,
                 split: Sequence[int] | None = None):
        from isotrain.parallel.ep import expert_modules

        super().__init__()
        self.model = model if per_rank == 1 else stage_view(model, stage, num_stages, split)
        self.stage, self.first, self.last = stage, stage == 0, stage == num_stages - 1
        self.owner = owner  # the Pipeline, whose router_fn and head_loss are the current step's
        self.routes = any(expert_modules(layer) for layer in base_model(self.model).layers)

    def forward(self, x: torch.Tensor, router_mask: torch.Tensor | None = None, micro_batch: int | None = None,
                **kwargs) -> torch.Tensor:
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if not self.routes:  # a stage of dense layers routes nothing and adds no term
            router_mask = None
        if router_mask is not None:
            kwargs["output_router_logits"] = True
        if micro_batch is not None and self.last and self.owner.head_loss is not None:
            output = self.owner.head_loss(self.model, inputs, kwargs, micro_batch)  # its loss: Σ_t w_t·ℓ_t
            value = output.loss
        else:
            if self.last and self.owner.forward_only:
                # The routing pre-pass needs no logits, and its schedule would keep every micro-batch's until the
                # next step (torch's fwd_cache): none are formed.
                kwargs["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=x.device)
            output = self.model(**inputs, use_cache=False, **kwargs)
            value = output.logits
        if router_mask is None:
            return value
        self.owner.routing_stage = self.stage  # whose logits these are: a rank may hold several stages
        return self.owner.router_fn(value, output.router_logits, router_mask)


class Pipeline:
    """This rank's stage of the pipeline and its schedule, built once for each shape of a step's micro-batches and
    reused by every later step of that shape.

    A stage learns the shapes of what it receives and sends by running its first micro-batch (torch's metadata
    inference: one forward and one input-gradient backward per stage, one stage after the other, and an exchange of
    shapes), which for a pipeline of `pp` stages costs about as much as `pp` micro-batches of the step. A schedule
    built for a shape therefore stays: a step whose micro-batches have a shape seen before runs on it at once. The
    last `KEPT` shapes are kept: each holds the receive buffers of its micro-batches' activations and gradients, so
    the pipeline's buffer memory is at most `KEPT` times that of one step's schedule. Every rank of a pipeline sees the
    same shapes in the same order (train/pipeline_step.py pads to the longest over DP), so its stages build and drop
    the same schedules. The loss function is the step's own, passed to the kept schedule through `_loss`."""

    KEPT = 2

    def __init__(self, stage: int, pp: int, group, schedule: str, per_rank: int = 1,
                 split: Sequence[int] | None = None):
        self.stage, self.pp, self.group, self.schedule, self.per_rank = stage, pp, group, schedule, per_rank
        self.split = split  # parallel.pp_split: the decoder layers of each stage (None: even)
        self.num_builds = 0  # how many stages and schedules this rank has built (tests read it)
        self._model: nn.Module | None = None
        self._kept: dict[tuple, object] = {}  # (micro-batches, their shape[, "forward"]) -> schedule, the newest last
        self._loss_fn: Callable | None = None
        # MoE models: router_fn(output, router_logits, router_mask) -> output, set for the run of a step's schedule;
        # `routing_stage`: the stage whose router logits the call under way carries (set by the StageModule).
        self.router_fn: Callable | None = None
        self.routing_stage: int | None = None
        # The chunked loss: head_loss(model, inputs, kwargs, micro_batch) -> the model output whose `loss` is the
        # micro-batch's Σ_t w_t·ℓ_t, run by the last stage (StageModule), set for the run of a step's schedule.
        self.head_loss: Callable | None = None
        self.forward_only = False  # set while `forward` runs the routing pre-pass: the last stage forms no logits
        self._moe_rows: tuple[dict[int, list[int]], int] | None = None
        self._views: tuple[nn.Module, list[StageModule]] | None = None  # (model, its StageModules: _stage_modules)

    @classmethod
    def of(cls, parallel) -> Pipeline | None:
        """This rank's pipeline in the run's ParallelState (parallel/mesh.py); None without pipeline parallelism."""
        dims = parallel.dims
        if dims.pp == 1:
            return None
        return cls(parallel.pp_rank, dims.pp, parallel.pp_group, dims.pp_schedule, dims.pp_stages_per_rank,
                   dims.pp_split)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(logits, target)

    def _stages(self, model: nn.Module, device: torch.device) -> list:
        from torch.distributed.pipelining import PipelineStage

        num_stages = self.pp * self.per_rank
        # (a V-shaped schedule tells its stages their ranks itself, as the forward-only `_v_forwards` does)
        stages = rank_stages(self.stage, self.pp, self.per_rank, self.schedule)
        modules = stage_roots(model) or self._stage_modules(model)
        for module in modules:
            module.owner = self
        return [PipelineStage(module, stage, num_stages, device, group=self.group)
                for module, stage in zip(modules, stages, strict=True)]

    def _stage_modules(self, model: nn.Module) -> list[StageModule]:
        """This rank's StageModules over `model`, made once for it and kept: a stage view (several stages per rank)
        is a model of its own to transformers, which hooks its output recorders (an MoE model's router logits) into
        the view's layers at its first forward; a second view of the same layers would record them twice."""
        if self._views is None or self._views[0] is not model:
            num_stages = self.pp * self.per_rank
            self._views = (model, [StageModule(model, stage, num_stages, self.per_rank, self, self.split)
                                   for stage in rank_stages(self.stage, self.pp, self.per_rank, self.schedule)])
        return self._views[1]

    def _build(self, model: nn.Module, num_microbatches: int, device: torch.device, backward: bool = True):
        """A stage and schedule for `num_microbatches`; `backward=False`: forward only (no loss function)."""
        import torch.distributed.pipelining as pipelining

        self.num_builds += 1
        stages = self._stages(model, device)
        loss_fn = self._loss if backward else None
        schedule = getattr(pipelining, SCHEDULE_CLASSES[self.schedule])
        runner = schedule(stages if self.per_rank > 1 else stages[0], n_microbatches=num_microbatches,
                          loss_fn=loss_fn, scale_grads=SCALE_GRADS)
        if not backward and self.per_rank > 1:
            _forwards_only(runner)
        return runner

    def _use(self, model: nn.Module) -> None:
        """What is kept belongs to one model: another one starts afresh."""
        if model is not self._model:
            self._model, self._kept, self._moe_rows = model, {}, None

    def _runner(self, model: nn.Module, kwargs: list[dict], device: torch.device, backward: bool = True):
        """The kept schedule for these micro-batches' count and shape (their position ids', which every stage has;
        built when new; the oldest dropped)."""
        self._use(model)
        key = (len(kwargs), tuple(kwargs[0]["position_ids"].shape)) + (() if backward else ("forward",))
        runner = self._kept.pop(key, None) or self._build(model, len(kwargs), device, backward)
        self._kept[key] = runner
        same_kind = [k for k in self._kept if (k[-1] == "forward") == (not backward)]
        for old in same_kind[:-self.KEPT]:  # KEPT of each kind (an MoE model's pre-pass has its own schedules)
            del self._kept[old]
        return runner

    def moe_layer_rows(self, model: nn.Module) -> tuple[dict[int, list[int]], int]:
        """({each stage of this rank: the rows of its MoE layers among all MoE layers of the model}, their number L),
        in layer order, as one process's router logits come: each stage's layers with experts, gathered over the
        pipeline once."""
        self._use(model)
        if self._moe_rows is None:
            import torch.distributed as dist

            from isotrain.parallel.ep import expert_modules

            layers = base_model(model).layers
            num_stages = self.pp * self.per_rank
            local = {stage: [index for index in stage_layers(len(layers), num_stages, stage, self.split)
                             if expert_modules(layers[index])]
                     for stage in rank_stages(self.stage, self.pp, self.per_rank, self.schedule)}
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, sorted(i for indices in local.values() for i in indices), group=self.group)
            every = sorted(index for indices in gathered for index in indices)
            self._moe_rows = ({stage: [every.index(i) for i in indices] for stage, indices in local.items()},
                              len(every))
        return self._moe_rows

    def forward(self, model: nn.Module, inputs: list[torch.Tensor] | None, kwargs: list[dict], router_fn: Callable,
                device: torch.device) -> None:
        """Run the forward passes of every micro-batch through the pipeline, without gradient: an MoE model's routing
        pre-pass, which sees each stage's router logits through `router_fn` (kwargs carry the `router_mask`).
        `inputs` as in `backward`."""
        runner = self._runner(model, kwargs, device, backward=False)
        self.router_fn, self.forward_only = router_fn, True
        try:
            with torch.no_grad():
                _step_split(runner, self._arg_mbs(inputs, kwargs, device), kwargs)
        finally:
            self.router_fn, self.forward_only = None, False

    def _arg_mbs(self, inputs: list[torch.Tensor] | None, kwargs: list[dict], device: torch.device) -> list[tuple]:
        return [(x.to(device),) for x in inputs] if self.stage == 0 else [()] * len(kwargs)

    def backward(self, model: nn.Module, inputs: list[torch.Tensor] | None, kwargs: list[dict],
                 targets: list[torch.Tensor] | None, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, router_fn: Callable | None = None, head_loss: Callable | None = None) -> None:
        """Run the forward and backward passes of every micro-batch through the pipeline, accumulating this stage's
        gradients. `inputs`: the micro-batches' token ids (read by the first stage alone; None on a rank without
        it); `kwargs`: each micro-batch's forward arguments, its position ids all of one shape;
        `loss_fn(logits, target)`: the last stage's loss of the micro-batch whose `targets` entry (None on a rank
        without the last stage) is `target`, already divided by the global denominator (torch also calls it once, when a
        schedule is built, on a copy of the first target and uninitialised logits). The schedule never rescales
        (SCALE_GRADS, read when a schedule is built, so that a test can show what rescaling would do). `router_fn`:
        an MoE model's, which attaches each stage's router terms of each micro-batch (StageModule). `head_loss`: the
        chunked loss's, which the last stage runs for the micro-batches whose kwargs carry `micro_batch`
        (StageModule); `loss_fn` then receives that stage's output, the micro-batch's weighted loss sum."""
        runner = self._runner(model, kwargs, device)
        self._loss_fn, self.router_fn, self.head_loss = loss_fn, router_fn, head_loss
        try:
            _step_split(runner, self._arg_mbs(inputs, kwargs, device), kwargs, targets)
        finally:
            self._loss_fn = self.router_fn = self.head_loss = None

    @torch.no_grad()
    def logits(self, model: nn.Module, input_ids: torch.Tensor, kwargs: dict, device: torch.device
               ) -> torch.Tensor | None:
        """One forward of one batch through every stage, without gradients (the packing probe,
        models/packing_check.py): the logits on the rank of the last stage, None on the others. `input_ids` is read
        by the first stage; `kwargs` (position ids, an attention mask) reach every stage, as in training. Its stages
        and forward-only schedule (GPipe, or breadth-first over a rank's several stages) are built for this call
        and dropped: the training schedules and their count (`num_builds`) are untouched. The batch goes in whole
        (one micro-batch), the form every torch version's `eval` takes."""
        from torch.distributed.pipelining import ScheduleGPipe, ScheduleLoopedBFS

        if self.schedule in V_SHAPED:
            return self._v_logits(model, input_ids, kwargs, device)
        stages = self._stages(model, device)
        schedule = (ScheduleGPipe(stages[0], n_microbatches=1) if len(stages) == 1
                    else ScheduleLoopedBFS(stages, n_microbatches=1))
        return schedule.eval(*((input_ids.to(device),) if self.stage == 0 else ()), **kwargs)

    def _v_logits(self, model: nn.Module, input_ids: torch.Tensor, kwargs: dict, device: torch.device
                  ) -> torch.Tensor | None:
        """`logits` through a V (zbv, dualpipev), sent by hand: torch's V schedules cannot run forward only (their
        order holds backwards, which a stage without backward refuses to hand to its neighbour on the same rank), and
        LoopedBFS places stages in a loop. Rank r runs stage r on what rank r - 1 sent (rank 0: the tokens) and sends
        it on to r + 1; the last rank turns back at once, the others run stage 2·pp - 1 - r on what r + 1 sent back
        and send it to r - 1; rank 0 ends with the logits. Every hidden state has the shape [B, L, hidden] and the
        dtype of the weights (no autocast here, as in `eval`)."""
        import torch.distributed as dist

        num_stages, rank = 2 * self.pp, self.stage
        down, up = self._stage_modules(model)  # stages rank and num_stages - 1 - rank
        peer = lambda r: dist.get_global_rank(self.group, r)  # noqa: E731
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        shape = (*kwargs["position_ids"].shape, model.config.hidden_size)
        hidden = input_ids.to(device)
        if rank > 0:
            dist.recv(hidden := torch.empty(shape, dtype=dtype, device=device), peer(rank - 1), group=self.group)
        hidden = down(hidden, **kwargs)
        if rank < self.pp - 1:
            dist.send(hidden.contiguous(), peer(rank + 1), group=self.group)
            dist.recv(hidden := torch.empty(shape, dtype=dtype, device=device), peer(rank + 1), group=self.group)
        output = up(hidden, **kwargs)
        if rank > 0:
            dist.send(output.contiguous(), peer(rank - 1), group=self.group)
            return None
        return output


FORWARD_ACTIONS = ("FORWARD", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")  # torch's _ComputationType names


def _forwards_only(runner) -> None:
    """Keep only the forward actions (and their sends, receives, FSDP2 gathers) of a several-stage schedule's order:
    its forward-only run (an MoE model's routing pre-pass). A V-shaped order's backwards would hand an input gradient
    from one stage to the other on the same rank, which a stage without backward has not; each forward still follows
    the one before it as in the full order, so the forwards meet in the same sends and receives."""
    order = runner.pipeline_order_with_comms  # (torch's runtime schedules: the per-rank actions it runs)
    for rank, actions in order.items():
        # (dualpipev overlaps a forward with a backward in one action: its forward stays)
        unpacked = [sub for action in actions
                    for sub in (action.sub_actions if action.computation_type.name == "OVERLAP_F_B" else (action,))]
        order[rank] = [action for action in unpacked if action.computation_type.name in FORWARD_ACTIONS]


def _step_split(runner, arg_mbs: list[tuple], kwarg_mbs: list[dict], target_mbs: list | None = None) -> None:
    """One schedule step over micro-batches already split. A newer torch (2.14 here) takes them in `step`; torch 2.11
    (the GPU machine's) only splits whole batches there, so the micro-batches go to the schedule's
    `_step_microbatches` after what its `step` does first: the backward flag on each stage, the stage state cleared."""
    if "arg_mbs" in inspect.signature(runner.step).parameters:
        runner.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, return_outputs=False)
        return
    for stage in getattr(runner, "_stages", None) or [runner._stage]:
        stage.has_backward = runner._has_backward
        stage.clear_runtime_states()
    runner._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, None, False)
