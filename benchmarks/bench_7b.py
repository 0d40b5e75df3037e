"""Benchmark at the papers' width: a random Qwen2-7B-sized model streamed from a GGUF file.

Run with ``python benchmarks/bench_7b.py`` (``--quick``: fewer repeats; ``--jobs sinks``: rerun
only some measurements, keeping the others of the results file). Nothing is
downloaded: the model is a random-init Qwen2 with Qwen2-7B's dimensions and vocabulary
(d_model 3584, 28 query heads, 4 key/value heads, d_head 128, FFN 18944, vocabulary 152,064,
q/k/v biases, untied head) and 2 or 4 decoder layers, written once as a Q4_0 GGUF file (the
embedding and the head in Q8_0) into ``$CW_LENS_CACHE/bench/`` and loaded with
``load_model(path, layer_streaming=True)``: one decoder layer de-quantised to float32 at a time.

Each measurement runs in its own subprocess (peak RSS is the process's own high-water mark,
``VmHWM``), with 2 torch threads:

1. ``load``: peak RSS after loading and one forward pass on 8 x 128 tokens, for 2 and 4
   layers; it must not grow with the layer count by more than one layer's float32 weights;
2. ``ratio`` (4 layers, 8 x 128 tokens): a plain forward pass (logits) against the streamed
   all-layer contribution weights (intra + inter, with the decomposition's cosine and relative
   norm, every check on), interleaved in one process, medians;
3. ``sinks``: ``sink_statistics`` on 8 x 128, 32 x 128 and 32 x 256 tokens of the ``pydoc``
   corpus (batches of 8 documents): time (after the model's verification, timed apart) and
   peak RSS, which must not grow from 8 to 32 documents.

Results go to ``benchmarks/records/bench_7b.json`` (committed); ``docs/large-models.md`` shows
them and their extrapolation to 28 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).parent / "records"  # committed: the docs quote these measurements
QWEN2_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}


def tensor_types(name: str, shape: tuple[int, ...]) -> str:
    if len(shape) == 1:
        return "F32"
    return "Q8_0" if name.startswith(("token_embd", "output")) else "Q4_0"


def gguf_path(n_layers: int) -> Path:
    """The cached benchmark GGUF of `n_layers` decoder layers (written on first use)."""
    import numpy as np
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from cw_lens.models.gguf_cache import cache_root
    from cw_lens.models.gguf_writer import tiny_config, write_gguf

    path = cache_root() / "bench" / f"qwen2-7b-width-{n_layers}l-q4_0.gguf"
    if path.is_file():
        return path
    config = tiny_config("qwen2", num_hidden_layers=n_layers, **QWEN2_7B)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rng = np.random.default_rng(0)

    def values(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if "norm" in name:
            return 1 + 0.02 * rng.standard_normal(shape, dtype=np.float32)
        return 0.02 * rng.standard_normal(shape, dtype=np.float32)

    start = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    write_gguf(skeleton, tmp, tensor_types=tensor_types, values=values, name="qwen2-7b-width")
    os.replace(tmp, path)
    print(f"[bench_7b] wrote {path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return path


def status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def load(n_layers: int):
    import torch

    import cw_lens

    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    return cw_lens.load_model(gguf_path(n_layers), layer_streaming=True, device="cpu")


def tokens(model, docs: int, n_tok: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (docs, n_tok), generator=gen)
    ids[:, 0] = model.tokenizer.bos_token_id
    return ids


def all_fields(lc) -> None:
    for kind in ("intra", "inter"):
        lc.weights(kind)
        lc.cosine(kind)
        lc.relative_norm(kind)


def child(job: str, n_layers: int, docs: int, n_tok: int, repeats: int) -> dict:
    import torch

    import cw_lens

    start = time.perf_counter()
    model = load(n_layers)
    out: dict = {"load_s": time.perf_counter() - start, "rss_loaded_mb": status_mb("VmRSS")}
    # anonymous memory (tensors) and mapped file pages (the GGUF file's, read by de-quantising)
    out["rss_loaded_anon_mb"] = status_mb("RssAnon")
    out["rss_loaded_file_mb"] = status_mb("RssFile")
    weights = model._cw_lens_gguf_weights
    out["layer_f32_mb"] = weights.layer_bytes(0) / 2**20
    out["resident_weights_mb"] = weights.resident_bytes() / 2**20
    if job == "load":
        batch = tokens(model, docs, n_tok)
        start = time.perf_counter()
        with torch.inference_mode():
            model(batch)
        out["forward_s"] = time.perf_counter() - start
        out["layer_loads_per_forward"] = weights.layer_loads
    elif job == "ratio":
        batch = tokens(model, docs, n_tok)
        start = time.perf_counter()
        cw_lens.verify_model(model)
        out["verify_s"] = time.perf_counter() - start
        loads = weights.layer_loads
        from cw_lens.models.access import StreamDone

        def stop(t, hook):
            raise StreamDone

        def decoder_only():
            # the forward pass without the output head (152,064 x 3,584 per token): what the
            # contribution weights, which stop after the last layer, run of it
            try:
                with model.hooks(fwd_hooks=[(f"blocks.{n_layers - 1}.hook_out", stop)]):
                    model(batch)
            except StreamDone:
                pass

        fns = {
            "forward": lambda: model(batch),
            "forward_decoder_layers": decoder_only,
            "contributions": lambda: cw_lens.stream_contributions(
                model, batch, all_fields, batch_size=None
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                with torch.inference_mode():
                    fn()
                times[name].append(time.perf_counter() - start)
        out["verify_layer_loads"] = loads
        out["seconds"] = times
        out["median_s"] = {k: statistics.median(v) for k, v in times.items()}
        med = out["median_s"]
        out["ratio"] = med["contributions"] / med["forward"]
        out["ratio_to_decoder_layers"] = med["contributions"] / med["forward_decoder_layers"]
        # 28 layers (an extrapolation): per-layer costs times 28, the head once
        head = med["forward"] - med["forward_decoder_layers"]
        per_layer = {k: med[k] / n_layers for k in ("forward_decoder_layers", "contributions")}
        out["extrapolated_28_layers_s"] = {
            "forward": 28 * per_layer["forward_decoder_layers"] + head,
            "contributions": 28 * per_layer["contributions"],
        }
        out["extrapolated_28_layers_ratio"] = (
            out["extrapolated_28_layers_s"]["contributions"]
            / out["extrapolated_28_layers_s"]["forward"]
        )
    elif job == "sinks":
        corpus = cw_lens.load_corpus(n_docs=docs, max_tokens=n_tok - 1, model=model)
        start = time.perf_counter()
        cw_lens.verify_model(model)  # once per model, before the first analysis: timed apart
        out["verify_s"] = time.perf_counter() - start
        start = time.perf_counter()
        cw_lens.sink_statistics(model, corpus, progress=False)
        out["sink_statistics_s"] = time.perf_counter() - start
    out["peak_rss_mb"] = status_mb("VmHWM")
    out["rss_end_anon_mb"] = status_mb("RssAnon")
    out["rss_end_file_mb"] = status_mb("RssFile")
    return out


def run_child(*args: str) -> dict:
    cmd = [sys.executable, __file__, "--child", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of the ratio")
    parser.add_argument(
        "--jobs",
        nargs="+",
        choices=("load", "ratio", "sinks"),
        default=("load", "ratio", "sinks"),
        help="rerun only these measurements, keeping the others of bench_7b.json",
    )
    parser.add_argument("--child", nargs=5, default=None, metavar=("JOB", "L", "D", "T", "R"))
    args = parser.parse_args()
    if args.child:
        job, *numbers = args.child
        print(json.dumps(child(job, *map(int, numbers))))
        return
    import torch

    for n in (2, 4):
        gguf_path(n)
    path = RESULTS / "bench_7b.json"
    report: dict = json.loads(path.read_text()) if path.is_file() else {}
    report.update({"torch_threads": 2, "torch": torch.__version__, "dimensions": QWEN2_7B})
    if "load" in args.jobs:
        for n in (2, 4):
            report[f"load_{n}_layers"] = run_child("load", str(n), "8", "128", "1")
            print(f"[bench_7b] {n} layers: {report[f'load_{n}_layers']}", file=sys.stderr)
    if "ratio" in args.jobs:
        repeats = "1" if args.quick else "3"
        report["ratio"] = run_child("ratio", "4", "8", "128", repeats)
        print(f"[bench_7b] ratio: {report['ratio']}", file=sys.stderr)
    if "sinks" in args.jobs:
        # 8 and 32 documents of 128 tokens: the corpus analyses' memory is flat in the number of
        # documents (batches of 8); 32 x 256: the long setting
        for docs, n_tok in ((8, 128), (32, 128), (32, 256)):
            key = f"sinks_{docs}x{n_tok}"
            report[key] = run_child("sinks", "4", str(docs), str(n_tok), "1")
            print(f"[bench_7b] {key}: {report[key]}", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    two, four = report["load_2_layers"], report["load_4_layers"]
    print(
        f"peak RSS: 2 layers {two['peak_rss_mb']:.0f} MB, 4 layers {four['peak_rss_mb']:.0f} MB "
        f"(one layer in float32: {four['layer_f32_mb']:.0f} MB); contribution weights / forward "
        f"{report['ratio']['ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
