"""Per-rank memory: an estimate from the config alone (estimate.py) and the same terms measured on a live run
(measure.py), so the two can be compared term by term (docs/memory.md)."""
