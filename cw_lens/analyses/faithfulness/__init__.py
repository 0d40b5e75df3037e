"""Faithfulness (P1's causal test): do the tokens a metric ranks highest really matter?

Protocol (docs/methods.md#faithfulness; Cunningham & Muca Cirone, ICML 2026, and the
comprehensiveness/sufficiency tests of DeYoung et al. 2020):

1. A clean pass scores every (head, key) pair of every query at every layer with each metric —
   `attention` alpha, `value_norm` alpha ||pv_j||, `value_norm_output`
   alpha ||pv_j|| / ||o_i^h||, `contribution` (inter-head C[i,j]^h), and a seeded `random`
   score — streamed one layer at a time.
2. Per (layer, query `i`) the `H (i + 1)` pairs `(h, j <= i)` are ranked by importance
   `|score|` (`ranking="signed"`: by the score itself; ties go to the lower head, then key).
   *Comprehensiveness* removes the top `k` share, *sufficiency* the bottom `k` share, for
   `k` in {1, 2, 5, 10, 20, 50}% (at least one pair when `k` rounds to zero). Query 0 is
   never intervened on (`first_query=1`): it reads only itself, so the at-least-one rule would
   remove the sink's own output in every layer, which every later query reads.
3. Removal sets `alpha[i,j]^h = 0` for the chosen pairs in every layer at once, without
   renormalising — exactly subtracting `alpha[i,j]^h pv_j^h` from `o_i`.
4. On text: the change of the mean next-token NLL over scored positions (`delta_nll`; the
   perplexity change `delta_ppl = PPL' - PPL`). On task items: the drop of the correct
   answer's log-probability and the accuracy.
5. Curves per metric and mode, and the area over them — AOPC, the mean change over the
   fraction grid — with the clean PPL and the random ranking as controls.
6. `granularity="tokens"`: per (layer, query) each metric is summed over heads into one score
   per key token (`token_scores`; for the inter contribution, the token's share of the
   layer output), and the chosen tokens are removed from every head.

P1's claim (docs/methods.md#claims `faithfulness_order`) is judged from these AOPCs in
`cw_lens.reproduction.faithfulness_claims`.

Example:

    import cw_lens
    model = cw_lens.load_model()
    corpus = cw_lens.load_corpus(n_docs=6, max_tokens=96, model=model)
    result = cw_lens.faithfulness(model, corpus, granularity=("pairs", "tokens"))
    result.aopc()
    result.plot()
"""

from cw_lens.analyses.faithfulness.curves import FaithfulnessResult, faithfulness
from cw_lens.analyses.faithfulness.ranking import (
    ALL_METRICS,
    FRACTIONS,
    GRANULARITIES,
    MODES,
    n_removed,
    random_draw_names,
    rank_candidates,
    removal_mask,
    token_scores,
)
from cw_lens.core.deprecation import moved_attributes

__all__ = [
    "ALL_METRICS",
    "FRACTIONS",
    "GRANULARITIES",
    "MODES",
    "FaithfulnessResult",
    "faithfulness",
    "n_removed",
    "random_draw_names",
    "rank_candidates",
    "removal_mask",
    "token_scores",
]


# names of 0.4 that moved to the reproduction layer in 0.5 (until 0.6; not in __all__)
__getattr__ = moved_attributes(
    "cw_lens.analyses.faithfulness",
    {
        "faithfulness_claim": "cw_lens.reproduction.faithfulness_claims",
    },
)
