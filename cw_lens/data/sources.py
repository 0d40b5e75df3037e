"""Where corpora come from: the prose that ships with Python, generated task items, user files.

[`load_corpus`][cw_lens.load_corpus] reads these sources and returns a
[`Corpus`][cw_lens.Corpus].

Sources
-------
`None` / `"pydoc"`
    English prose that ships with every CPython: the language-reference topics of the standard
    library's `pydoc_data.topics` (79 topics, about 113k SmolLM2 tokens on Python 3.11),
    joined in sorted topic order and cut into non-overlapping windows of `max_tokens` text
    tokens; `n_docs` windows are drawn with `seed`. The text differs slightly between
    Python versions, so reports record the Python version.
`"stdlib"`
    More English prose that ships with every CPython: the docstrings (over 200 characters) of
    the standard library's public modules, classes and functions, read from its source files
    with `ast` (nothing is imported; test suites, IDLE, tkinter and lib2to3 left out), in
    sorted file order — on Python 3.11, 1,510 docstrings, 226k SmolLM2 tokens (882 windows of 256
    tokens); parsing takes a few seconds, once per process. Windowed like `"pydoc"`.
`"pydoc+stdlib"`
    Both texts joined, pydoc's topics first, then windowed: 1,324 windows of 256 tokens on
    Python 3.11, one more than `"pydoc"`'s 441 and `"stdlib"`'s 882, since the two texts'
    leftover tokens join into a window. The offline corpus for paper-scale runs.
`"ioi"`
    Indirect-object sentences ("When Mary and John went to the store, John gave a drink to"
    -> " Mary"), 10 templates x 40 names x places x objects, seeded.
`"arithmetic"`
    Short GSM8K-style word problems whose last clause sets up the equation ("Tom has 3
    apples and buys 5 more, so Tom has 3 + 5 =" -> " 8"): add, subtract, multiply.
A `.txt` path
    The file's text, windowed like `"pydoc"`.
A `.jsonl` path
    One JSON object per line with a `"text"` field and an optional `"answer"` field.
`"hf:NAME[:CONFIG[:SPLIT]]"`
    A Hugging Face `datasets` corpus (needs internet; not available offline), windowed.

Task items carry `answer`; pass `model=` with `only_correct=True` to keep only the items the
model completes correctly (greedy, teacher-forced over every answer token).
"""

from __future__ import annotations

import ast
import functools
import json
import random
import sysconfig
from pathlib import Path
from typing import Any

from cw_lens.core.errors import InputError
from cw_lens.data.documents import Document


def windows(
    text: str, tokenizer: Any, n_docs: int, max_tokens: int, seed: int, source: str
) -> list[Document]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n_windows = len(ids) // max_tokens
    if n_windows == 0:
        raise InputError(
            f"{source} has {len(ids)} tokens, fewer than max_tokens={max_tokens}; lower max_tokens."
        )
    if n_docs > n_windows:
        raise InputError(
            f"{source} holds only {n_windows} windows of {max_tokens} tokens but n_docs={n_docs} "
            "were asked for; lower n_docs or max_tokens."
        )
    starts = sorted(random.Random(seed).sample(range(n_windows), n_docs))
    docs = []
    for w in starts:
        window = ids[w * max_tokens : (w + 1) * max_tokens]
        docs.append(
            Document(
                text=tokenizer.decode(window),
                tokens=tuple(window),
                meta={"source": source, "offset": w * max_tokens},
            )
        )
    return docs


def pydoc_text() -> str:
    """The language-reference topics of `pydoc_data.topics`, sorted and joined."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


STDLIB_SKIP = {"idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages", "dist-packages"}
DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@functools.lru_cache(maxsize=1)
def stdlib_text(min_chars: int = 200) -> str:
    """The docstrings longer than `min_chars` of the standard library's public modules and of
    their public classes, functions and methods, parsed from the source files (never imported),
    in sorted path order: the same text for one Python installation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for path in sorted(root.rglob("*.py")):
        *folders, name = path.relative_to(root).parts
        if any(f in STDLIB_SKIP or f.startswith(("_", "test")) for f in folders):
            continue
        if name.startswith("test") or (name.startswith("_") and name != "__init__.py"):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a file for another Python version
            continue
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, DEFINITIONS) and not n.name.startswith("_")
        ]
        parts += [d for n in nodes if (d := ast.get_docstring(n)) and len(d) > min_chars]
    if not parts:
        raise InputError(
            f"No standard-library sources under {root} (a distribution without .py files?); "
            "use the 'pydoc' corpus or a .txt file."
        )
    return "\n\n".join(parts)


def pydoc_and_stdlib_text() -> str:
    """`pydoc_text`, then `stdlib_text`."""
    return pydoc_text() + "\n\n" + stdlib_text()


# built-in prose corpora: name -> (the text, the source named in errors and document metadata)
PROSE = {
    "pydoc": (pydoc_text, "pydoc_data.topics"),
    "stdlib": (stdlib_text, "stdlib docstrings"),
    "pydoc+stdlib": (pydoc_and_stdlib_text, "pydoc_data.topics + stdlib docstrings"),
}


# --------------------------------------------------------------------------- task generators

NAMES = (
    "Mary John Alice Bob Sarah Tom James Emma Michael Lisa David Anna Paul Laura Mark Kate "
    "Peter Jessica Daniel Rachel Steven Amy Kevin Susan Brian Linda George Helen Jack Nancy "
    "Frank Karen Eric Julia Adam Rose Chris Jane Ryan Lucy"
).split()
PLACES = "store park school office hospital station restaurant garden library market".split()
OBJECTS = "drink book ring bone kiss computer basketball snack necklace letter".split()
IOI_TEMPLATES = (
    "When {A} and {B} went to the {P}, {B} gave a {O} to",
    "When {A} and {B} got a {O} at the {P}, {B} decided to give it to",
    "After {A} and {B} went to the {P}, {B} gave a {O} to",
    "While {A} and {B} were working at the {P}, {B} gave a {O} to",
    "Friends {A} and {B} found a {O} at the {P}. {B} gave it to",
    "{A} and {B} were at the {P}. {B} handed the {O} to",
    "Then, {A} and {B} went to the {P}. {B} gave a {O} to",
    "The {P} was busy when {A} and {B} arrived. {B} passed the {O} to",
    "After the meeting at the {P}, {A} and {B} talked. {B} gave the {O} to",
    "When {A} and {B} visited the {P}, {B} brought a {O} for",
)
ITEMS = "apples pencils books cookies stickers marbles coins cards shells flowers".split()


def ioi_items(n: int, seed: int = 0) -> list[Document]:
    """Indirect-object sentences; the answer is the indirect object (the name said once)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        template = rng.randrange(len(IOI_TEMPLATES))
        text = IOI_TEMPLATES[template].format(A=a, B=b, P=rng.choice(PLACES), O=rng.choice(OBJECTS))
        docs.append(
            Document(text, answer=" " + a, meta={"task": "ioi", "template": template, "subject": b})
        )
    return docs


def _arithmetic_item(rng: random.Random) -> tuple[str, int, str]:
    """One word problem whose last sentence sets up the equation the model must finish."""
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        text = f"{name} has {a} {item} and buys {b} more, so {name} has {a} + {b} ="
        return text, a + b, "add"
    if kind == 1:
        a = rng.randint(5, 15)
        b = rng.randint(1, a - 1)
        text = f"{name} had {a} {item} and gave {b} to a friend, so {name} has {a} - {b} ="
        return text, a - b, "subtract"
    if kind == 2:
        a, b = rng.randint(2, 6), rng.randint(2, 5)
        text = f"A box holds {a} {item}, so {b} boxes hold {b} * {a} ="
        return text, a * b, "multiply"
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    text = f"There are {a} {item} on the table and {b} in the bag, so there are {a} + {b} ="
    return text, a + b, "add"


def arithmetic_items(n: int, seed: int = 0) -> list[Document]:
    """GSM8K-style one-step word problems; the answer is the number that ends the equation."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        text, value, op = _arithmetic_item(rng)
        docs.append(Document(text, answer=f" {value}", meta={"task": "arithmetic", "op": op}))
    return docs


# --------------------------------------------------------------------------- loading


def tokenised(docs: list[Document], tokenizer: Any) -> list[Document]:
    if tokenizer is None:
        return docs
    out = []
    for d in docs:
        if d.tokens is not None:
            out.append(d)
            continue
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        out.append(Document(d.text, tuple(ids), d.answer, d.meta))
    return out


def read_jsonl(path: Path) -> list[Document]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{line_no} is not valid JSON ({exc}).") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise InputError(f'{path}:{line_no} needs a string "text" field.')
            answer = row.get("answer")
            meta = {k: v for k, v in row.items() if k not in ("text", "answer")}
            docs.append(
                Document(row["text"], answer=None if answer is None else str(answer), meta=meta)
            )
    return docs


def hf_text(spec: str, n_chars: int) -> str:
    parts = spec.split(":")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 else "train"
    try:
        import datasets

        stream = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as exc:
        raise InputError(
            f"Could not open the Hugging Face dataset {spec!r} ({type(exc).__name__}: {exc}). "
            "This needs internet access (unset HF_HUB_OFFLINE); offline, use the default corpus "
            "or a local .txt/.jsonl file."
        ) from None
    chunks, total = [], 0
    for row in stream:
        text = row.get("text") or ""
        if text.strip():
            chunks.append(text)
            total += len(text)
        if total >= n_chars:
            break
    return "\n\n".join(chunks)
