"""Batched token sampling that honours every `SamplingParams` knob, reproducibly per row.

Order of processing, as vLLM: logit_bias, repetition / presence / frequency penalties, min_tokens (ban EOS
and stop ids), then temperature, top_k, top_p, min_p, then a draw with the row's own generator. Greedy
rows (temperature 0) take the argmax after bias, penalties and min_tokens. Work for a knob is skipped when
no row of the batch uses it, and each step touches the vocabulary a fixed number of times, never per row.
"""
from __future__ import annotations

import collections

import secrets
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from hf2q.devices import upload as _upload
from hf2q.engine.sampling_params import SamplingParams

# Truncating rows look for their kept tokens among this many most likely ones, widening the window for
# flatter rows, and falling back to sorting the whole row (topk costs grow with the window on CPU).
CANDIDATE_WINDOWS = (256, 4096)
# The exponential race runs over blocks of this many tokens (see `_exponential_race`).
RACE_BLOCK = 256


class _TokenCounts:
    """Distinct token ids with their counts.

    Counted in a dict; the tensors a penalty gathers are built when a penalty first reads them and kept up
    to date from then on, so a row without penalties pays no tensor operation per token (at 64 rows those
    were a millisecond of every decode step)."""

    def __init__(self) -> None:
        self._count: collections.Counter[int] = collections.Counter()
        self._slot: dict[int, int] | None = None  # token -> index in the tensors, once they exist
        self._ids = torch.empty(0, dtype=torch.long)
        self._counts = torch.empty(0, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self._count)

    def add(self, token: int, count: int = 1) -> None:
        self._count[token] += count
        if self._slot is not None:
            self._track(token, count)

    def add_many(self, tokens: Sequence[int]) -> None:
        if self._slot is not None:
            for token, count in collections.Counter(tokens).items():
                self.add(token, count)
        else:
            self._count.update(tokens)

    def _track(self, token: int, count: int) -> None:
        slot = self._slot.get(token)
        if slot is not None:
            self._counts[slot] += count
            return
        slot = len(self._slot)
        if slot == self._ids.numel():
            self._ids = torch.cat([self._ids, torch.empty_like(self._ids)])
            self._counts = torch.cat([self._counts, torch.empty_like(self._counts)])
        self._slot[token] = slot
        self._ids[slot] = token
        self._counts[slot] = count

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self._count)
        if self._slot is None:
            self._slot = {token: i for i, token in enumerate(self._count)}
            self._ids = torch.empty(max(64, 2 * n), dtype=torch.long)
            self._counts = torch.empty(max(64, 2 * n), dtype=torch.float32)
            self._ids[:n] = torch.tensor(list(self._count.keys()), dtype=torch.long)
            self._counts[:n] = torch.tensor(list(self._count.values()), dtype=torch.float32)
        return self._ids[:n], self._counts[:n]

    @property
    def ids(self) -> torch.Tensor:
        return self._tensors()[0]

    @property
    def counts(self) -> torch.Tensor:
        return self._tensors()[1]


class RowState:
    """One sequence's sampling state: params, its own generator, and the token history for penalties.

    The generator lives on the CPU and only this row draws from it, a fixed number of values per sampled
    step, so a seeded row draws the same tokens whatever else is in the batch and in whatever order.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (),
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator()
        self.generator.manual_seed(self.seed % 2**64)
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.seen = _TokenCounts()  # prompt and output: the repetition penalty's set
        self.seen.add_many(self.prompt_ids)
        self.output = _TokenCounts()  # output only: presence and frequency penalties
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        # What min_tokens bans until enough tokens are out.
        self.stop_token_ids = tuple(sorted(set(eos) | set(params.stop_token_ids)))
        self.bias_ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long)
        self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)

    def append(self, token: int) -> None:
        """Record a generated token (counts are updated incrementally, never recounted)."""
        self.output_ids.append(token)
        self.seen.add(token)
        self.output.add(token)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's raw logprob; None for rows that did not ask
    top_logprobs: list[list[tuple[int, float]] | None]  # most likely first; None for rows that did not ask


class Sampler:
    """Samples one token per row of a [B, V] fp32 logits batch.

    Logprobs are "raw", as vLLM's default: log_softmax of the logits as the model gave them, before bias,
    penalties, temperature and truncation, so they describe the model rather than the sampling knobs.
    `logits` is used as scratch and modified in place (no [B, V] copy per step).
    """

    def sample(self, logits: torch.Tensor, rows: Sequence[RowState]) -> SampleResult:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one row of logits per RowState"
        assert logits.is_contiguous(), "logits are edited through a flat view"
        raw = self._raw_logprobs(logits, rows)
        return self._result(self.draw(logits, rows), raw, rows)

    def draw(self, logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
        """The tokens [B] on the logits' device, no logprobs. For rows that `draws_without_host(r)`, nothing
        here waits for the device, so the next step can be queued before the host reads these tokens."""
        self.apply_processors(logits, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            _put(tokens, greedy, _take(logits, greedy).argmax(-1))
        if sampled:
            _put(tokens, sampled, _sample_rows(_take(logits, sampled), [rows[i] for i in sampled]))
        return tokens

    @staticmethod
    def draws_without_host(row: RowState) -> bool:
        """Whether a row's next draw needs nothing the host learns from its previous token and never waits
        for the device: no penalties (they count the tokens), no min_tokens (it counts them), no logprobs (read
        back), and no top-p / min-p without a top-k that the first candidate window holds (whether a window
        held a row's kept tokens is read back)."""
        p = row.params
        truncates = p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
        return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
                and (p.min_tokens == 0 or not row.stop_token_ids) and not p.logprobs
                and (p.greedy or not truncates or _fits_top_k(p, CANDIDATE_WINDOWS[0])))

    def apply_processors(self, logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
        """logit_bias, penalties and min_tokens, in place: the logits greedy rows take the argmax of."""
        self._apply_logit_bias(logits, rows)
        self._apply_penalties(logits, rows)
        self._apply_min_tokens(logits, rows)
        return logits

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: Sequence[RowState]):
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        if not want:
            return None
        return want, torch.log_softmax(_take(logits, want).float(), dim=-1)

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
        which = [i for i, r in enumerate(rows) if r.bias_ids.numel()]
        if not which:
            return
        flat = _flat_index([rows[i].bias_ids for i in which], which, logits.shape[1], logits.device)
        values = _upload(torch.cat([rows[i].bias_values for i in which]), logits.device)
        logits.view(-1).index_add_(0, flat, values)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
        v, device = logits.shape[1], logits.device
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0 and len(r.seen)]
        if rep:
            ids = [rows[i].seen.ids for i in rep]
            flat = _flat_index(ids, rep, v, device)
            penalty = torch.cat([torch.full((t.numel(),), rows[i].params.repetition_penalty)
                                 for t, i in zip(ids, rep)]).to(device)
            vals = logits.view(-1)[flat]
            logits.view(-1)[flat] = torch.where(vals > 0, vals / penalty, vals * penalty)

        additive = [i for i, r in enumerate(rows) if len(r.output)
                    and (r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0)]
        if additive:
            flat = _flat_index([rows[i].output.ids for i in additive], additive, v, device)
            # per token: frequency * count + presence, the OpenAI formula
            delta = torch.cat([rows[i].output.counts * rows[i].params.frequency_penalty
                               + rows[i].params.presence_penalty for i in additive]).to(device)
            logits.view(-1).index_add_(0, flat, -delta)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
        which = [i for i, r in enumerate(rows)
                 if r.stop_token_ids and r.num_output_tokens < r.params.min_tokens]
        if not which:
            return
        ids = [torch.tensor(rows[i].stop_token_ids, dtype=torch.long) for i in which]
        logits.view(-1)[_flat_index(ids, which, logits.shape[1], logits.device)] = float("-inf")

    @staticmethod
    def _result(tokens: torch.Tensor, raw, rows: Sequence[RowState]) -> SampleResult:
        token_ids = tokens.tolist()
        logprobs: list[float | None] = [None] * len(rows)
        top: list[list[tuple[int, float]] | None] = [None] * len(rows)
        if raw is not None:
            want, lp = raw
            chosen = lp.gather(1, tokens[want].unsqueeze(1)).squeeze(1).tolist()
            n_top = max(rows[i].params.top_logprobs for i in want)
            top_vals, top_ids = (lp.topk(n_top, dim=-1) if n_top else (lp[:, :0], lp[:, :0].long()))
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(want):
                n = rows[i].params.top_logprobs
                logprobs[i] = chosen[j]
                top[i] = list(zip(top_ids[j][:n], top_vals[j][:n]))
        return SampleResult(token_ids, logprobs, top)


def _index(index: list[int], device) -> torch.Tensor:
    return _upload(torch.tensor(index, dtype=torch.long), device)


def _take(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """The given rows; the tensor itself (no copy) when that is every row in order."""
    if index == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, _index(index, logits.device))


def _put(out: torch.Tensor, index: list[int], values: torch.Tensor) -> None:
    """out[index] = values (rows), through a device-side index."""
    if index == list(range(out.shape[0])):
        out.copy_(values)
    else:
        out.index_copy_(0, _index(index, out.device), values)


def _flat_index(ids: list[torch.Tensor], rows: list[int], vocab: int, device) -> torch.Tensor:
    """Indices into the flattened [B * V] logits of each listed row's tokens (1-D indexing is the fast one)."""
    return _upload(torch.cat([t + row * vocab for t, row in zip(ids, rows)]), device)


def _per_row(rows: Sequence[RowState], get, device, dtype=torch.float32) -> torch.Tensor:
    return _upload(torch.tensor([get(r.params) for r in rows], dtype=dtype), device)


def _sample_rows(logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p, then an exponential race per row. `logits` [S, V] may be modified.

    Rows that truncate (top_k / top_p / min_p) work on their most likely tokens only, found by `topk`, so they
    never normalise or mask the whole vocabulary; the other rows take the dense path.
    """
    device, v = logits.device, logits.shape[1]
    if any(r.params.temperature != 1.0 for r in rows):
        logits.div_(_per_row(rows, lambda p: p.temperature, device).unsqueeze(1))
    noise = _race_noise(rows, v, device)
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)

    pending = [i for i, r in enumerate(rows) if _truncates(r.params, v)]
    dense = [i for i, r in enumerate(rows) if not _truncates(r.params, v)]
    for window in (*CANDIDATE_WINDOWS, v):
        if not pending:
            break
        sub = [rows[i] for i in pending]
        got, done = _sample_candidates(_take(logits, pending), sub, _take(noise, pending), min(window, v))
        if all(_fits_top_k(r.params, window) for r in sub):  # done by construction: no need to read `done`
            _put(tokens, pending, got)
            break
        finished = [i for i, ok in zip(pending, done.tolist()) if ok]
        tokens[finished] = got[done]
        pending = [i for i, ok in zip(pending, done.tolist()) if not ok]
    if dense:
        _put(tokens, dense, _exponential_race(torch.softmax(_take(logits, dense), dim=-1), None, _take(noise, dense)))
    return tokens


def _fits_top_k(p: SamplingParams, window: int) -> bool:
    """A top_k that a candidate window holds: the row is sampled among its window's tokens whatever they are."""
    return 0 < p.top_k <= window


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _sample_candidates(logits: torch.Tensor, rows: Sequence[RowState], noise: torch.Tensor, window: int):
    """Sample among each row's `window` most likely tokens: (tokens [R], done [R] bool).

    A row is done when its top_k fits the window or its kept set (top_p nucleus, min_p set) ends inside
    it; otherwise it is retried with a wider window. Its noise is keyed by token id, not by rank, so the
    window never changes the result.
    """
    device, v = logits.device, logits.shape[1]
    has_k = [0 < r.params.top_k < v for r in rows]
    fits_k = [k and r.params.top_k <= window for r, k in zip(rows, has_k)]
    ks = torch.tensor([r.params.top_k if f else window for r, f in zip(rows, fits_k)])
    vals, ids = logits.topk(int(ks.max()), dim=-1)  # [R, k_max], most likely first
    outside = torch.arange(vals.shape[1]).unsqueeze(0) >= ks.unsqueeze(1)
    vals.masked_fill_(_upload(outside, device), float("-inf"))
    # top_k renormalises over its k tokens; top_p alone needs the whole row's normaliser; min_p needs none.
    norm = vals.logsumexp(-1, keepdim=True)
    full = [j for j, r in enumerate(rows) if not has_k[j] and r.params.top_p < 1.0]
    if full:
        norm[full] = _take(logits, full).logsumexp(-1, keepdim=True)
    probs = (vals - norm).exp()

    top_p = _per_row(rows, lambda p: p.top_p, device).unsqueeze(1)
    min_p = _per_row(rows, lambda p: p.min_p, device).unsqueeze(1)
    keep = (probs.cumsum(-1) - probs < top_p) & (probs >= min_p * probs[:, :1])
    # Done when top_k fits, or, with no top_k, when the kept set ends inside the window.
    ends_inside = ~keep[:, -1] & ~_upload(torch.tensor(has_k), device)
    done = _upload(torch.tensor(fits_k), device) | (vals.shape[1] == v) | ends_inside
    return _exponential_race(probs * keep, ids, noise), done


def _race_noise(rows: Sequence[RowState], vocab: int, device) -> torch.Tensor:
    """[S, blocks + RACE_BLOCK] Exp(1) draws, each row from its own generator, a count fixed by the vocab."""
    nb = -(-vocab // RACE_BLOCK)
    noise = torch.stack([torch.empty(nb + RACE_BLOCK).exponential_(generator=r.generator) for r in rows])
    return _upload(noise.clamp_(min=torch.finfo(torch.float32).tiny), device)  # q = 0 would make 0/0


def _exponential_race(probs: torch.Tensor, ids: torch.Tensor | None, noise: torch.Tensor) -> torch.Tensor:
    """Token per row with probability proportional to `probs` (unnormalised): [S, V] over the vocabulary
    (ids None), or [S, W] over the token ids `ids` [S, W]. `noise` comes from `_race_noise`.

    The exponential race (argmax p_i / q_i, q_i ~ Exp(1)) is torch.multinomial's own method and, unlike an
    inverse CDF, moves only when logits move near the winner, so tiny numeric changes rarely change the
    token. Racing the vocabulary's blocks of RACE_BLOCK tokens by their mass, then the tokens of the
    winning block, is the same distribution with V / RACE_BLOCK + RACE_BLOCK draws instead of V (a
    full-vocabulary draw costs more than the rest of the step on a CPU). The noise is keyed by token id,
    so a token faces the same q dense or among candidates. Zero-probability tokens never win.
    """
    s, nb = probs.shape[0], noise.shape[1] - RACE_BLOCK
    block_q, inner_q = noise[:, :nb], noise[:, nb:]
    if ids is None:
        pad = nb * RACE_BLOCK - probs.shape[1]
        padded = F.pad(probs, (0, pad)) if pad else probs
        blocks = padded.view(s, nb, RACE_BLOCK)
        b = (blocks.sum(-1) / block_q).argmax(-1)  # [S]
        inner = blocks[torch.arange(s, device=probs.device), b]  # [S, RACE_BLOCK]
        return b * RACE_BLOCK + (inner / inner_q).argmax(-1)
    block_mass = torch.zeros(s, nb, dtype=probs.dtype, device=probs.device)
    block_mass.scatter_add_(1, ids // RACE_BLOCK, probs)
    b = (block_mass / block_q).argmax(-1, keepdim=True)  # [S, 1]
    score = torch.where(ids // RACE_BLOCK == b, probs / inner_q.gather(1, ids % RACE_BLOCK), -1.0)
    return ids.gather(1, score.argmax(-1, keepdim=True)).squeeze(1)
