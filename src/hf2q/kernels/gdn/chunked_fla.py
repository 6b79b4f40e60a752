"""Gated DeltaNet over many tokens (prefill, chunked prefill) through fla's Triton kernels.

Sequences are laid end to end and separated by `cu_seqlens`; each starts from its slot's state and its
final state is returned for the caller to scatter back. fla groups value heads as h // (n_v / n_k);
GGUF files tile them (h % n_k), so q and k are expanded to n_v heads in tiled order first.

Short batches (every sequence at most `RECURRENT_MAX_LEN` tokens: a follow-up turn after a prefix-cache hit
run eagerly) take fla's fused recurrent kernel: one launch and no host synchronisation, where the
chunked form launches about ten kernels and reads the sequence lengths back to the host, which costs more
than the arithmetic at that length. Training (inputs that need a gradient) keeps the chunked form: fla's
recurrent kernel has no backward.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

RECURRENT_MAX_LEN = 64
log = logging.getLogger(__name__)


def import_in_background() -> threading.Thread:
    """Import fla's delta-rule kernels on a thread of their own (started, returned). fla's package imports all
    its ops and torch's compiler stack on first use: seconds, and on a 9B start with no bytecode cached it was the
    most of the warm-up's first prefill. Begun once `hf2q serve` knows its device is CUDA, beside the rest of its
    start and the weights' load, it is done before the warm-up needs it.
    A failure is left for the import `chunk_gdn` makes, which reports it."""
    def run():
        t0 = time.monotonic()
        try:
            import fla.ops.gated_delta_rule  # noqa: F401
        except Exception as err:  # noqa: BLE001 - reported by the first real import
            log.debug("fla's kernels not imported ahead (%s)", err)
            return
        log.info("fla's kernels imported on a thread beside the start in %.1f s", time.monotonic() - t0)

    thread = threading.Thread(target=run, name="import-fla", daemon=True)
    thread.start()
    return thread


def chunk_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
              seq_lens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [T, nk, dk] raw (L2-normalised in the kernel); v: [T, nv, dv]; g: [T, nv] log-decay fp32;
    beta: [T, nv] fp32; initial_state: [N, nv, dk, dv] fp32; cu_seqlens: [N + 1] int64; seq_lens: the same
    lengths on the host, when the caller has them (saves a device-to-host read).
    Returns (o [T, nv, dv], final state [N, nv, dk, dv] fp32)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    rep = v.shape[1] // q.shape[1]
    if rep > 1:
        q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)
    # by keyword: the two functions' positional orders differ (the recurrent one takes gk, gv before beta)
    args = dict(q=q.unsqueeze(0).contiguous(), k=k.unsqueeze(0).contiguous(), v=v.unsqueeze(0).contiguous(),
                g=g.unsqueeze(0).contiguous(), beta=beta.unsqueeze(0).to(q.dtype).contiguous(), scale=scale,
                initial_state=initial_state.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu_seqlens)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, initial_state))
    short = seq_lens is not None and max(seq_lens, default=0) <= RECURRENT_MAX_LEN
    if short and not needs_grad:
        o, final = fused_recurrent_gated_delta_rule(**args)
    else:
        cpu = _host_offsets(cu_seqlens, seq_lens) if seq_lens is not None else None
        o, final = chunk_gated_delta_rule(**args, cu_seqlens_cpu=cpu)
    return o[0], final


_LAST_OFFSETS: list = [None, (), None]  # the last call's cu_seqlens, its lengths and their host offsets


def _host_offsets(cu_seqlens: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """The sequences' offsets on the host, the same tensor for every layer of a forward (the same `cu_seqlens`
    and lengths): fla keeps its chunk indices by its arguments' identity, so a new tensor a layer made it
    compute them again and copy them to the device, 24 times a step on the 9B."""
    lens = tuple(seq_lens)
    last, last_lens, offsets = _LAST_OFFSETS
    if last is not cu_seqlens or last_lens != lens:
        offsets = torch.tensor([0, *itertools.accumulate(lens)])
        _LAST_OFFSETS[:] = [cu_seqlens, lens, offsets]
    return offsets
