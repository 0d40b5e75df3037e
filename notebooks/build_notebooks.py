"""Build the four notebooks from this one source, executed, with their outputs.

    python notebooks/build_notebooks.py            # write and execute all four (full sizes)
    python notebooks/build_notebooks.py --no-execute   # write them without outputs
    python notebooks/build_notebooks.py --quick 03     # execute one at the test suite's sizes
    python notebooks/build_notebooks.py 03 --from-run=figures  # 03 resumes `make figures`' run

Edit the cells here and rebuild: the notebooks are committed executed (figures included), so a
reader browsing the repository sees the results; the test suite still executes them from
scratch at small sizes (tests/test_notebooks.py). Execution runs in a temporary folder (the
paper-figures job writes there), with HF_HUB_OFFLINE=1, and keeps the widget state.
``--from-run=DIR`` copies a finished main-job folder (with its ``.state``) there first, so
notebook 03's default-size job resumes it instead of recomputing it (the same config and
version resume; anything else recomputes).
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat as nbf

def nb(cells):
    n = nbf.v4.new_notebook()
    n["metadata"]["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, src in cells:
        n["cells"].append(nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src))
    return n

quick = nb([
("md", """# cw_lens quickstart

Load the embedded SmolLM2-135M (offline), compute **contribution weights** — how much each token
really moves a head's output — and compare them with attention (P1, Fig. 1). The weight of key
`j` for query `i` in head `h` is the share of the head's output `o_i^h` due to that key's
weighted projected value, and it factors into attention, relative norm and cosine:

    c[i,j]^h = < alpha[i,j]^h pv_j^h , o_i^h > / ||o_i^h||²
             = alpha[i,j]^h · ( ||pv_j^h|| / ||o_i^h|| ) · cos(pv_j^h, o_i^h)

(The Methods page of the documentation gives the inter-head form and the conventions.)"""),
("code", """import os
import cw_lens

QUICK = os.environ.get("CW_LENS_QUICK") == "1"   # the test suite runs the notebooks small
model = cw_lens.load_model()                      # 10–14 s on two idle cores once the weights are cached
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
("code", """corpus = cw_lens.load_corpus(n_docs=2 if QUICK else 8, max_tokens=48 if QUICK else 128, model=model)
sink_share = torch.zeros(model.cfg.n_layers)

def consumer(lc):
    w = lc.weights("inter")                       # [batch, head, query, key] of this block
    sink_share[lc.layer] += w[..., 0].nansum().item()

stats = cw_lens.stream_contributions(model, corpus, consumer, progress=False)  # no progress bar
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
("code", """corpus = cw_lens.load_corpus(n_docs=2 if QUICK else 8, max_tokens=48 if QUICK else 128, model=model)
ablation = cw_lens.sink_ablation(model, corpus, progress=False)
print(f"PPL {ablation.clean_ppl:.2f} -> {ablation.patched_ppl:.2f}")
ablation.summary().round(3)"""),
("code", """fig = ablation.plot()"""),
("md", "## Sink geometry behind it"),
("code", """stats = cw_lens.sink_statistics(model, corpus, progress=False)
stats.heads().query("sink_head")[["layer", "head", "sink_rate", "norm_ratio", "cos_sink_mixture", "s_star_median"]].head(10).round(3)"""),
("code", """fig = stats.plot_curve()"""),
])


paper = nb([
("md", """# Regenerating the paper figures

`cw_lens.reproduction.job.run_figures` is what `cw-lens figures` / `make figures` runs: every analysis of
P1 and P2 on one model and corpus, stored step by step (a rerun resumes), then figures,
`summary.json` and `REPORT.md`. Here at notebook sizes; the defaults (8 documents × 128 tokens)
take a few minutes on a laptop CPU."""),
("code", """import os
from pathlib import Path
import pandas as pd
from IPython.display import Image, Markdown, display
from cw_lens.reproduction.job import JobConfig, run_figures
from cw_lens.reproduction.markdown import claims_table

QUICK = os.environ.get("CW_LENS_QUICK") == "1"
out = Path(os.environ.get("CW_LENS_NOTEBOOK_OUT", "figures-notebook"))
# the test suite's size: 2 short documents, no task, faithfulness on one document at pairs
# granularity and no global pruning variant (as the paper preset), lone-head costs on one
config = (JobConfig(n_docs=2, max_tokens=32, task=None, faithfulness_docs=1, lone_docs=1,
                    faithfulness_granularity=("pairs",), global_ranking=False) if QUICK
          else JobConfig())
summary = run_figures(config, out, progress=False)"""),
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
("md", """## Two corpora side by side

The same job on a second kind of English text — the CPython licence (`LICENSE.txt` ships with
CPython's standard library; where a distribution moved it, the built-in `"stdlib"` corpus of
the standard library's own docstrings stands in) — then both runs' claims side by side (`compare_runs`): every
headline number with its interval and the verdict per run, then each number's difference from
the first run with the 95% bootstrap interval of the difference. `cw-lens compare DIR DIR`
prints the same tables and writes the figure."""),
("code", """import dataclasses
import sysconfig
from cw_lens.reproduction.run_comparison import compare_runs

licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
second = str(licence) if licence.is_file() else "stdlib"  # the built-in docstring corpus
out_second = out / "second_corpus"
run_figures(dataclasses.replace(config, corpus=second), out_second, progress=False)
cmp = compare_runs([out, out_second], labels=["pydoc", Path(second).stem])
Markdown(cmp.to_markdown())"""),
("code", """cmp.plot();"""),
("md", "The numbers that differ between the two corpora (the difference's interval excludes 0):"),
("code", """cmp.disagreements()"""),
])

live = nb([
("md", """# Live sink patching

P1's sink-norm ablation, interactively: `cw_lens.sink_patcher(model, text)` is a Jupyter widget
(anywidget: JupyterLab, Notebook 7, VS Code, Colab) that re-runs the model with
`cw_lens.patch_sink` — the sink's projected value `pv_0 → λ·pv_0` in the chosen layers and heads,
attention untouched — on every control change, and shows clean next to patched:

- the top-k next-token probabilities after the chosen query, and the NLL change of every token;
- the chosen head's attention and contribution matrices (P1, Fig. 1), the factors on hover;
- every head of the layer as small multiples;
- each patched head's output norm and its alignment with its semantic cone `cos(o_i^h, u^h)`.

Controls: the layer range, heads (`all` or `0,3`), λ from 0 (remove) through 1 (identity) to 2
(double the sink), the mode (`scale` / `norm_matched`) and the sink position(s)."""),
("code", """import os
import cw_lens

QUICK = os.environ.get("CW_LENS_QUICK") == "1"
model = cw_lens.load_model()
text = "The capital of France is Paris. The capital of Germany is"
patcher = cw_lens.sink_patcher(model, text, layers=(10, 19), scale=0.0, layer=20)
patcher"""),
("md", """Move the controls above (with a live kernel): each change is one forward pass of the
patched model — well under a second for a short text on a laptop CPU (`benchmarks/bench_widget.py`).
The same changes from Python:"""),
("code", """patcher.update(scale=2.0, heads=[0, 3, 6])   # amplify the sink in three heads
patched = patcher.patched
print("mean NLL change:", patched["delta"]["nll_mean"])
print("patched top-5 after the last token:", patched["top"]["tok"][-1])"""),
("md", """## The numbers behind the widget

`cw_lens.compare_sink_patch` returns them as tensors and tables — the widget shows exactly
these (the test suite checks every displayed number against `patch_sink`, `contribution_weights`
and the model's logits)."""),
("code", """cmp = cw_lens.compare_sink_patch(model, text, layers=(10, 19), scale=0.0, view_layers=[20])
cmp.top()"""),
("code", """heads = cmp.heads()
heads.groupby("layer")[["norm_clean", "norm_patched", "cone_clean", "cone_patched"]].mean().round(3)"""),
("code", """cmp.to_dataframe().round(3).tail(6)"""),
("md", """## A sweep over λ

What the saved page precomputes, as a figure: removing the sink (λ = 0) raises the model's
loss and turns the heads of the patched layers towards their semantic cone; amplifying it
(λ = 2) does the opposite."""),
("code", """import matplotlib.pyplot as plt

lambdas = [0.0, 0.5, 1.0, 2.0] if QUICK else [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
clean = cmp.clean
rows = []
for lam in lambdas:
    c = cw_lens.compare_sink_patch(model, text, layers=(10, 19), scale=lam, view_layers=[20], clean=clean)
    h = c.heads()
    rows.append((lam, c.delta_nll, h.cone_patched.mean() - h.cone_clean.mean(),
                 (h.norm_patched / h.norm_clean).mean()))
fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
for ax, k, label in zip(axes, (1, 2, 3), ("mean NLL change", "mean cone alignment change", "mean output norm ratio")):
    ax.plot(lambdas, [r[k] for r in rows], "o-", color="#c2410c")
    ax.axvline(1.0, color="#9ca3af", lw=0.8, ls="--")
    ax.set_xlabel("λ (sink value scale), layers 10–19")
    ax.set_title(label, fontsize=10)
fig.tight_layout()"""),
("md", """## The saved page: the same view without a kernel

`patcher.to_html(path)` writes one self-contained HTML file (no network, works from `file://`)
with a precomputed sweep — λ ∈ {0, 0.25, 0.5, 0.75, 1} over the first, middle and last third
of the layers and the whole model — driven by the same front-end code as the widget."""),
("code", """from pathlib import Path
out = Path(os.environ.get("CW_LENS_NOTEBOOK_OUT", "."))
small = dict(layers=[20], ranges=[(10, 19)]) if QUICK else {}
page = patcher.to_html(out / "sink_patching.html", **small)
print(f"{len(page.encode()) / 1e6:.1f} MB -> {out / 'sink_patching.html'}")"""),
])

NOTEBOOKS = {
    "01_quickstart.ipynb": quick,
    "02_patch_sinks.ipynb": patch,
    "03_paper_figures.ipynb": paper,
    "04_live_sink_patching.ipynb": live,
}


def execute(notebook, workdir, quick=False):
    """Run a notebook top to bottom in ``workdir`` (full sizes unless ``quick``) and keep its
    outputs."""
    from nbclient import NotebookClient

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.pop("CW_LENS_QUICK", None)
    if quick:
        os.environ["CW_LENS_QUICK"] = "1"
    os.environ["CW_LENS_NOTEBOOK_OUT"] = str(workdir)
    client = NotebookClient(notebook, timeout=3600, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return notebook


if __name__ == "__main__":
    here = Path(__file__).parent
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name, notebook in NOTEBOOKS.items():
        if only and not any(o in name for o in only):
            continue
        if "--no-execute" not in sys.argv:
            with tempfile.TemporaryDirectory() as tmp:
                runs = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--from-run=")]
                if runs:
                    shutil.copytree(runs[0], tmp, dirs_exist_ok=True)
                print(f"executing {name}", flush=True)
                execute(notebook, Path(tmp), quick="--quick" in sys.argv)
        nbf.write(notebook, here / name)
