"""The engine's side of speculation: draft before scheduling, settle the cache after verifying.

A speculating request's step feeds its known tokens plus k drafts (one chunk, one forward). The engine
then decides row by row exactly as plain decoding would (same sampler, grammar, budget, stop rules);
row i + 1 is valid only while the token decided at row i equals draft i. When every draft is accepted
the cache already holds the right prefix. Otherwise the slot takes the DeltaNet state the verify forward
kept after the last accepted position (hf2q.spec.states) and the K/V past it is dropped: the slot is then
exactly what plain decoding leaves, and no accepted token is fed again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import time
from typing import Callable, Optional

import torch

from hf2q.cache.hybrid import HybridCache
from hf2q.devices import upload
from hf2q.engine.request import Request
from hf2q.spec.cost import CostController
from hf2q.spec.mtp import MTPProposer
from hf2q.spec.ngram import NgramProposer
from hf2q.spec.proposer import Proposer, SpecConfig, TokenView
from hf2q.spec.states import KeptRow, PositionStates


@dataclass
class Verify:
    """One request's verify in flight: set by the runner, consumed by the engine in the same step."""

    start: int  # num_computed before the forward
    known: int  # tokens of the chunk before the drafts (at least 1: the last decided token)
    drafts: list[int]
    states: PositionStates | KeptRow  # DeltaNet state after each of the chunk's positions (`at(t)`)
    logits: Optional[torch.Tensor] = None  # [len(drafts), V]: row i is the prediction after drafts[i]


PROPOSERS = ("ngram", "mtp")
# A proposer the cost control turned off for this many requests in a row, with no window won since, starts
# off for new requests, but for one new request in PROBE_EVERY, which tries it for one window. At
# acceptance 0 each request before the streak pays its 8 losing rounds (about 55 ms of a 256-token request, 9B Q4_K_M
# with an MTP head, H100): with a streak of 4, 12 requests in turn ran at 0.953x the tok/s of no speculation.
STREAK_TO_START_OFF = 2
PROBE_EVERY = 8


@dataclass
class SpecStats:
    rounds: int = 0  # verify forwards a request took part in
    drafted: int = 0
    accepted: int = 0
    accepted_hist: list[int] = field(default_factory=list)  # [n]: rounds that accepted n drafts
    by_proposer: dict[str, list[int]] = field(  # proposer -> [rounds, drafted, accepted]
        default_factory=lambda: {name: [0, 0, 0] for name in PROPOSERS})
    cost_disabled: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROPOSERS, 0))  # requests
    batch_disabled: int = 0  # requests whose MTP head went off in a batch too large to draft
    started_off: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROPOSERS, 0))  # requests

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculator:
    """Drafts for the running requests, and the cost control that decides who may draft (hf2q.spec.cost):
    each request has a controller per proposer, fed with the step times this engine measures; no request
    drafts while `max_batch` or more requests decode (a large batch is already compute-bound), and the MTP head
    goes off for good for the requests of such a batch (`_batch_off`)."""

    def __init__(self, config: SpecConfig, cache: HybridCache, net=None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.cache = cache
        self.clock = clock
        self.mtp = MTPProposer(net, cache) if "mtp" in config.method else None
        self.ngram = "ngram" in config.method
        self._step_start, self._decoding, self._rounds = 0.0, {}, {}
        self._head_s = 0.0  # this step's MTP head work when nobody drafts with it: no part of a plain step
        self.forget_history()

    def forget_history(self) -> None:
        """Start the counts and the cost control's memory across requests afresh (at construction, and after the
        warm-up's throwaway requests)."""
        self.stats = SpecStats(accepted_hist=[0] * (self.config.num_tokens + 1))
        self._losing_streak = dict.fromkeys(PROPOSERS, 0)  # requests in a row whose proposer the control turned off
        self._since_losing = dict.fromkeys(PROPOSERS, 0)  # new requests since the streak was reached

    def new_proposer(self) -> Proposer:
        return NgramProposer(self.config.ngram_min, self.config.ngram_max)

    def propose(self, running: list[Request]) -> None:
        """Set each running request's drafts for the coming step. Only requests past their prompt draft,
        and never more than fit in what is left of max_tokens after the step's own token. With both
        proposers, an n-gram match is taken first (a repeat of the history is the likelier guess), else
        the MTP head drafts; the head sees every forward either way while it is on, to keep its K/V in step.
        Also starts the step's clock."""
        self._step_start, self._rounds, self._head_s = self.clock(), {}, 0.0
        # the decoding requests (id -> whether this is their first decode step)
        self._decoding = {id(r): len(r.output_ids) == 1 for r in running if r.output_ids and not r.finished}
        small = len(self._decoding) < self.config.max_batch
        live = [req for req in running if not req.finished]
        for req in running:
            req.draft_ids = []
            if not req.finished and "cost" not in req.extras:  # built once per request, not every step
                req.extras["cost"] = self._controllers()
        if self.mtp is not None and not small:
            self._batch_off(live)
        by_mtp = []  # (request, k) the head drafts for, all at once
        for req in live:
            costs = req.extras["cost"]
            k = max(0, min(self.config.num_tokens, req.max_total_len - req.num_tokens - 1)) if req.output_ids else 0
            k = k if small else 0
            drafts = self._ngram(req, k) if self.ngram and k and costs["ngram"].may_speculate() else []
            req.extras["drafted_by"] = "ngram"
            if self.mtp is not None and costs["mtp"].enabled and not drafts:
                req.extras["drafted_by"] = "mtp"
                if k and costs["mtp"].may_speculate():
                    by_mtp.append((req, k))
            req.draft_ids = drafts[:k]
        if self.mtp is not None:  # the head catches up on every forward while it is on, drafting or not
            heads = [req for req in live if req.extras["cost"]["mtp"].enabled]
            plain = bool(heads) and not by_mtp  # a plain step's head work, timed to keep it out of the baseline
            start = self._synced_clock() if plain else 0.0
            drafted = self.mtp.catch_up_and_draft(heads, by_mtp)
            self._head_s = self._synced_clock() - start if plain else 0.0
            for req, k in by_mtp:
                req.draft_ids = drafted[req.request_id][:k]

    def _controllers(self) -> dict[str, CostController]:
        """A new request's cost controller per proposer. One that the control turned off for the last
        STREAK_TO_START_OFF requests in a row starts off, but for one new request in PROBE_EVERY, which tries it
        for one window (a window it wins ends the streak; one it loses turns it off): turning a proposer off takes 8 losing rounds, which at
        acceptance 0 cost every request about 6% of its time (9B Q4_K_M with an MTP head, one stream, H100)."""
        costs = {}
        for name in PROPOSERS:
            cost = costs[name] = CostController(self.config.cost_window)
            if self._losing_streak[name] >= STREAK_TO_START_OFF:
                self._since_losing[name] += 1
                if self._since_losing[name] % PROBE_EVERY:
                    cost.enabled = False
                    self.stats.started_off[name] += 1
                else:  # the probe: one losing window turns it off (the streak already says it lost twice)
                    cost.patience = 1
        return costs

    def _synced_clock(self) -> float:
        """The clock once the device has finished what was queued."""
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)
        return self.clock()

    def _batch_off(self, reqs: list[Request]) -> None:
        """A batch of `max_batch` or more drafts nothing, and keeping the MTP head in step would cost every
        step a head forward over every row (at 64 streams that halved the output rate on an H100): the head is
        off for the rest of these requests, as when its cost control turns it off; n-gram drafts are unaffected."""
        for req in reqs:
            mtp = req.extras["cost"]["mtp"]
            if mtp.enabled:
                mtp.enabled = False
                req.extras.pop("mtp_rows", None)
                self.stats.batch_disabled += 1

    def catch_up_queued(self, reqs: list[Request], next_ids: torch.Tensor) -> None:
        """Before a decode step of `reqs` is queued ahead of the host (async scheduling, where nobody drafts):
        the MTP head takes their rows of the step before it, fed that step's tokens still on the device
        (`next_ids`), so its K/V stays in step with the target's for when drafting resumes. A step of `max_batch`
        or more requests turns the head off for them instead (`_batch_off`): a batch can grow that large in steps
        that are queued ahead, with no `propose` in between."""
        if self.mtp is None:
            return
        if len(reqs) >= self.config.max_batch:  # a batch that drafts nothing: the head goes off, as in `propose`
            self._batch_off([req for req in reqs if "cost" in req.extras])
            return
        on = [i for i, req in enumerate(reqs) if "cost" not in req.extras or req.extras["cost"]["mtp"].enabled]
        if len(on) < len(reqs):
            if not on:
                return
            next_ids = next_ids.index_select(0, upload(torch.tensor(on, dtype=torch.long), next_ids.device))
        self.mtp.catch_up_queued([reqs[i] for i in on], next_ids)

    def observe_step(self, sampled: list[Request]) -> None:
        """Feed the step's time (taken once the device is done) to the cost controllers of the requests that
        decoded in it: a round for the proposer that drafted, a plain step for both otherwise. A request's first
        decode step is no baseline: it carries one-off work (the MTP head's catch-up over the whole prompt), and
        on an H100 a baseline that included it kept a head whose drafts were never accepted drafting. Nor is the
        head's catch-up in a plain step part of the baseline (`_head_s`): off, the head costs nothing, and
        with it in the baseline, a head drafting at half plain decoding's speed looked like a gain (H100)."""
        elapsed = self._synced_clock() - self._step_start
        for req in sampled:
            if id(req) not in self._decoding:
                continue  # its first token came from its prompt: not a decode step
            costs = req.extras["cost"]
            tokens = self._rounds.get(id(req))
            if tokens is None:
                if self._decoding[id(req)]:
                    continue  # its first decode step: no baseline
                for cost in costs.values():
                    cost.observe_plain(elapsed - self._head_s)
            else:
                name, cost = req.extras["drafted_by"], costs[req.extras["drafted_by"]]
                won = cost.windows_won
                if cost.enabled and not cost.observe_round(tokens, elapsed):
                    self.stats.cost_disabled[name] += 1
                    self._losing_streak[name] += 1
                elif cost.windows_won > won:
                    self._losing_streak[name], self._since_losing[name] = 0, 0

    def may_draft_after_one_more(self, req: Request) -> bool:
        """Whether `req` could draft once the token of the step now on the device (not read yet) is appended:
        room for a draft left, and a proposer still on that could propose. Where no request of a batch could,
        its next step may be queued ahead of the host at any batch size (async scheduling): at acceptance 0 the
        cost control turns the proposers off, and speculation then costs nothing over plain decoding."""
        costs = req.extras.get("cost")
        if costs is None:
            return True  # not proposed for yet
        if req.max_total_len - req.num_tokens - 2 < 1:  # the room `propose` would find after that token
            return False
        if self.mtp is not None and costs["mtp"].enabled:
            return True
        if not (self.ngram and costs["ngram"].enabled):
            return False
        may = getattr(self._proposer(req), "may_propose_after_one_more", None)
        return may is None or may(TokenView(req.prompt_ids, req.output_ids))

    def _ngram(self, req: Request, k: int) -> list[int]:
        return self._proposer(req).propose(TokenView(req.prompt_ids, req.output_ids), k)

    def _proposer(self, req: Request) -> Proposer:
        proposer = req.extras.get("proposer")
        if proposer is None:
            proposer = req.extras["proposer"] = self.new_proposer()
        return proposer

    def settle(self, req: Request, verify: Verify, accepted: int) -> None:
        """Leave the slot as plain decoding would: valid through the last accepted draft, with the DeltaNet
        state kept at that position and the rejected positions' K/V dropped."""
        valid = verify.start + verify.known + accepted
        if accepted < len(verify.drafts):
            self.cache.set_linear_state(req.slot, verify.states.at(verify.known + accepted - 1))
            self.cache.rewind(req.slot, valid)
        req.num_computed = valid

    def record(self, req: Request, drafted: int, accepted: int, emitted: int) -> None:
        self._rounds[id(req)] = emitted
        s = self.stats
        s.rounds += 1
        s.drafted += drafted
        s.accepted += accepted
        s.accepted_hist[accepted] += 1
        mine = s.by_proposer[req.extras.get("drafted_by", "ngram")]
        mine[0], mine[1], mine[2] = mine[0] + 1, mine[1] + drafted, mine[2] + accepted

