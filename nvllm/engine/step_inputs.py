"""StepInputs: what one model step needs on every rank, built on the host by rank 0's ModelRunner.

The flattened batch (token ids, positions, cache slots, query start offsets, context lengths, padded block
tables), the rows whose logits are wanted (rows to sample, rows of speculative chunks to verify, rows whose
prompt log-probabilities are reported) and, with LoRA, each token's adapter slot. With tensor parallelism rank 0
packs it into one int64 CPU tensor — a fixed header of lengths followed by the lists end to end — and broadcasts
that over the control group; the workers unpack it and run the same forward and the same LM-head calls. An empty
tensor means "shut down".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_HEADER = 9  # tokens, sequences, block-table width, logit rows, verify rows, prompt rows, max query, max context,
#              LoRA slots (0 or tokens)


@dataclass
class StepInputs:
    input_ids: list[int] | torch.Tensor  # a device tensor for draft steps and resolved placeholders (never packed)
    positions: list[int]
    slots: list[int]
    query_start_loc: list[int]  # num_seqs + 1 offsets into the flattened tokens
    context_lens: list[int]
    block_tables: list[list[int]]  # one row per sequence, padded with block 0 to a common width
    logit_rows: list[int] = field(default_factory=list)  # rows sampled this step
    verify_rows: list[int] = field(default_factory=list)  # speculative: every row of the verified chunks
    prompt_rows: list[int] = field(default_factory=list)  # rows whose prompt log-probabilities are reported
    max_query_len: int = 0
    max_context_len: int = 0
    has_placeholders: bool = False  # rank 0 only: some input ids stand for tokens still on the device
    lora_slots: list[int] | None = None  # each token's LoRA slot (−1: the base model); None when no token has one

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def pack(self) -> torch.Tensor:
        """The whole step as one 1-D int64 tensor: header, then every list in field order."""
        width = len(self.block_tables[0]) if self.block_tables else 0
        lora = self.lora_slots or []
        header = [len(self.input_ids), self.num_seqs, width, len(self.logit_rows), len(self.verify_rows),
                  len(self.prompt_rows), self.max_query_len, self.max_context_len, len(lora)]
        flat_tables = [b for row in self.block_tables for b in row]
        return torch.tensor(header + self.input_ids + self.positions + self.slots + self.query_start_loc
                            + self.context_lens + flat_tables + self.logit_rows + self.verify_rows
                            + self.prompt_rows + lora, dtype=torch.int64)

    @classmethod
    def unpack(cls, message: torch.Tensor) -> "StepInputs | None":
        """The inverse of ``pack``; None for the empty (shutdown) message."""
        if message.numel() == 0:
            return None
        values = message.tolist()
        tokens, seqs, width, n_logit, n_verify, n_prompt, max_q, max_ctx, n_lora = values[:_HEADER]
        pos = _HEADER

        def take(n: int) -> list[int]:
            nonlocal pos
            pos += n
            return values[pos - n:pos]

        ids, positions, slots = take(tokens), take(tokens), take(tokens)
        qsl, ctx = take(seqs + 1), take(seqs)
        flat = take(seqs * width)
        tables = [flat[i * width:(i + 1) * width] for i in range(seqs)]
        return cls(ids, positions, slots, qsl, ctx, tables, take(n_logit), take(n_verify), take(n_prompt),
                   max_q, max_ctx, lora_slots=take(n_lora) or None)


SHUTDOWN = torch.empty(0, dtype=torch.int64)
