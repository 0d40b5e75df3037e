"""Core: pure tensor math that knows no model.

Exact sums and mergeable accumulators, the contribution geometry, bootstrap intervals and the
resampled statistics, claims and verdicts, the error types. Layer 1 of 5 (the bottom; see
`docs/architecture.md`): imports nothing else from cw_lens.
"""
