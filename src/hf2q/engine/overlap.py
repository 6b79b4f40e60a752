"""Async scheduling: the host work of decode step t overlapped with the device work of step t+1.

A decode step whose rows all draw without the host (`Sampler.draws_without_host`) leaves its tokens on the
device; the next step is queued with those tokens as its input before the host reads them, then the host
appends them, checks stop rules and routes the outputs while the device computes. A request that finishes at
step t has already been fed into step t+1: that row's token is dropped, and the request gives up its slot once
step t+1 is read (its cache then holds every token of its prompt and output, which is what a retained prefix
records). Tokens are the ones plain stepping gives: the same rows, positions and draws.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hf2q.devices import upload
from hf2q.engine.request import Request


@dataclass
class LaunchedStep:
    """A decode step queued on the device whose tokens the host has not read yet."""
    requests: list[Request]
    tokens: torch.Tensor  # [n] on the device, row i is requests[i]'s
    host: torch.Tensor  # [n] the tokens' copy the host reads (pinned, filled by the stream, on CUDA)
    ready: Optional[torch.cuda.Event]  # recorded after the copy (None on the CPU)

    @classmethod
    def queue(cls, requests: list[Request], tokens: torch.Tensor) -> LaunchedStep:
        """Start the tokens' copy to the host now, before anything later is queued behind it."""
        if not tokens.is_cuda:
            return cls(requests, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(requests, tokens, host, ready)

    def token_ids(self) -> list[int]:
        """The tokens, waiting for this step only (not for what was queued after it)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def rows_of(self, requests: list[Request]) -> torch.Tensor:
        """This step's tokens for `requests` (a subset, in order): the next step's input ids."""
        if len(requests) == len(self.requests):
            return self.tokens
        index = {id(req): i for i, req in enumerate(self.requests)}
        rows = torch.tensor([index[id(req)] for req in requests], dtype=torch.long)
        return self.tokens.index_select(0, upload(rows, self.tokens.device))
