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

4. ``--scenario e2e-28``: the whole model, end to end, measured rather than extrapolated: a
   28-layer file at Qwen2-7B's shapes (about 4.8 GB; written by a process of its own), then in
   one fresh process ``load_model``, ``verify_model`` (with its layer de-quantisations: one per
   layer), the first contribution weights of one 8 x 128 batch (``stream_contributions``, as in
   ``ratio``) and the corpus analyses of 32 x 128 tokens (``cw_lens.corpus_analyses``, one fused
   pass, where this cw_lens has it; ``sink_statistics`` otherwise), each with its time, layer
   de-quantisations and peak RSS. ``--layers N`` runs the scenario at another depth (2 checks
   the code path in a few minutes), ``--delete-gguf`` deletes its file afterwards. Run alone:
   ``python benchmarks/bench_7b.py --scenario e2e-28`` (27 min on 2 cores, 4 of them writing
   the file; the key ``e2e_28_layers`` of the results file).

The files live in ``$CW_LENS_CACHE/bench/`` (``~/.cache/cw_lens/bench/``; ``--cache-dir``
elsewhere), each with a ``.json`` of the configuration it was written with: a file is reused
when that configuration is this script's, written again otherwise. Every process the benchmark
starts is watched from outside and killed above ``--max-rss-gb`` (16 GB) of resident memory;
the writer keeps one tensor in memory at a time (``write_gguf``).

Results go to ``benchmarks/records/bench_7b.json`` (committed; ``--results`` elsewhere);
``docs/large-models.md`` shows them and their extrapolation to 28 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


# what a file's bytes depend on besides QWEN2_7B and the depth (change it with tensor_types or
# the values): a cached file written otherwise is written again
WRITTEN_AS = {
    "tensor_types": "vectors F32, token embedding and output head Q8_0, other matrices Q4_0",
    "values": "0.02 N(0, 1), norms 1 + 0.02 N(0, 1); numpy default_rng(0) in write order",
    "writer": "cw_lens.models.gguf_writer.write_gguf, llama.cpp names, byte BPE vocabulary",
}


def cache_dir() -> Path:
    """Where the benchmark's GGUF files are cached (`--cache-dir`, else the cw_lens cache)."""
    from cw_lens.models.gguf_cache import cache_root

    folder = os.environ.get("CW_LENS_BENCH_CACHE")
    return Path(folder) if folder else cache_root() / "bench"


def file_config(n_layers: int) -> dict:
    return {"dimensions": QWEN2_7B, "num_hidden_layers": n_layers, **WRITTEN_AS}


def gguf_path(n_layers: int) -> Path:
    """The cached benchmark GGUF of `n_layers` decoder layers (its `.json` says how it was
    written; `write_file` writes it)."""
    return cache_dir() / f"qwen2-7b-width-{n_layers}l-q4_0.gguf"


def is_current(n_layers: int) -> bool:
    """Whether the cached file exists and was written with this script's configuration."""
    path = gguf_path(n_layers)
    sidecar = path.with_suffix(".json")
    if not (path.is_file() and sidecar.is_file()):
        return False
    try:
        return json.loads(sidecar.read_text()) == json.loads(json.dumps(file_config(n_layers)))
    except ValueError:
        return False


def write_file(n_layers: int) -> dict:
    """Write the benchmark GGUF of `n_layers` layers (in the process that calls it)."""
    import numpy as np
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from cw_lens.models.gguf_writer import tiny_config, write_gguf

    path = gguf_path(n_layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").unlink(missing_ok=True)  # a file without it is never reused
    config = tiny_config("qwen2", num_hidden_layers=n_layers, **QWEN2_7B)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rng = np.random.default_rng(0)

    def values(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if "norm" in name:
            return 1 + 0.02 * rng.standard_normal(shape, dtype=np.float32)
        return 0.02 * rng.standard_normal(shape, dtype=np.float32)

    start, cpu = time.perf_counter(), time.process_time()
    tmp = path.with_suffix(".tmp")
    write_gguf(skeleton, tmp, tensor_types=tensor_types, values=values, name="qwen2-7b-width")
    os.replace(tmp, path)
    path.with_suffix(".json").write_text(json.dumps(file_config(n_layers), indent=1) + "\n")
    seconds = time.perf_counter() - start
    print(f"[bench_7b] wrote {path} in {seconds:.0f} s", file=sys.stderr)
    return {
        "write_s": seconds,
        "write_cpu_s": time.process_time() - cpu,
        "file_gb": path.stat().st_size / 1e9,
    }


def ensure_file(n_layers: int) -> dict | None:
    """Write the file of `n_layers` layers in a process of its own unless it is current;
    returns what writing it measured (`None`: reused)."""
    if is_current(n_layers):
        return None
    return run_child("write", str(n_layers), "0", "0", "0")


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


def reset_peak() -> bool:
    """Reset the process's peak RSS (`VmHWM`) where Linux allows it (`clear_refs`)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def e2e(n_layers: int, docs: int, n_tok: int) -> dict:
    """The end-to-end scenario in this (fresh) process: load, verify, the first contribution
    weights of one 8 x 128 batch, the corpus analyses of `docs` x `n_tok` tokens."""
    import cw_lens

    out: dict = {"layers": n_layers, "docs_x_tokens": [docs, n_tok]}
    start, cpu = time.perf_counter(), time.process_time()
    model = load(n_layers)
    out["load_s"] = time.perf_counter() - start
    out["load_cpu_s"] = time.process_time() - cpu
    out["rss_loaded_mb"] = status_mb("VmRSS")
    out["peak_rss_load_mb"] = status_mb("VmHWM")
    weights = model._cw_lens_gguf_weights
    out["layer_f32_mb"] = weights.layer_bytes(0) / 2**20
    out["resident_weights_mb"] = weights.resident_bytes() / 2**20
    phases: dict[str, dict] = {}

    def phase(name: str, fn):
        out["peak_per_phase"] = reset_peak()
        loads = weights.layer_loads
        begin, cpu = time.perf_counter(), time.process_time()
        value = fn()
        phases[name] = {
            "s": time.perf_counter() - begin,
            "cpu_s": time.process_time() - cpu,  # all threads: less sensitive to a busy machine
            "layer_loads": weights.layer_loads - loads,
            "peak_rss_mb": status_mb("VmHWM"),
            "rss_after_mb": status_mb("VmRSS"),
        }
        print(f"[bench_7b] e2e {name}: {phases[name]}", file=sys.stderr)
        return value

    report = phase("verify", lambda: cw_lens.verify_model(model))
    out["verify_ok"] = report.ok
    out["verify_layer_loads_per_layer"] = phases["verify"]["layer_loads"] / n_layers
    batch = tokens(model, 8, 128)
    phase(
        "contributions_8x128",
        lambda: cw_lens.stream_contributions(
            model, batch, all_fields, batch_size=None, reuse_buffers=True
        ),
    )
    corpus = cw_lens.load_corpus(n_docs=docs, max_tokens=n_tok - 1, model=model)
    fused = getattr(cw_lens, "corpus_analyses", None)  # the fused entry point, where it exists
    key = f"corpus_{docs}x{n_tok}"
    if fused is not None:
        results = phase(key, lambda: fused(model, corpus, progress=False))
        out["corpus_entry_point"] = "corpus_analyses"
        out["corpus_seconds_by_analysis"] = dict(getattr(results, "seconds", {}) or {})
    else:
        phase(key, lambda: cw_lens.sink_statistics(model, corpus, progress=False))
        out["corpus_entry_point"] = "sink_statistics"
    out["phases"] = phases
    out["first_contributions_s"] = (
        out["load_s"] + phases["verify"]["s"] + phases["contributions_8x128"]["s"]
    )
    out["peak_rss_mb"] = max(
        [out["peak_rss_load_mb"]] + [p["peak_rss_mb"] for p in phases.values()]
    )
    return out


def child(job: str, n_layers: int, docs: int, n_tok: int, repeats: int) -> dict:
    if job == "write":
        out = write_file(n_layers)
        out["peak_rss_mb"] = status_mb("VmHWM")
        return out
    if job == "e2e":
        return e2e(n_layers, docs, n_tok)
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
                model, batch, all_fields, batch_size=None, reuse_buffers=True
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


MAX_RSS_MB = 16 * 1024  # `--max-rss-gb`: every child is killed above it


def run_child(*args: str) -> dict:
    """Run `--child args` in a new process, watched from here: killed when its resident memory
    exceeds `MAX_RSS_MB` (the largest seen is reported as `watched_max_rss_mb`)."""
    cmd = [sys.executable, __file__, "--child", *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        seen = 0.0
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    rss = next((int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS:")), 0)
            except OSError:  # it has just ended
                rss = 0.0
            seen = max(seen, rss)
            if rss > MAX_RSS_MB:
                proc.kill()
                proc.wait()
                raise RuntimeError(
                    f"{' '.join(args)}: killed at {rss / 1024:.1f} GB of resident memory "
                    f"(limit {MAX_RSS_MB / 1024:.0f} GB, --max-rss-gb)"
                )
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    sys.stderr.write("".join(line for line in stderr.splitlines(True) if "[bench_7b]" in line))
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["watched_max_rss_mb"] = seen
    return result


def run_e2e(args: argparse.Namespace, report: dict) -> None:
    """The end-to-end scenario: the file (written by a process of its own unless current),
    then the measurement in a fresh process, under `e2e_{layers}_layers`."""
    n = args.layers
    written = ensure_file(n)
    try:
        result = run_child("e2e", str(n), "32", "128", "1")
    finally:
        if args.delete_gguf:
            for suffix in (".gguf", ".json"):
                gguf_path(n).with_suffix(suffix).unlink(missing_ok=True)
    result["file"] = {
        "path": str(gguf_path(n)),
        "reused": written is None,
        **({} if written is None else written),
        "deleted_after": bool(args.delete_gguf),
    }
    if args.conditions:
        result["conditions"] = args.conditions
    report[f"e2e_{n}_layers"] = result
    verify = result["phases"]["verify"]
    print(
        f"e2e {n} layers: load {result['load_s']:.0f} s, verify {verify['s']:.0f} s "
        f"({verify['layer_loads']} layer loads), first contribution weights after "
        f"{result['first_contributions_s']:.0f} s, corpus ({result['corpus_entry_point']}) "
        f"{result['phases']['corpus_32x128']['s']:.0f} s, peak RSS "
        f"{result['peak_rss_mb'] / 1024:.1f} GB"
    )


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
    parser.add_argument(
        "--scenario",
        choices=("e2e-28",),
        default=None,
        help="run only this scenario (e2e-28: the whole model end to end, 28 layers by default)",
    )
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the scenario")
    parser.add_argument(
        "--delete-gguf", action="store_true", help="delete the scenario's GGUF file afterwards"
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="where GGUF files are cached")
    parser.add_argument(
        "--conditions",
        default=None,
        help="what else ran on the machine, recorded with the scenario (e.g. 'two idle cores')",
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS / "bench_7b.json", help="the results file"
    )
    parser.add_argument(
        "--max-rss-gb", type=float, default=16.0, help="kill a measurement above this RSS"
    )
    parser.add_argument("--child", nargs=5, default=None, metavar=("JOB", "L", "D", "T", "R"))
    args = parser.parse_args()
    if args.cache_dir is not None:  # children inherit it
        os.environ["CW_LENS_BENCH_CACHE"] = str(args.cache_dir.resolve())
    if args.child:
        job, *numbers = args.child
        print(json.dumps(child(job, *map(int, numbers))))
        return
    global MAX_RSS_MB
    MAX_RSS_MB = int(args.max_rss_gb * 1024)
    import torch

    path = args.results
    report: dict = json.loads(path.read_text()) if path.is_file() else {}
    report.update({"torch_threads": 2, "torch": torch.__version__, "dimensions": QWEN2_7B})
    if args.scenario == "e2e-28":
        run_e2e(args, report)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        return
    for n in (2, 4):
        ensure_file(n)
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    two, four = report["load_2_layers"], report["load_4_layers"]
    print(
        f"peak RSS: 2 layers {two['peak_rss_mb']:.0f} MB, 4 layers {four['peak_rss_mb']:.0f} MB "
        f"(one layer in float32: {four['layer_f32_mb']:.0f} MB); contribution weights / forward "
        f"{report['ratio']['ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
