"""Mixture-of-experts training terms: routing counts, the load-balancing (aux) loss in a global or per-micro-batch
scope, the router z-loss, the routing pre-pass and the load metrics (docs/moe.md)."""
