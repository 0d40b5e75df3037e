"""One call of every analysis of cw_lens that is cheap on a tiny model, for tests that compare
two runs of all of them (offloaded vs resident, default device, CUDA vs CPU).

`analyses(model)` returns `{name: result}`; settings touch the weight reads (pruning's
magnitude order reads W_V and W_O; the flow analyses read the post-attention norm on post-norm
models) and every result class's tensors. Compare two runs with `same_results.assert_same`.
"""

from __future__ import annotations

import warnings

import cw_lens
from cw_lens.analyses.pruning import head_magnitudes

TEXTS = ["The quick brown fox jumps.", "Heads look at BOS."]
NAMES = (
    "verify", "intra", "inter", "sinks", "ablation", "selection", "taxonomy", "corpus",
    "pruning", "magnitudes", "faithfulness", "shares", "rollout", "routes", "patch",
)  # fmt: skip


def analyses(model, names: tuple[str, ...] | None = None) -> dict[str, object]:
    """`{name: result}` of every analysis in `NAMES` (or those in `names`) on `model`."""
    calls = {
        "verify": lambda: cw_lens.verify_model(model).layers,
        "intra": lambda: cw_lens.contribution_weights(model, TEXTS, kind="intra"),
        "inter": lambda: cw_lens.contribution_weights(model, TEXTS, kind="inter"),
        "sinks": lambda: cw_lens.sink_statistics(model, TEXTS, min_query=2, progress=False),
        "ablation": lambda: cw_lens.sink_ablation(model, TEXTS, layers=[1], progress=False),
        "selection": lambda: cw_lens.selection_geometry(model, TEXTS, n_random=2, progress=False),
        "taxonomy": lambda: cw_lens.head_taxonomy(model, TEXTS, progress=False),
        "corpus": lambda: cw_lens.corpus_analyses(  # the four above from one pass
            model,
            TEXTS,
            analyses={
                "sinks": {"min_query": 2},
                "ablation": {"layers": [1]},
                "selection": {"n_random": 2},
                "taxonomy": {},
            },
            progress=False,
        ),
        "pruning": lambda: cw_lens.prune_heads(
            model, TEXTS, retention=(1.0, 0.5), n_random=1, lone=False, progress=False
        ),
        "magnitudes": lambda: head_magnitudes(model, range(model.cfg.n_layers)),
        "faithfulness": lambda: cw_lens.faithfulness(
            model,
            TEXTS,
            metrics=("attention", "contribution"),
            fractions=(0.1,),
            progress=False,
        ),
        "shares": lambda: cw_lens.residual_shares(model, TEXTS),
        "rollout": lambda: cw_lens.contribution_rollout(model, TEXTS),
        "routes": lambda: cw_lens.routes(model, TEXTS[0]),
        "patch": lambda: cw_lens.compare_sink_patch(model, TEXTS[0], view_layers=[1]),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: call() for name, call in calls.items() if names is None or name in names}
