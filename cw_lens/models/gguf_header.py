"""A GGUF file's header checked against its own tensors, before anything is built from it.

A GGUF file describes its model twice: the key-value header gives the counts and widths a
loader builds the model from (`llama.block_count`, `llama.embedding_length`, ...), and the
tensor-info table gives the name and shape of every tensor in the file. Only the second is
bound by the file's size (every tensor's data must lie inside it); a header of a few bytes can
claim 10^9 layers or a 10^9-wide stream, and `transformers` builds the model from the header
before it reads a tensor: it allocates, or loops over, whatever the header says.

[check_gguf_header][cw_lens.models.gguf_header.check_gguf_header] therefore reads the tensor
table first ([open_gguf][cw_lens.models.gguf_header.open_gguf]: the header parsed whole, every
tensor's data inside the file and in bytes of its own) and refuses, with a `ModelLoadError` that
names the file, the key, its value and what the tensors say, a header whose

- block count is not the number of `blk.N.` tensor groups, numbered 0 to N-1;
- embedding length is not the width of `token_embd.weight`;
- vocabulary (`vocab_size`, else the number of tokens, as `transformers` takes it) is not the
  number of rows of `token_embd.weight` (or of `output.weight`);
- head counts, head width or feed-forward length give other shapes than the attention and MLP
  tensors of any block have;
- expert count is not the experts' dimension of the `*_exps` tensors;
- BOS, EOS, padding or unknown token id is not a token of the vocabulary;

or whose value for one of those keys is not one non-negative integer. What is left to build is
then the size of the tensors in the file, so both loaders (resident and layer-streamed) start
from a model the file can fill. Keys the header leaves out are left to `transformers`, except
the three it would otherwise guess (block count, embedding length and, where there are attention
tensors, the head count).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

from cw_lens.core.errors import ModelLoadError

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_FIX = (
    "The header does not describe the tensors in the file: the file is damaged or was written "
    "wrongly. cw_lens refuses it before building anything; use a file whose header matches its "
    "tensors (llama.cpp's gguf-py can rewrite one: gguf_set_metadata.py)."
)


def open_gguf(path: Path) -> Any:
    """`gguf.GGUFReader` of `path` (memory-mapped), checked before anything reads its tensors.

    The header is parsed whole (magic, version, counts, every key-value field and tensor
    description, the alignment); every tensor's data must lie inside the file and no two
    tensors may share bytes, so a truncated or damaged file is refused here, before any
    de-quantisation starts, and the tensors de-quantised take at most a fixed multiple of the
    file's size.

    Args:
        path: The `.gguf` file.

    Returns:
        The reader.

    Raises:
        ModelLoadError: The file is not a GGUF file gguf can read, a tensor's data runs past
            its end, or two tensors overlap.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        size = path.stat().st_size
        spans = sorted((int(t.data_offset), int(t.n_bytes), t.name) for t in reader.tensors)
    except Exception as exc:  # gguf raises ValueError, IndexError, struct.error... on a bad file
        raise ModelLoadError(
            f"Could not read {path} as a GGUF file: {type(exc).__name__}: {str(exc)[:300]}. The "
            "file is corrupt, truncated or not a GGUF file."
        ) from None
    beyond = [name for start, n_bytes, name in spans if start + n_bytes > size]
    if beyond:
        raise ModelLoadError(
            f"{path}: the data of tensor {beyond[0]!r} runs past the end of the file. The file "
            "is corrupt, truncated or not a GGUF file."
        )
    filled = [span for span in spans if span[1] > 0]
    for (start, n_bytes, name), (after, _, other) in itertools.pairwise(filled):
        if after < start + n_bytes:
            raise ModelLoadError(
                f"{path}: the data of tensors {name!r} and {other!r} overlap (bytes {after} to "
                f"{start + n_bytes - 1} of the file). The file is corrupt or not a GGUF file."
            )
    return reader


def check_gguf_header(path: Path) -> Any:
    """Open a GGUF file and check every count and width of its header against its tensors.

    Run by both GGUF loaders before anything is allocated or any layer loop starts (and
    before the weight cache's lock or digest memo is written).

    Args:
        path: The `.gguf` file.

    Returns:
        The file's `gguf.GGUFReader`.

    Raises:
        ModelLoadError: The file is unreadable ([open_gguf][cw_lens.models.gguf_header.open_gguf]),
            or a header value disagrees with the tensors; the message names the file, the key,
            its value and what the tensors say.
    """
    reader = open_gguf(path)
    _Header(path, reader).check()
    return reader


class _Header:
    """The header of one GGUF file and the shapes of its tensors (GGUF order: fastest first)."""

    def __init__(self, path: Path, reader: Any) -> None:
        """Read the architecture and group the tensors by block.

        Args:
            path: The `.gguf` file (named in every error).
            reader: Its `gguf.GGUFReader`.
        """
        self.path = path
        self.fields = reader.fields
        self.shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
        field = self.fields.get("general.architecture")
        if field is None or not isinstance(field.contents(), str):
            raise ModelLoadError(f"{path}: the header has no general.architecture string. {_FIX}")
        self.arch = str(field.contents())
        self.blocks: dict[int, dict[str, tuple[int, ...]]] = {}
        for name, shape in self.shapes.items():
            match = _BLOCK.match(name)
            if match:
                self.blocks.setdefault(int(match.group(1)), {})[match.group(2)] = shape

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def refuse(self, template: str, value: Any, tensors_say: str) -> None:
        raise ModelLoadError(
            f"{self.path}: the header's {self.key(template)} is {value}, but {tensors_say}. {_FIX}"
        )

    def integer(self, template: str, *, required: bool = False, minimum: int = 1) -> int | None:
        """The header's integer at `template` (`{arch}` filled in), None when it is absent.

        Args:
            template: A `gguf.Keys` name, `{arch}` left to fill.
            required: Refuse a header without the key.
            minimum: The smallest value accepted.

        Returns:
            The value, or None.
        """
        import gguf

        key = self.key(template)
        field = self.fields.get(key)
        if field is None:
            if required:
                raise ModelLoadError(
                    f"{self.path}: the header has no {key}, which transformers would guess "
                    f"(and build a model of that guess). {_FIX}"
                )
            return None
        integers = {
            gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16,
            gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
            gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64,
        }  # fmt: skip
        if len(field.types) != 1 or field.types[0] not in integers:
            kinds = "/".join(t.name for t in field.types)
            raise ModelLoadError(
                f"{self.path}: the header's {key} is of GGUF type {kinds}, not one integer. {_FIX}"
            )
        value = int(field.contents())
        if value < minimum:
            raise ModelLoadError(
                f"{self.path}: the header's {key} is {value}; it must be at least {minimum}. {_FIX}"
            )
        return value

    def check(self) -> None:
        import gguf

        keys = gguf.Keys
        self.check_blocks(keys.LLM.BLOCK_COUNT)
        embedding = self.shapes.get("token_embd.weight")
        if embedding is None or len(embedding) != 2:
            raise ModelLoadError(
                f"{self.path}: the file has no 2-D token_embd.weight tensor (got "
                f"{embedding}), so its widths cannot be checked. {_FIX}"
            )
        width, rows = embedding
        hidden = self.integer(keys.LLM.EMBEDDING_LENGTH, required=True)
        if hidden != width:
            self.refuse(keys.LLM.EMBEDDING_LENGTH, hidden, f"token_embd.weight is {width} wide")
        self.integer(keys.LLM.CONTEXT_LENGTH)
        n_tokens = self.check_vocabulary(rows, hidden)
        limit = min(rows, n_tokens if n_tokens is not None else rows)
        for template in (
            keys.Tokenizer.BOS_ID, keys.Tokenizer.EOS_ID, keys.Tokenizer.PAD_ID,
            keys.Tokenizer.UNK_ID,
        ):  # fmt: skip
            index = self.integer(template, minimum=0)
            if index is not None and index >= limit:
                self.refuse(
                    template, index, f"the vocabulary has {limit} tokens (ids 0 to {limit - 1})"
                )
        self.check_layer_shapes(hidden)

    def check_blocks(self, template: str) -> None:
        count = self.integer(template, required=True)
        found = sorted(self.blocks)
        if found != list(range(len(found))):
            missing = sorted(set(range(found[-1] + 1)) - set(found))[:5]
            self.refuse(
                template,
                count,
                f"the tensors' blocks are numbered up to blk.{found[-1]} with blk.{missing[0]} "
                f"missing ({len(found)} blocks of tensors in the file)",
            )
        if count != len(found):
            self.refuse(
                template,
                count,
                f"the file has tensors for {len(found)} decoder blocks (blk.0 to "
                f"blk.{len(found) - 1})"
                if found
                else "the file has no blk.N. tensors",
            )

    def check_vocabulary(self, rows: int, hidden: int) -> int | None:
        import gguf

        keys = gguf.Keys
        tokens = self.fields.get(keys.Tokenizer.LIST)
        n_tokens = None if tokens is None else len(tokens.data)
        vocab = self.integer(keys.LLM.VOCAB_SIZE)
        if vocab is not None and vocab != rows:
            self.refuse(keys.LLM.VOCAB_SIZE, vocab, f"token_embd.weight has {rows} rows")
        if n_tokens is not None and (n_tokens > rows or (vocab is None and n_tokens != rows)):
            self.refuse(
                keys.Tokenizer.LIST,
                f"a list of {n_tokens} tokens",
                f"token_embd.weight has {rows} rows (one per token)",
            )
        head = self.shapes.get("output.weight")
        if head is not None and head != (hidden, rows):
            self.refuse(
                keys.LLM.EMBEDDING_LENGTH,
                hidden,
                f"output.weight has shape {list(head)}, not [{hidden}, {rows}] (token_embd's)",
            )
        return n_tokens

    def head_width(self, heads: int, hidden: int) -> tuple[str, int]:
        # the key transformers reads the head width from for this architecture (llama:
        # rope.dimension_count, gemma2: attention.key_length), else hidden / heads as its
        # configs default to
        import gguf
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        mapping = GGUF_CONFIG_MAPPING.get(self.arch, {})
        for suffix in (
            gguf.Keys.Attention.KEY_LENGTH, gguf.Keys.Rope.DIMENSION_COUNT,
        ):  # fmt: skip
            bare = suffix.removeprefix("{arch}.")
            if mapping.get(bare) == "head_dim":
                value = self.integer(suffix)
                if value is not None:
                    return suffix, value
        if hidden % heads:
            self.refuse(
                gguf.Keys.Attention.HEAD_COUNT,
                heads,
                f"the stream ({hidden} wide, token_embd.weight) is not a whole number of heads",
            )
        return gguf.Keys.Attention.HEAD_COUNT, hidden // heads

    def check_layer_shapes(self, hidden: int) -> None:
        import gguf

        keys = gguf.Keys
        kinds = {kind for tensors in self.blocks.values() for kind in tensors}
        # per tensor kind: the key to blame, its value, the shape the header gives, and how
        expected: dict[str, tuple[str, int, tuple[int, ...], str]] = {}
        stream = f"the stream of {hidden} (embedding_length)"
        for norm in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"):
            expected[f"{norm}.weight"] = (keys.LLM.EMBEDDING_LENGTH, hidden, (hidden,), stream)
        if kinds & {"attn_q.weight", "attn_k.weight", "attn_v.weight"}:
            heads = self.integer(keys.Attention.HEAD_COUNT, required=True)
            kv = self.integer(keys.Attention.HEAD_COUNT_KV)
            kv_key = keys.Attention.HEAD_COUNT_KV if kv is not None else keys.Attention.HEAD_COUNT
            kv = heads if kv is None else kv
            if heads % kv:
                self.refuse(kv_key, kv, f"{heads} query heads do not share it in whole groups")
            width_key, width = self.head_width(heads, hidden)
            source = self.key(width_key)
            q, k = heads * width, kv * width
            query = f"{heads} query heads of width {width}, from {source}"
            key_value = f"{kv} key/value heads of width {width}, from {source}"
            q_key, h = keys.Attention.HEAD_COUNT, heads
            expected.update({
                "attn_q.weight": (q_key, h, (hidden, q), query),
                "attn_q.bias": (q_key, h, (q,), query),
                "attn_k.weight": (kv_key, kv, (hidden, k), key_value),
                "attn_k.bias": (kv_key, kv, (k,), key_value),
                "attn_v.weight": (kv_key, kv, (hidden, k), key_value),
                "attn_v.bias": (kv_key, kv, (k,), key_value),
                "attn_output.weight": (q_key, h, (q, hidden), query),
                "attn_q_norm.weight": (width_key, width, (width,), f"heads of width {width}"),
                "attn_k_norm.weight": (width_key, width, (width,), f"heads of width {width}"),
            })  # fmt: skip
        if kinds & {"ffn_up.weight", "ffn_gate.weight", "ffn_down.weight"}:
            ffn = self.integer(keys.LLM.FEED_FORWARD_LENGTH, required=True)
            for kind, shape in (
                ("ffn_gate.weight", (hidden, ffn)), ("ffn_up.weight", (hidden, ffn)),
                ("ffn_down.weight", (ffn, hidden)),
            ):  # fmt: skip
                expected[kind] = (keys.LLM.FEED_FORWARD_LENGTH, ffn, shape, stream)
        experts = sorted(k for k in kinds if k.endswith("_exps.weight"))
        n_experts = self.integer(keys.LLM.EXPERT_COUNT, required=bool(experts))
        for index in sorted(self.blocks):
            for kind, shape in self.blocks[index].items():
                if kind in expected and shape != expected[kind][2]:
                    template, value, want, how = expected[kind]
                    self.refuse(
                        template,
                        value,
                        f"blk.{index}.{kind} has shape {list(shape)} where the header gives "
                        f"{list(want)} ({how}; GGUF order, fastest dimension first)",
                    )
                if kind in experts and (len(shape) != 3 or shape[2] != n_experts):
                    self.refuse(
                        keys.LLM.EXPERT_COUNT,
                        n_experts,
                        f"blk.{index}.{kind} has shape {list(shape)} (experts last)",
                    )
