"""The token batch every analysis runs on: right-padded token ids and their mask.

Built by `cw_lens.data.inputs.prepare_inputs` (which turns text, lists, token tensors and
corpora into one); it lives with the models because capture runs the model on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch
from jaxtyping import Bool, Int

from cw_lens.core.registry import saveable
from cw_lens.core.schema import Axes


@saveable
@dataclass
class TokenBatch:
    """A right-padded batch of token ids with its mask.

    Attributes:
        tokens: Token ids, `[batch, pos]`.
        mask: True at real tokens, `[batch, pos]`; padding is only ever at the end of a row.
        prepend_bos: Whether position 0 of every row is the model's BOS token.
        bos_token: The BOS token string (`None` when the tokenizer has none).
        documents: Indices of the documents in this batch within the whole input.
    """

    tokens: Int[torch.Tensor, "batch pos"]
    mask: Bool[torch.Tensor, "batch pos"]
    prepend_bos: bool
    bos_token: str | None
    documents: Annotated[list[int], Axes("batch")]

    @property
    def lengths(self) -> Int[torch.Tensor, " batch"]:
        return self.mask.sum(-1)

    @property
    def padded(self) -> bool:
        return not bool(self.mask.all())

    def str_tokens(self, model: Any) -> list[list[str]]:
        """Token strings per row (padding excluded)."""
        tok = model.tokenizer
        out = []
        for row, n in zip(self.tokens.tolist(), self.lengths.tolist(), strict=False):
            ids = row[:n]
            if tok is None:
                out.append([str(i) for i in ids])
            else:
                out.append([tok.decode([i]) for i in ids])
        return out
