"""Structured head pruning (P2): ΔPPL when heads are removed in taxonomy, magnitude, entropy or
random order.

Mudarisov, Burtsev, Petrova, State, "Geometric Analysis of Token Selection in Multi-Head
Attention" (arXiv 2602.01893); the formulas and the readings fixed where the paper is open are
those of methods § Token selection (docs/methods.md#selection).

**Head pruning.** Heads are removed by zeroing their `hook_z`
([`cw_lens.remove_heads`][cw_lens.remove_heads]) at retention levels (the fraction of heads kept;
`floor((1 - r) n + 1/2)` of the `n` heads are removed) in four orders:

- `taxonomy` — Resets first, then Mixers, Retrievers last; within a class the smallest mean
  head-output norm `||o_i^h||` first;
- `magnitude` — `||W_V^h||_F ||W_O^h||_F` smallest first (`W_V` of a query head is its kv
  head's);
- `entropy` — mean attention entropy `-sum_j alpha log alpha` over the counted queries,
  highest first;
- `random` — seeded permutations (`n_random` of them; the mean and each are reported).

Ties in every order go to the smaller (layer, head). `scope="layer"` (default, methods § Token
selection (docs/methods.md#selection)) removes the same fraction from every layer, ranked within the
layer — raw output norms are not comparable across layers (layer 0's are ~10x smaller on SmolLM2, so
a global ranking removes layer 0 first); `scope="global"` (a variant) removes the first heads of
one ranking of all heads. `ΔPPL = PPL(pruned) - PPL(clean)` (and `ΔNLL`, the change of the mean
next-token NLL) on the same corpus. The cost of removing each head alone is measured on a small
corpus (first `lone_docs` documents cut to `lone_tokens` tokens), several heads per forward pass
(each on its own copy of the rows).

Streaming, exact merging and weights as in `cw_lens.analyses.selection`.

The public functions' docstrings have runnable examples.
"""

from cw_lens.analyses.pruning.lone_heads import (
    lone_head_costs,
)
from cw_lens.analyses.pruning.orders import (
    AGGRESSIVE,
    MODERATE,
    ORDERS,
    RETENTION,
    Head,
    head_magnitudes,
    n_removed,
    pruning_rankings,
    removed_heads,
    weight_magnitude,
)
from cw_lens.analyses.pruning.prune import (
    LEARNT,
    MIN_RANDOM_DRAWS,
    PruningResult,
    prune_heads,
)
from cw_lens.core.deprecation import moved_attributes

__all__ = [
    "AGGRESSIVE",
    "LEARNT",
    "MIN_RANDOM_DRAWS",
    "MODERATE",
    "ORDERS",
    "RETENTION",
    "Head",
    "PruningResult",
    "head_magnitudes",
    "lone_head_costs",
    "n_removed",
    "prune_heads",
    "pruning_rankings",
    "removed_heads",
    "weight_magnitude",
]


# names of 0.4 that moved to the reproduction layer in 0.5 (until 0.6; not in __all__)
__getattr__ = moved_attributes(
    "cw_lens.analyses.pruning",
    {
        "pruning_claim": "cw_lens.reproduction.pruning_claims",
    },
)
