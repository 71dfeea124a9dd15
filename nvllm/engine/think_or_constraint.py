"""The first token of a constrained reply from a model that opens its own reasoning block (``--reasoning-parser
qwen3``): either the block's opening token, after which the constraint waits for the block to close, or the first
token of the constrained reply itself. Waiting for a ``</think>`` that a non-thinking reply never writes would leave
it unconstrained (Qwen3-Instruct-2507 never opens a block; a hybrid Qwen3 does unless told not to).

``ThinkOrConstraint`` wraps the sequence's matcher with the interface the samplers use (``fill_next_token_bitmask``,
``accept_token``, ``rollback``, ``is_terminated``): until its first token is known it allows the constraint's tokens
and the opening token; once that token opened the block it allows everything (the engine then sets the constraint
aside until the block closes); otherwise it is the matcher."""

from __future__ import annotations

import torch


class ThinkOrConstraint:
    def __init__(self, matcher, open_id: int):
        self.inner, self.open_id = matcher, open_id
        self.history: list[bool] = []  # each accepted token: True for the opening one, False for one the matcher took

    @property
    def opened(self) -> bool:
        return bool(self.history) and self.history[0]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.opened:  # reasoning: nothing masked
            bitmask[row] = -1
            return
        self.inner.fill_next_token_bitmask(bitmask, row)
        if not self.history:  # the first token may also open the block
            word, bit = divmod(self.open_id, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # the bit as an int32

    def accept_token(self, token: int) -> bool:
        if self.opened or (not self.history and token == self.open_id):
            self.history.append(True)  # the block's opening, or a token inside it: the matcher never sees them
            return True
        if not self.inner.accept_token(token):
            return False
        self.history.append(False)
        return True

    def rollback(self, n: int) -> None:
        taken = self.history[len(self.history) - n:]
        del self.history[len(self.history) - n:]
        inner = sum(1 for opened in taken if not opened)
        if inner:
            self.inner.rollback(inner)

    def is_terminated(self) -> bool:
        return not self.opened and self.inner.is_terminated()
