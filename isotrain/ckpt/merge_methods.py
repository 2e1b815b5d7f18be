"""The merge methods, one tensor at a time, in closed form.

Every function takes the same-named tensor of each model (fp32, equal shapes) and returns the merged
tensor. Task vectors are τ_i = θ_i − θ_base. Randomness (DARE's drop masks) comes from a generator
seeded from (seed, tensor name, model index) only, so a tensor's result never depends on which
process merges it or in what order.

    linear          Σ w_i θ_i  (÷ Σ w_i with normalize)
    task_arithmetic θ_base + λ Σ w_i τ_i
    ties            θ_base + λ · disjoint mean of the trimmed τ_i that agree with the elected sign
    dare_linear     θ_base + λ Σ w_i · mask_i ⊙ τ_i / density_i
    dare_ties       DARE's rescaled random masks, then TIES' sign election and disjoint mean
    slerp           spherical interpolation of two models at t (linear where they are nearly parallel)
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "slerp")
NEEDS_BASE = ("task_arithmetic", "ties", "dare_linear", "dare_ties")


def tensor_generator(seed: int, name: str, index: int) -> torch.Generator:
    """A generator for model `index`'s mask of tensor `name`: the same draws on any split of the work."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def linear(tensors: list[Tensor], weights: list[float], normalize: bool) -> Tensor:
    total = sum(w * t for w, t in zip(weights, tensors))
    return total / sum(weights) if normalize else total


def task_arithmetic(base: Tensor, tensors: list[Tensor], weights: list[float], scale: float) -> Tensor:
    return base + scale * sum(w * (t - base) for w, t in zip(weights, tensors))


def trim(delta: Tensor, density: float) -> Tensor:
    """Keep the `density` fraction of entries of largest magnitude (ties broken by position), zero the rest."""
    keep = int(round(density * delta.numel()))
    if keep >= delta.numel():
        return delta
    flat = delta.flatten()
    kept = torch.zeros_like(flat)
    if keep > 0:
        # A stable sort keeps the choice among equal magnitudes deterministic.
        order = torch.sort(flat.abs(), descending=True, stable=True).indices[:keep]
        kept[order] = flat[order]
    return kept.view_as(delta)


def dare_mask(delta: Tensor, density: float, generator: torch.Generator) -> Tensor:
    """Drop each entry with probability 1 − density and rescale the survivors by 1 / density."""
    if density >= 1:
        return delta
    keep = torch.rand(delta.shape, generator=generator) < density
    return torch.where(keep, delta / density, torch.zeros_like(delta))


def _disjoint_merge(deltas: list[Tensor], weights: list[float]) -> Tensor:
    """TIES: elect each entry's sign from the weighted sum, then average the weighted deltas that agree
    with it, dividing by the weights of those that contributed."""
    weighted = torch.stack([w * d for w, d in zip(weights, deltas)])
    sign = torch.sign(weighted.sum(dim=0))
    agree = (torch.sign(weighted) == sign) & (weighted != 0)
    weight_of = torch.tensor(weights, dtype=weighted.dtype).view(-1, *([1] * deltas[0].ndim))
    divisor = (agree * weight_of).sum(dim=0)
    summed = (weighted * agree).sum(dim=0)
    return torch.where(divisor != 0, summed / torch.where(divisor != 0, divisor, 1), torch.zeros_like(summed))


def ties(base: Tensor, tensors: list[Tensor], weights: list[float], densities: list[float], scale: float) -> Tensor:
    deltas = [trim(t - base, d) for t, d in zip(tensors, densities)]
    return base + scale * _disjoint_merge(deltas, weights)


def dare(base: Tensor, tensors: list[Tensor], weights: list[float], densities: list[float], scale: float,
         name: str, seed: int, sign_election: bool) -> Tensor:
    deltas = [dare_mask(t - base, d, tensor_generator(seed, name, i))
              for i, (t, d) in enumerate(zip(tensors, densities))]
    if sign_election:
        return base + scale * _disjoint_merge(deltas, weights)
    return base + scale * sum(w * d for w, d in zip(weights, deltas))


def slerp(a: Tensor, b: Tensor, t: float, parallel_dot: float = 0.9995) -> Tensor:
    """Along the great circle from `a` to `b` (directions of the flattened tensors), lengths interpolated too:
    sin((1−t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b, with Ω the angle between them; lerp when nearly parallel."""
    a64, b64 = a.double().flatten(), b.double().flatten()
    na, nb = a64.norm(), b64.norm()
    if na == 0 or nb == 0:
        return ((1 - t) * a64 + t * b64).view_as(a).to(a.dtype)
    dot = torch.clamp((a64 / na) @ (b64 / nb), -1.0, 1.0)
    if dot.abs() > parallel_dot:
        merged = (1 - t) * a64 + t * b64
    else:
        omega = torch.arccos(dot)
        merged = (torch.sin((1 - t) * omega) * a64 + torch.sin(t * omega) * b64) / torch.sin(omega)
    return merged.view_as(a).to(a.dtype)
