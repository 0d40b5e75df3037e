"""The ``cw-lens`` command line: ``cw-lens figures`` (the main job) and ``cw-lens analyze``."""

from __future__ import annotations

import os
from pathlib import Path

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Contribution weights and attention-sink geometry for TransformerLens models.",
)


def _load(model: str | None, device: str | None):
    import cw_lens

    return cw_lens.load_model(model, device=device)


@app.command()
def analyze(
    text: str = typer.Argument(..., help="The text to analyse."),
    layer: int | None = typer.Option(None, help="Only this layer (default: every layer)."),
    head: int | None = typer.Option(None, help="Only this head (default: summed over heads)."),
    k: int = typer.Option(5, help="Tokens to list per layer."),
    html: Path | None = typer.Option(None, help="Write the interactive HTML view here."),
    model: str | None = typer.Option(None, help="Model name or .gguf path (default: embedded)."),
    device: str | None = typer.Option(None, help="cpu, cuda, ..."),
) -> None:
    """Print the tokens that contribute most to the last token's attention output per layer."""
    import cw_lens

    bridge = _load(model, device)
    result = cw_lens.contribution_weights(
        bridge, text, kind="inter", layers=None if layer is None else [layer]
    )
    tokens = result.str_tokens[0]
    typer.echo(f"{len(tokens)} tokens; query = last token {tokens[-1]!r}")
    for lay in result.layers:
        top = result.top(layer=lay, head=head, k=k, sum_heads=head is None)
        cells = ", ".join(
            f"{t!r} {w:+.3f}" for t, w in zip(top["key_token"], top["weights"], strict=True)
        )
        typer.echo(f"layer {lay:>2}: {cells}")
    if html is not None:
        result.to_html(html)
        typer.echo(f"wrote {html}")


@app.command()
def figures(
    model: str | None = typer.Option(None, help="Model name or .gguf path (default: embedded)."),
    out: Path = typer.Option(Path("figures"), help="Output folder."),
    device: str | None = typer.Option(None, help="cpu, cuda, ..."),
) -> None:
    """Regenerate the figures (for now: the P1 Fig. 1 heatmaps on the embedded model)."""
    import cw_lens

    os.makedirs(out, exist_ok=True)
    bridge = _load(model, device)
    corpus = cw_lens.load_corpus(n_docs=1, max_tokens=24, tokenizer=bridge)
    result = cw_lens.contribution_weights(bridge, list(corpus), layers=[5, 15, 25])
    for layer in result.layers:
        fig = result.plot(layer=layer, head=0)
        fig.savefig(out / f"sink_attention_vs_contribution_L{layer}.png", dpi=120)
    typer.echo(f"wrote {len(result.layers)} figures to {out}")


if __name__ == "__main__":
    app()
