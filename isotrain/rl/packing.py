"""Whether the RL trainer's forwards run packed rows, decided once per run on the run's own models.

Packed rows (experience.RowLayout) drop the padding of variable-length responses; they are exact only when
each sequence of a row sees nothing but itself. That is the question models/packing_check.py answers for
packed SFT, with the same probe here: positions suffice, or isotrain's per-document mask is needed, or
neither works. RL does not refuse the last case (its padded rows are always exact): it falls back to
padding, and says so once.

The policy and PPO's critic are probed (the critic is the policy's backbone under another head, so they
normally agree); the frozen reference is built from the policy's own config by the same builder, so the
policy's answer holds for it. All ranks run the probe with the same inputs and take the largest mismatch,
so every rank takes the same decision.
"""

from __future__ import annotations

import torch

from isotrain.errors import ConfigError
from isotrain.models.packing_check import architecture, check_packing, probe_dtype
from isotrain.rl.experience import PADDED, RowLayout


def _needs_mask(model, device: torch.device, dtype: torch.dtype) -> bool | None:
    """False: positions suffice; True: packed rows need isotrain's mask; None: packing would not be exact."""
    try:
        return check_packing(model, device, dtype)
    except ConfigError:
        return None


def row_layout(pack_sequences: bool, model_dtype: str, parallel, device: torch.device, log, model,
               critic=None) -> RowLayout:
    """The run's RowLayout: packed (with or without the document mask) when `pack_sequences` (rl.pack_sequences)
    is on and the probe finds it exact for every trained model; padded otherwise. `model_dtype`: model.dtype."""
    if not pack_sequences:
        return PADDED
    dtype = probe_dtype(model_dtype, parallel)
    decisions = [_needs_mask(m, device, dtype) for m in (model, critic) if m is not None]
    name = architecture(model)
    if None in decisions or len(set(decisions)) > 1:
        log(f"rl.pack_sequences: {name} cannot keep packed sequences apart (it ignores position-id restarts "
            "and cannot take isotrain's per-document mask); the RL forwards use padded rows")
        return PADDED
    if decisions[0]:
        log(f"rl.pack_sequences: {name} ignores position-id restarts; packed rows get isotrain's per-document "
            "attention mask (probe: packed == unpacked)")
        return RowLayout(packed=True, document_mask=True)
    log(f"rl.pack_sequences: {name} keeps packed sequences apart by their position ids (probe: packed == unpacked)")
    return RowLayout(packed=True)
