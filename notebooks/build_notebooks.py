"""Build the three notebooks from this one source (run: python notebooks/build_notebooks.py).

Edit the cells here, rebuild, and the test suite executes the notebooks (tests/test_notebooks.py).
"""
import nbformat as nbf
from pathlib import Path

def nb(cells):
    n = nbf.v4.new_notebook()
    n["metadata"]["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, src in cells:
        n["cells"].append(nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src))
    return n

quick = nb([
("md", """# cw_lens quickstart

Load the embedded SmolLM2-135M (offline), compute **contribution weights** — how much each token
really moves a head's output — and compare them with attention (P1, Fig. 1).

$$c_{ij}^h = \\frac{\\langle \\alpha_{ij}^h\\, pv_j^h,\\; o_i^h\\rangle}{\\lVert o_i^h\\rVert^2}
= \\alpha_{ij}^h \\cdot \\frac{\\lVert pv_j^h\\rVert}{\\lVert o_i^h\\rVert} \\cdot \\cos(pv_j^h, o_i^h)$$"""),
("code", """import os
import cw_lens

QUICK = os.environ.get("CW_LENS_QUICK") == "1"   # the test suite runs the notebooks small
model = cw_lens.load_model()                      # ~2 s once the weights are cached
model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads"""),
("md", "## Contribution weights of one sentence\n\n`kind=\"intra\"` projects on each head's output; `kind=\"inter\"` on the whole layer's."),
("code", """text = "The capital of France is Paris. The capital of Germany is"
cw = cw_lens.contribution_weights(model, text, kind="intra")
print(cw.weights.shape)          # [batch, layer, head, query, key]
cw.weights.sum(-1)[0, 5, 0, -3:] # every head's weights sum to 1 for every query"""),
("md", "The three factors multiply back to the weight exactly; weights can be negative or exceed 1."),
("code", """import torch
assert torch.equal(cw.weights, cw.attention * cw.relative_norm * cw.cosine)
cw.to_dataframe(layer=5, head=0, query=len(cw.str_tokens[0]) - 1).round(3).head(8)"""),
("md", "## Attention versus contribution (P1, Fig. 1)\n\nThe first token (BOS, the sink) takes a lot of attention; its contribution is much smaller."),
("code", """fig = cw.plot(layer=20, head=0)"""),
("md", "## What moves the last token?\n\nWith `kind=\"inter\"` and `sum_heads=True` each key's score is its share of the layer output."),
("code", """inter = cw_lens.contribution_weights(model, text, kind="inter", layers=[10, 20])
inter.top(k=5, layer=20, sum_heads=True)"""),
("md", "## Interactive view\n\nHover tokens for attention, relative norm and cosine; click a token to make it the query."),
("code", """inter.show(layer=20, head="all")"""),
("md", "## A corpus, streamed\n\n`stream_contributions` hands one layer (one block of query rows) at a time to your function, inside the forward pass, so memory stays flat."),
("code", """corpus = cw_lens.load_corpus(n_docs=2 if QUICK else 8, max_tokens=48 if QUICK else 128, tokenizer=model)
sink_share = torch.zeros(model.cfg.n_layers)

def consumer(lc):
    w = lc.weights("inter")                       # [batch, head, query, key] of this block
    sink_share[lc.layer] += w[..., 0].nansum().item()

stats = cw_lens.stream_contributions(model, corpus, consumer)
(sink_share / stats.n_tokens).round(decimals=3)"""),
])

patch = nb([
("md", """# Patching attention sinks

P1: the sink's projected value is small and anti-aligned with the rest; removing it pushes
low-norm heads into their *semantic cone*. `cw_lens.patch_sink` removes (or rescales)
`alpha[i,0] v_0` per query head — exact under grouped-query attention — as a context manager
or a hook list that composes with your own hooks."""),
("code", """import os
import torch
import cw_lens

QUICK = os.environ.get("CW_LENS_QUICK") == "1"
model = cw_lens.load_model()
tokens = model.to_tokens("The capital of France is Paris. The capital of Germany is")"""),
("code", """def top_next(logits, k=5):
    probs = logits[0, -1].softmax(-1)
    p, idx = probs.topk(k)
    return [(model.to_string(i), round(float(q), 3)) for q, i in zip(p, idx)]

with torch.inference_mode():
    clean = model(tokens)
top_next(clean)"""),
("md", "## Remove the sink in a few layers (context manager)"),
("code", """with torch.inference_mode(), cw_lens.patch_sink(model, layers=range(10, 20)):
    patched = model(tokens)
top_next(patched)"""),
("md", "The model is restored exactly when the context exits:"),
("code", """with torch.inference_mode():
    again = model(tokens)
torch.equal(again, clean)"""),
("md", "## Scale the sink instead of removing it, and compose with your own hooks"),
("code", """seen = {}
def record_norm(z, hook):
    seen["z"] = z[0, -1].norm(dim=-1)   # per-head ||z|| of the last token

for scale in (1.0, 0.5, 0.0):
    patch = cw_lens.patch_sink(model, layers=[20], scale=scale)
    with torch.inference_mode():
        model.run_with_hooks(tokens, fwd_hooks=[*patch, ("blocks.20.attn.hook_z", record_norm)])
    print(scale, seen["z"].round(decimals=2).tolist())"""),
("md", "## Before and after over a corpus: norms, semantic cone, perplexity"),
("code", """corpus = cw_lens.load_corpus(n_docs=2 if QUICK else 8, max_tokens=48 if QUICK else 128, tokenizer=model)
ablation = cw_lens.sink_ablation(model, corpus)
print(f"PPL {ablation.clean_ppl:.2f} -> {ablation.patched_ppl:.2f}")
ablation.summary().round(3)"""),
("code", """fig = ablation.plot()"""),
("md", "## Sink geometry behind it"),
("code", """stats = cw_lens.sink_statistics(model, corpus)
stats.heads().query("sink_head")[["layer", "head", "sink_rate", "norm_ratio", "cos_sink_mixture", "s_star_median"]].head(10).round(3)"""),
("code", """fig = stats.plot_curve()"""),
])

Path("notebooks").mkdir(exist_ok=True)
nbf.write(quick, "notebooks/01_quickstart.ipynb")
nbf.write(patch, "notebooks/02_patch_sinks.ipynb")

paper = nb([
("md", """# Regenerating the paper figures

`cw_lens.report.run_figures` is what `cw-lens figures` / `make figures` runs: every analysis of
P1 and P2 on one model and corpus, stored step by step (a rerun resumes), then figures,
`summary.json` and `REPORT.md`. Here at notebook sizes; the defaults (8 documents × 128 tokens)
take a few minutes on a laptop CPU."""),
("code", """import os
from pathlib import Path
import pandas as pd
from IPython.display import Image, Markdown, display
from cw_lens.report import JobConfig, claims_table, run_figures

QUICK = os.environ.get("CW_LENS_QUICK") == "1"
out = Path(os.environ.get("CW_LENS_NOTEBOOK_OUT", "figures-notebook"))
config = JobConfig(n_docs=2 if QUICK else 8, max_tokens=40 if QUICK else 128,
                   task_docs=4 if QUICK else 24)
summary = run_figures(config, out, progress=not QUICK)"""),
("md", "## The claims, as measured"),
("code", """pd.set_option("display.max_colwidth", 90)
claims_table(summary)"""),
("md", "## Attention versus contribution (P1, Fig. 1)"),
("code", """display(Image(filename=str(out / "contribution_heatmap_1.png")))
display(Image(filename=str(out / "sink_attention_vs_contribution.png")))"""),
("md", "## Sink geometry: norms, anti-alignment, the convex curve, drift, ablation"),
("code", """for name in ["sink_value_geometry", "sink_contribution_drivers", "convex_sink_curve",
             "sink_cancels_drift", "sink_ablation_cone"]:
    display(Markdown(f"**{name}**"))
    display(Image(filename=str(out / f"{name}.png")))"""),
("md", "## Faithfulness"),
("code", """display(Image(filename=str(out / "faithfulness_order.png")))
summary["claims"]["faithfulness_order"]["measured"]["aopc_comprehensiveness_pairs"]"""),
("md", "## Token selection (P2): F_N, the sink, the taxonomy, pruning"),
("code", """for name in ["topn_beats_random", "sink_lowers_fn", "retriever_share", "pruning_signal"]:
    display(Markdown(f"**{name}**"))
    display(Image(filename=str(out / f"{name}.png")))"""),
("md", "The full report with a one-line reading of every figure:"),
("code", """Markdown((out / "REPORT.md").read_text().split("## Figures")[0])"""),
])
nbf.write(paper, "notebooks/03_paper_figures.ipynb")
