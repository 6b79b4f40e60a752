"""Speculative decoding in `/metrics`, with vLLM's names (hf2q_ for vllm:): the mean acceptance length is
1 + accepted_tokens / drafts, the acceptance rate accepted_tokens / draft_tokens."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class SpecMetrics:
    """Counters that advance by what the engine's `SpecStats` gained since the last step."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.drafts = Counter("hf2q_spec_decode_num_drafts", "Speculative verify rounds", registry=r)
        self.draft_tokens = Counter("hf2q_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("hf2q_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.per_pos = Counter("hf2q_spec_decode_num_accepted_tokens_per_pos",
                               "Rounds whose draft at this position (0 = first) was accepted", ["position"],
                               registry=r)
        self.length = Histogram("hf2q_spec_decode_acceptance_length", "Drafts accepted per verify round",
                                buckets=(0, 1, 2, 3, 4, 6, 8), registry=r)
        labels = ["proposer"]
        self.by_drafts = Counter("hf2q_spec_decode_proposer_num_drafts", "Verify rounds by proposer", labels,
                                 registry=r)
        self.by_draft_tokens = Counter("hf2q_spec_decode_proposer_num_draft_tokens", "Draft tokens by proposer",
                                       labels, registry=r)
        self.by_accepted = Counter("hf2q_spec_decode_proposer_num_accepted_tokens",
                                   "Accepted draft tokens by proposer", labels, registry=r)
        self.disabled = Counter("hf2q_spec_decode_cost_disabled",
                                "Requests whose proposer the cost control switched off", labels, registry=r)
        self.started_off = Counter("hf2q_spec_decode_started_off",
                                   "Requests that started with a proposer off, the cost control having turned it "
                                   "off for the requests before them", labels, registry=r)
        self.batch_disabled = Counter("hf2q_spec_decode_batch_disabled",
                                      "Requests whose MTP head went off in a batch too large to draft", registry=r)
        self._hist: list[int] = []
        self._totals = (0, 0, 0)
        self._batch_disabled = 0
        self._by: dict[str, tuple[int, ...]] = {}

    def observe(self, stats) -> None:
        now = (stats.rounds, stats.drafted, stats.accepted)
        for counter, new, old in zip((self.drafts, self.draft_tokens, self.accepted), now, self._totals):
            if new > old:
                counter.inc(new - old)
        self._totals = now
        hist = list(stats.accepted_hist)
        seen = self._hist + [0] * (len(hist) - len(self._hist))
        for n, (new, old) in enumerate(zip(hist, seen)):
            for _ in range(new - old):
                self.length.observe(n)
            if new > old:
                for pos in range(n):
                    self.per_pos.labels(position=str(pos)).inc(new - old)
        self._hist = hist
        for name, counts in stats.by_proposer.items():
            now = (*counts, stats.cost_disabled.get(name, 0), stats.started_off.get(name, 0))
            old = self._by.get(name, (0,) * len(now))
            for counter, new, was in zip((self.by_drafts, self.by_draft_tokens, self.by_accepted, self.disabled,
                                          self.started_off), now, old):
                if new > was:
                    counter.labels(proposer=name).inc(new - was)
            self._by[name] = now
        if stats.batch_disabled > self._batch_disabled:
            self.batch_disabled.inc(stats.batch_disabled - self._batch_disabled)
        self._batch_disabled = stats.batch_disabled
