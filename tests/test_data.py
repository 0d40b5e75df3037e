"""load_corpus: stdlib prose windows, generated task sets with answers, user files."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest

import cw_lens
from cw_lens.core.errors import InputError
from cw_lens.data.sources import (
    IOI_TEMPLATES,
    arithmetic_items,
    ioi_items,
    pydoc_text,
    stdlib_text,
)
from cw_lens.models.testing import byte_tokenizer


def test_pydoc_windows_have_exactly_max_tokens_and_are_seeded():
    tok = byte_tokenizer()
    corpus = cw_lens.load_corpus(n_docs=5, max_tokens=64, model=tok, seed=3)
    assert len(corpus) == 5 and corpus.name == "pydoc"
    for doc in corpus:
        assert len(doc.tokens) == 64
        assert tok(doc.text, add_special_tokens=False)["input_ids"] == list(doc.tokens)
        assert doc.text in pydoc_text()
    again = cw_lens.load_corpus(n_docs=5, max_tokens=64, model=tok, seed=3)
    other = cw_lens.load_corpus(n_docs=5, max_tokens=64, model=tok, seed=4)
    assert again.texts == corpus.texts and other.texts != corpus.texts
    assert list(corpus.to_dataframe().columns[:3]) == ["doc", "text", "answer"]


def test_corpus_subset_takes_documents_by_position_and_keeps_the_corpus_record():
    import numpy as np

    tok = byte_tokenizer()
    corpus = cw_lens.load_corpus(n_docs=6, max_tokens=32, model=tok, seed=2)
    part = corpus.subset([4, 1, np.int64(5)])
    assert part.documents == [corpus[4], corpus[1], corpus[5]]
    assert (part.name, part.max_tokens, part.seed) == (corpus.name, 32, 2)
    assert part.tokenizer_fingerprint == corpus.tokenizer_fingerprint
    assert len(corpus.subset([])) == 0 and corpus.subset([-1]).documents == [corpus[5]]
    for bad in ([6], [1.0], [True], "12", 3):
        with pytest.raises(InputError, match=r"Corpus\.subset"):
            corpus.subset(bad)


def test_stdlib_corpora_are_docstrings_parsed_not_imported():
    """'stdlib' is the standard library's docstrings, read without importing a module; with
    pydoc's topics it holds the windows a 512-document run needs, where 'pydoc' alone does not."""
    import sys

    tok = byte_tokenizer()
    before = set(sys.modules)
    stdlib_text.cache_clear()
    text = stdlib_text()  # parsed now; load_corpus below reuses it
    assert set(sys.modules) == before  # parsed with ast: nothing imported
    assert inspect.getdoc(textwrap.wrap) in text and inspect.getdoc(textwrap.TextWrapper) in text
    private = inspect.getdoc(textwrap.TextWrapper._fix_sentence_endings)
    assert private not in text  # private members are left out
    corpus = cw_lens.load_corpus("stdlib", n_docs=4, max_tokens=64, model=tok, seed=1)
    again = cw_lens.load_corpus("stdlib", n_docs=4, max_tokens=64, model=tok, seed=1)
    assert corpus.name == "stdlib" and all(d.text in text for d in corpus)
    assert corpus.texts == again.texts
    both = pydoc_text() + "\n\n" + text
    n_tokens = len(tok(both, add_special_tokens=False)["input_ids"])
    big = cw_lens.load_corpus("pydoc+stdlib", n_docs=512, max_tokens=n_tokens // 600, model=tok)
    assert len(big) == 512 and {d.meta["source"] for d in big} == {
        "pydoc_data.topics + stdlib docstrings"
    }
    with pytest.raises(InputError, match="holds only"):
        cw_lens.load_corpus("pydoc", n_docs=512, max_tokens=n_tokens // 600, model=tok)


def test_task_items_carry_answers():
    ioi = ioi_items(50, seed=0)
    assert len({d.meta["template"] for d in ioi}) > 5
    for d in ioi:
        a, b = d.answer.strip(), d.meta["subject"]
        assert d.text.count(a) == 1 and d.text.count(b) == 2 and d.answer.startswith(" ")
    arith = arithmetic_items(50, seed=0)
    for d in arith:
        lhs = d.text.rsplit(",", 1)[1].split("=")[0].split("has")[-1].split("are")[-1]
        lhs = lhs.split("hold")[-1]
        assert eval(lhs) == int(d.answer)  # the equation in the text gives the answer
    assert {d.meta["op"] for d in arith} == {"add", "subtract", "multiply"}
    assert len(IOI_TEMPLATES) >= 10


def test_user_text_and_jsonl_files(tmp_path, llama):
    txt = tmp_path / "notes.txt"
    txt.write_text("attention sinks everywhere. " * 40)
    corpus = cw_lens.load_corpus(str(txt), n_docs=3, max_tokens=50, model=llama)
    assert len(corpus) == 3 and all(len(d.tokens) == 50 for d in corpus)
    jl = tmp_path / "items.jsonl"
    jl.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "text": "When Mary and John went out, John gave a drink to",
                    "answer": " Mary",
                    "id": 1,
                },
                {"text": "Plain text without answer"},
            ]
        )
    )
    items = cw_lens.load_corpus(str(jl), n_docs=10, model=llama)
    assert [d.answer for d in items] == [" Mary", None] and items[0].meta == {"id": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    with pytest.raises(InputError, match='needs a string "text" field'):
        cw_lens.load_corpus(str(bad), model=llama)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("no-such-corpus", {}, "Unknown corpus"),
        (None, {"n_docs": 0}, "n_docs must be at least 1"),
        (None, {"n_docs": 10_000, "max_tokens": 512}, "holds only"),
        ("ioi", {"only_correct": True}, "needs model="),
        ("hf:definitely/not-a-dataset", {}, "internet"),
    ],
)
def test_corpus_errors(name, kwargs, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(InputError, match=message):
        cw_lens.load_corpus(name, model=byte_tokenizer(), **kwargs)


@pytest.mark.model
def test_windows_of_another_tokenizer_are_refused(gpt2):
    """load_corpus without tokenizer= cuts windows in SmolLM2 tokens; the tiny GPT-2 (another
    tokenizer) would read them as other token counts, so the analysis refuses, naming the fix."""
    smol = cw_lens.load_corpus(n_docs=2, max_tokens=32)
    with pytest.raises(InputError, match=r"windows of 32 tokens.*model=model"):
        cw_lens.contribution_weights(gpt2, smol, layers=[0])
    with pytest.raises(InputError, match="model=model"):
        cw_lens.sink_statistics(gpt2, smol, layers=[0], progress=False)
    mine = cw_lens.load_corpus(n_docs=2, max_tokens=32, tokenizer=gpt2)
    assert cw_lens.contribution_weights(gpt2, mine, layers=[0]).weights.shape[-1] == 33
    # task items are prompts, not windows: re-tokenised for the model as before
    items = cw_lens.load_corpus("ioi", n_docs=2)
    assert cw_lens.contribution_weights(gpt2, items, layers=[0]).weights.shape[0] == 2


@pytest.mark.model
def test_only_correct_keeps_items_the_model_gets_right(smollm):
    from cw_lens.data.scoring import answer_scores

    for task in ("ioi", "arithmetic"):
        kept = cw_lens.load_corpus(task, n_docs=6, model=smollm, only_correct=True)
        assert len(kept) == 6 and kept.is_task
        assert answer_scores(smollm, list(kept)).correct.all()


def test_only_correct_scores_a_chunk_at_a_time_stops_when_enough_are_found_and_shows_it(
    monkeypatch, capsys
):
    """keep_correct scores CORRECT_CHUNK items per pass and stops once `limit` are kept: with
    every third item right, 10 items need 28 candidates, i.e. 2 passes of 16 out of 13; the
    kept items are the first 10 right ones, in order, and the bar counts them."""
    import torch

    from cw_lens.data import scoring
    from cw_lens.data.documents import Document

    seen: list[list[str]] = []

    def fake_scores(model, documents, **kwargs):
        seen.append([d.text for d in documents])
        right = torch.tensor([int(d.text) % 3 == 0 for d in documents])
        return scoring.AnswerScores(torch.zeros(len(documents)), right)

    monkeypatch.setattr(scoring, "answer_scores", fake_scores)
    pool = [Document(str(i), answer=" x") for i in range(200)]
    kept = scoring.keep_correct(object(), pool, limit=10, progress=True, label="ioi")
    assert [d.text for d in kept] == [str(i) for i in range(0, 30, 3)]
    assert [len(chunk) for chunk in seen] == [16, 16]  # not all 200 (13 passes)
    assert "ioi answered correctly" in capsys.readouterr().err
    seen.clear()
    assert len(scoring.keep_correct(object(), pool[:20], limit=10, progress=False)) == 7
    assert [len(chunk) for chunk in seen] == [16, 4]


def test_token_nll_matches_log_softmax_over_several_row_blocks():
    """token_nll reduces the logits NLL_ROWS positions at a time with logsumexp; it must equal
    -log_softmax at the next token (float64 reference), with NaN exactly where a position or
    its successor is padding."""
    import torch

    from cw_lens.data import scoring

    gen = torch.Generator().manual_seed(0)
    n_pos = 2 * scoring.NLL_ROWS + 7  # three row blocks, the last one partial
    logits = 4 * torch.randn(3, n_pos, 50, generator=gen)
    tokens = torch.randint(50, (3, n_pos), generator=gen)
    mask = torch.ones(3, n_pos, dtype=torch.bool)
    mask[1, 40:] = False  # right padding
    got = scoring.token_nll(logits, tokens, mask)
    ref = -torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    valid = mask[:, 1:] & mask[:, :-1]
    assert torch.equal(got.isnan(), ~valid)
    torch.testing.assert_close(got[valid].double(), ref[valid], rtol=1e-6, atol=1e-5)
