"""Load metrics of a step, from the global routing counts C_le (tokens per expert e of MoE layer l).

    expert_share[l][e] = C_le / Σ_e' C_le'          (each row sums to 1; 1/E is perfect balance)
    load_ratio         = max_l (max_e C_le / min_e C_le)   (1 is perfect; null when an expert got no token)
"""

from __future__ import annotations

from isotrain.moe.objective import RouterValues

SHARE_DECIMALS = 4  # metrics.jsonl stays compact: 4 decimals show a 0.01 % imbalance


def expert_shares(counts: list[list[int]]) -> list[list[float]]:
    return [[round(c / max(sum(row), 1), SHARE_DECIMALS) for c in row] for row in counts]


def load_ratio(counts: list[list[int]]) -> float | None:
    """The worst layer's busiest / idlest expert token count; None when some expert received no token."""
    if any(min(row) == 0 for row in counts):
        return None
    return max(max(row) / min(row) for row in counts)


def router_metrics(values: RouterValues) -> dict:
    """The metrics.jsonl fields of an MoE step."""
    return {"aux_loss": values.aux_loss, "z_loss": values.z_loss, "load_ratio": load_ratio(values.counts),
            "expert_share": expert_shares(values.counts)}
