"""Regenerate the contribution-flow figures and numbers of the README (embedded SmolLM2-135M).

    python docs/flow/make_flow_figures.py            # ~30 min on 2 busy CPU cores
    python docs/flow/make_flow_figures.py --panel    # routes_ioi.html's front end only (1 s)
    python docs/flow/make_flow_figures.py --deletion # the deletion tests only (keeps the rest)

Writes, next to this file: ``routes_ioi.png``, ``routes_ioi.html`` (the interactive panel),
``rollout_ioi.png``, ``deletion_ioi.png``, ``deletion_text.png`` and ``flow_results.json``
(the deletion summaries, the IOI route statistics and their top heads).

The panel inlines the package's ``cw_lens/viz/routes.js`` and ``routes.html``; after a change to
them, ``--panel`` writes ``routes_ioi.html`` again from its own embedded routes, without the
model (``tests/test_flow.py`` fails while the committed page and ``routes.js`` differ).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).parent
PANEL = HERE / "routes_ioi.html"
SENTENCE = "When Mary and John went to the store, John gave a drink to"


def refresh_panel() -> None:
    """``routes_ioi.html`` written again from its own routes with the package's current
    template and ``routes.js`` (:func:`cw_lens.viz.routes.rerender_routes_page`)."""
    from cw_lens.viz.routes import rerender_routes_page

    page = rerender_routes_page(PANEL.read_text(encoding="utf-8"))
    PANEL.write_text(page, encoding="utf-8")


def main(deletion_only: bool = False) -> None:
    import torch

    import cw_lens
    from cw_lens.plots import save_figure

    torch.set_grad_enabled(False)
    model = cw_lens.load_model(device="cpu")
    out: dict = {"model": model.cfg.model_name, "sentence": SENTENCE}
    if deletion_only:  # the routes and rollout entries of the last full run stay as they are
        out = json.loads((HERE / "flow_results.json").read_text())
        out.pop("deletion_note", None)
    start = time.time()

    def save() -> None:  # after every step, so a long run keeps what it has
        out["deletion_seconds" if deletion_only else "seconds"] = time.time() - start
        (HERE / "flow_results.json").write_text(json.dumps(out, indent=1, default=str))

    if not deletion_only:
        g = cw_lens.routes(model, SENTENCE, threshold=0.03)
        save_figure(g.plot(), HERE / "routes_ioi", formats=("png",))
        g.to_html(PANEL)
        kinds = g.to_dataframe()["kind"].value_counts()
        from_io = g.routes_from((0, 2))  # ' Mary', the indirect object's embedding
        out["routes_ioi"] = {
            "threshold": 0.03,
            "attention_edges": int(kinds.get("attention", 0)),
            "mlp_edges": int(kinds.get("mlp", 0)),
            "embedding_nodes": sorted(p for layer, p in g.graph.nodes if layer == 0),
            "top_edges": g.top(8).drop(columns=["kind"]).to_dict("records"),
            "from_io_embedding": {
                "edges": from_io.graph.number_of_edges(),
                "heads": from_io.heads().to_dict("records"),
                "mlps": from_io.mlps().to_dict("records"),
            },
        }
        ro = cw_lens.contribution_rollout(model, SENTENCE)
        save_figure(ro.plot(), HERE / "rollout_ioi", formats=("png",))
        out["rollout_ioi_top"] = {
            m: ro.top(k=5, by=m)[["key", "key_token", m]].to_dict("records")
            for m in ("contribution", "attention")
        }
        save()

    ioi = cw_lens.load_corpus("ioi", n_docs=32, model=model, only_correct=True)
    texts = cw_lens.load_corpus(n_docs=24, max_tokens=48, model=model, seed=1)
    if not deletion_only:
        for threshold in (0.02, 0.03, 0.05):
            stats = cw_lens.ioi_route_statistics(model, ioi, threshold=threshold)
            out[f"ioi_routes_{threshold}"] = {
                "summary": stats.summary(),
                "top_io_heads": stats.top(6).to_dict("records"),
                "top_io_target_heads": stats.top(6, by="io_target_items").to_dict("records"),
                "top_io_embedding_heads": stats.top(8, by="io_embedding_items").to_dict("records"),
                "io_embedding_mlps": stats.mlps.to_dict("records"),
                "items": stats.items[
                    ["item", "io", "target", "reaches_io_embedding", "io_embedding_heads",
                     "io_embedding_mlps"]
                ].to_dict("records"),
            }  # fmt: skip
            save()
    for name, corpus in (("ioi", ioi), ("text", texts)):
        for exclude_bos in (False, True):
            d = cw_lens.rollout_deletion(
                model, corpus, ks=(1, 2, 4, 8), n_random=5, exclude_bos=exclude_bos
            )
            key = f"deletion_{name}" + ("_no_bos" if exclude_bos else "")
            out[key] = {
                "n_items": len(corpus),
                "summary": d.summary().to_dict("records"),
                "aopc": d.aopc().to_dict(),
                "contribution_beats_attention": d.wins().to_dict(),
            }
            if not exclude_bos:
                save_figure(d.plot(), HERE / f"deletion_{name}", formats=("png",))
            save()
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    if "--panel" in sys.argv[1:]:
        refresh_panel()
    else:
        main(deletion_only="--deletion" in sys.argv[1:])
