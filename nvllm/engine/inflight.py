"""Asynchronous scheduling's launched step: the tokens it samples stay on the device (``PendingTokens``) while
the host schedules and launches the next step, whose inputs take them on the device (``resolve_placeholders``);
each left a placeholder −1 − row at the end of its sequence's token ids (``InflightStep``), filled when the host
reads the tokens back. Speculative decoding's draft model hands its drafted tokens to the target's verify step
the same way (nvllm.spec.proposer.Drafts)."""

from __future__ import annotations

import torch

from nvllm.engine.sequence import Sequence
from nvllm.layers.sampler import host_tensor


class PendingTokens:
    """Tokens a step sampled (asynchronous scheduling) or drafted (speculative decoding), left on the device so
    the host can launch the step that takes them before they are known: the device tensor feeds that step's
    inputs, and a copy to pinned host memory is read once the step that made them is done. That copy runs on a
    stream of its own (``_copy_stream``): on the step's stream it sat between the sampler and the next step's input
    copy, one more transfer's latency between two steps."""

    def __init__(self, owners: list[Sequence], tokens: torch.Tensor):
        self.owners = owners  # the sequence of each row, in row order
        self.device = tokens
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            side = _copy_stream(tokens.device)
            side.wait_stream(torch.cuda.current_stream(tokens.device))
            with torch.cuda.stream(side):
                self._host.copy_(tokens, non_blocking=True)
                self._done = torch.cuda.Event()
                self._done.record(side)
            tokens.record_stream(side)   # not reused by the allocator before the copy has read it
        else:
            self._host, self._done = tokens, None

    def wait(self) -> list[int]:
        """The tokens on the host: waits for the step that samples them (and everything before it)."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that copies sampled tokens to the host, one per device."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def resolve_placeholders(input_ids: list[int], prev: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids on the device, each placeholder −1 − r replaced by row r of ``prev`` (tokens still on the device:
    the previous step's samples, or this step's drafts). When every id is the placeholder of its own row — a decode
    step of the sequences that sampled last step, in the same order — that is ``prev``'s first rows, a view: no
    copy to the device and no gather between the two steps."""
    n = len(input_ids)
    if prev.dim() == 1 and n <= prev.shape[0] and prev.dtype == torch.long and input_ids == list(range(-1, -1 - n, -1)):
        return prev[:n]
    ids = host_tensor(input_ids, torch.long, device)
    return torch.where(ids < 0, prev[(-1 - ids).clamp_(min=0)], ids)


class InflightStep:
    """A step launched with its sampled tokens left on the device (``execute(defer=True)``): its scheduled chunks,
    and one placeholder per sampled row appended to that row's sequence."""

    def __init__(self, scheduled: list[tuple[Sequence, int]], pending: PendingTokens):
        self.scheduled, self.pending = scheduled, pending
        self.slots: list[int | None] = []  # index of each row's placeholder in its sequence's token ids
        for row, seq in enumerate(pending.owners):
            if seq.finished:  # on the step before's token, read while this one ran: its sample is not wanted
                self.slots.append(None)
                continue
            seq.token_ids.append(-1 - row)
            seq.pending += 1
            self.slots.append(len(seq.token_ids) - 1)

    @property
    def tokens(self) -> torch.Tensor:
        """The sampled tokens on the device, for the next step's inputs."""
        return self.pending.device

    def read(self) -> list[tuple[Sequence, int, int]]:
        """Wait for the tokens and fill the placeholders of the sequences still unfinished (a finished one dropped
        its placeholders). Returns (sequence, length up to and including the token, token) per filled row."""
        filled = []
        for seq, slot, tok in zip(self.pending.owners, self.slots, self.pending.wait()):
            if slot is not None and not seq.finished:
                seq.token_ids[slot] = tok
                seq.pending -= 1
                filled.append((seq, slot + 1, tok))
        return filled
