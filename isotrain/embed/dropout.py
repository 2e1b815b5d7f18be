"""Dropout keyed per sample inside padded batches: what makes `isotrain embed`'s train mode layout-free.

During one forward of a padded batch, every dropout draws row i's keep-mask over row i's REAL positions only,
from a generator seeded by (the text's seed, the dropout site, how many times that site ran in this forward).
The mask's shape depends on the text's real length L_i alone:

    activation [B, T, ...]                  -> row mask [L_i, ...]       placed at [i, real positions]
    attention probabilities [B, heads, T, T] -> row mask [heads, L_i, L_i] placed at [i, :, real, real]

(a 4-D input whose last two dims both equal the padded length T is read as attention probabilities; any other
input whose dim 1 is not T is refused, naming its site)

so a text gets the same masks whatever its batch neighbours, padded length or padding side, on any rank, in any
micro-batch or chunk, and in both passes of a GradCache step. Padding positions keep nothing; they are masked
out of attention and pooling anyway.

Sites: every `nn.Dropout` module (its forward is swapped for the keyed one while the context is open, then
restored: the model's modules are never changed for good, so save and export see the model as loaded) and every
call of `torch.nn.functional.dropout` (how transformers' eager attention drops attention probabilities; a
functional call is its own site, numbered in call order, which the model's code fixes, not the batch).
Attention dropout inside torch's fused kernel (sdpa `dropout_p`) cannot be keyed per row, so the model runs
eager attention while its attention dropout is on; a fused call with dropout left over is refused.

Activation checkpointing (train.activation_checkpointing=full) recomputes each encoder layer in backward, after the
forward's context has closed. `checkpoint_contexts` (torch.utils.checkpoint's `context_fn`) notes, as a layer's
forward starts, the keyed forward that runs it and how many times each site had run; the layer's recompute then runs
inside that forward's masks again, from those counts, so it draws exactly the masks of its first forward (a site's
mask depends on its call count, and backward recomputes the layers in reverse order).
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from isotrain.errors import ConfigError

# Config fields holding the attention-probability dropout of transformers architectures (BERT family, Llama/Qwen
# family and DistilBERT/ModernBERT, GPT-2).
ATTENTION_DROPOUT_FIELDS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")


def attention_dropout(config) -> float:
    return max((float(getattr(config, name, 0.0) or 0.0) for name in ATTENTION_DROPOUT_FIELDS), default=0.0)


def dropout_sites(model: nn.Module) -> list[tuple[str, nn.Dropout]]:
    """(name, module) of the model's dropout modules (a module's site key is its name).

    Only plain nn.Dropout is keyed: a channel-wise or alpha dropout with p > 0 is refused, naming the module."""
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if type(module) is not nn.Dropout and module.p > 0:
                raise ConfigError(f"the model's {type(module).__name__} module {name!r} cannot draw its masks per "
                                  "sample, which isotrain embed needs in train mode; set its dropout probability to 0 "
                                  "in the model's config.json")
            sites.append((name, module))
    return sites


def row_spans(attention_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(first real position, real length) of each row of a left- or right-padded [B, T] mask."""
    lengths = attention_mask.sum(dim=1).tolist()
    firsts = attention_mask.to(torch.int64).argmax(dim=1).tolist()
    return [(int(first), int(length)) for first, length in zip(firsts, lengths)]


def mask_seed(text_seed: int, site: str, call: int) -> int:
    key = f"{text_seed}/{site}/{call}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def row_keep(generator: torch.Generator, text_seed: int, site: str, call: int, shape: tuple, p: float) -> torch.Tensor:
    """One text's keep-mask at one site call: P(keep) = 1 − p, from its own stream; `shape` is the text's
    ([L, ...] or [heads, L, L] for its real length L), never the padded batch's."""
    generator.manual_seed(mask_seed(text_seed, site, call))
    return torch.rand(shape, generator=generator) >= p


class KeyedDropout:
    """The keyed masks of one padded forward: `seeds[i]` is row i's text seed, `spans[i]` its real positions."""

    def __init__(self, seeds: list[int], spans: list[tuple[int, int]], padded_len: int):
        self.seeds, self.spans, self.padded_len = seeds, spans, padded_len
        self.calls: dict[str, int] = {}
        self.num_functional = 0
        self.generator = torch.Generator()

    def replay(self) -> KeyedDropout:
        """The same masks from this point of the forward on (the sites' call counts as they are now)."""
        again = KeyedDropout(self.seeds, self.spans, self.padded_len)
        again.calls, again.num_functional = dict(self.calls), self.num_functional
        return again

    def _is_attention(self, x: torch.Tensor, where: str) -> bool:
        """True for attention probabilities [B, heads, T, T], False for an activation [B, T, ...]; else refused."""
        rows, length = len(self.seeds), self.padded_len
        if x.dim() == 4 and x.shape[0] == rows and x.shape[2] == x.shape[3] == length:
            return True
        if x.dim() >= 2 and x.shape[0] == rows and x.shape[1] == length:
            return False
        raise ConfigError(f"{where} drops out a tensor of shape {list(x.shape)}, whose dim 1 is not the sequence "
                          f"axis (batch {rows}, {length} positions), so its masks cannot be drawn per sample as "
                          "isotrain embed needs in train mode; set that dropout probability to 0 in the model's "
                          "config.json")

    def _multiplier(self, x: torch.Tensor, p: float, site: str, attention: bool) -> torch.Tensor:
        """x's dropout multiplier: 1 / (1 − p) where a row's own mask (row_keep) keeps a real position, else 0.

        A float multiplier rather than a bool mask: x · m is one pass forward and one backward, measured several
        times faster on CPU than masked_fill and scaling, for 4 bytes an element kept for backward instead of 1."""
        call = self.calls.get(site, 0)
        self.calls[site] = call + 1
        multiplier = torch.zeros(x.shape, dtype=x.dtype)
        if p >= 1.0:
            return multiplier.to(x.device)
        for row, ((first, real), seed) in enumerate(zip(self.spans, self.seeds)):
            span = slice(first, first + real)
            if attention:  # queries and keys of real positions
                multiplier[row, :, span, span] = row_keep(self.generator, seed, site, call, (x.shape[1], real, real), p)
            else:
                multiplier[row, span] = row_keep(self.generator, seed, site, call, (real, *x.shape[2:]), p)
        return multiplier.mul_(1.0 / (1.0 - p)).to(x.device)

    def apply(self, x: torch.Tensor, p: float, site: str, where: str) -> torch.Tensor:
        """Inverted dropout with the keyed masks: x · keep / (1 − p), and exactly 0 at padding positions.

        The zeros matter: eager attention gives a padded query row that sees no real key (a causal model, left
        padding) NaN probabilities, and NaN · 0 is NaN, which the next layer would read as a key."""
        attention = self._is_attention(x, where)
        out = x * self._multiplier(x, p, site, attention)
        axis = 1 if attention else 0  # the (query) position axis of one row
        for row, (first, real) in enumerate(self.spans):
            for start, count in ((0, first), (first + real, self.padded_len - first - real)):
                if count:
                    out[row].narrow(axis, start, count).zero_()
        return out

    def module_forward(self, name: str, module: nn.Dropout):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not module.training or module.p == 0:
                return x
            return self.apply(x, module.p, f"m:{name}", f"the model's dropout module {name!r}")
        return forward

    def functional(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        site = f"f:{self.num_functional}"
        self.num_functional += 1
        if not training or p == 0:
            return x
        return self.apply(x, p, site, f"a torch.nn.functional.dropout call of the model (functional site {site})")


def _refuse_fused_dropout(fused):
    def guarded(*args, dropout_p: float = 0.0, **kwargs):
        if dropout_p > 0:
            raise ConfigError("the model applies attention dropout inside torch's scaled_dot_product_attention, "
                              "whose masks cannot be drawn per sample as isotrain embed needs in train mode; set "
                              "model.attn_implementation=eager or the model's attention dropout to 0")
        return fused(*args, dropout_p=dropout_p, **kwargs)
    return guarded


_running: list[tuple[nn.Module, KeyedDropout]] = []  # the keyed forward open now (model, masks), if any


def checkpoint_contexts():
    """torch.utils.checkpoint's `context_fn` (parallel/apply.py): called as a checkpointed layer's forward starts, it
    returns (the forward's context, the recompute's); inside a keyed forward the recompute's draws the masks this
    forward draws from here on (module docstring)."""
    if not _running:
        return contextlib.nullcontext(), contextlib.nullcontext()
    model, keyed = _running[-1]
    return contextlib.nullcontext(), _keyed_sites(model, keyed.replay())


@contextlib.contextmanager
def keyed_dropout(model: nn.Module, seeds: list[int], attention_mask: torch.Tensor):
    """Inside: `model`'s forward on a padded batch (`attention_mask` [B, T]) draws every dropout mask per row,
    keyed by `seeds` (one per row). Everything swapped is restored on exit."""
    keyed = KeyedDropout(seeds, row_spans(attention_mask), attention_mask.shape[1])
    _running.append((model, keyed))
    try:
        with _keyed_sites(model, keyed):
            yield keyed
    finally:
        _running.pop()


@contextlib.contextmanager
def _keyed_sites(model: nn.Module, keyed: KeyedDropout):
    """Every dropout site of `model` draws `keyed`'s masks inside; eager attention while attention dropout is on."""
    config = getattr(model, "config", None)
    saved_kernel = None
    if model.training and config is not None and attention_dropout(config) > 0 \
            and config._attn_implementation != "eager":
        # Attention dropout sits inside the fused sdpa kernel otherwise; eager drops the probabilities through
        # torch.nn.functional.dropout, which is keyed below.
        saved_kernel, config._attn_implementation = config._attn_implementation, "eager"
    swapped = []
    for name, module in dropout_sites(model):
        swapped.append((module, module.__dict__.get("forward")))
        module.forward = keyed.module_forward(name, module)
    functional_dropout, fused = F.dropout, F.scaled_dot_product_attention
    F.dropout, F.scaled_dot_product_attention = keyed.functional, _refuse_fused_dropout(fused)
    try:
        yield keyed
    finally:
        F.dropout, F.scaled_dot_product_attention = functional_dropout, fused
        for module, own_forward in swapped:
            del module.forward
            if own_forward is not None:
                module.forward = own_forward
        if saved_kernel is not None:
            config._attn_implementation = saved_kernel
