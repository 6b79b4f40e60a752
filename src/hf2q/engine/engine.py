"""The engine: the only loop. Each step is schedule -> run -> update."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from hf2q import envs
from hf2q.cache.hybrid import HybridCache
from hf2q.cache.prefix_cache import PrefixCache
from hf2q.cache.prefix_store import PrefixStore, model_fingerprint
from hf2q.config import CacheConfig
from hf2q.engine.overlap import LaunchedStep
from hf2q.engine.prefill_graphs import MAX_ROWS
from hf2q.engine.prompt_outputs import POOLINGS, pool, prompt_logprobs
from hf2q.engine.request import Request, RequestOptions, RequestOutput, merge_outputs
from hf2q.engine.runner import ModelRunner
from hf2q.engine.sampler import RowState, SampleResult, Sampler
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import Scheduler, SchedulerConfig
from hf2q.engine.sequence_output import SequenceOutput
from hf2q.engine import throwaway
from hf2q.model import Model
from hf2q.spec.proposer import SpecConfig
from hf2q.spec.speculator import Speculator, Verify

log = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    """prompt + max_tokens exceeds the context; raised before any compute."""


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 4096
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    spec: SpecConfig = SpecConfig()
    # Queue each decode step before the host has read the previous step's tokens (hf2q.engine.overlap)
    async_scheduling: bool = False
    # Replay small steps with prefill rows in CUDA graphs too (hf2q.engine.prefill_graphs); a chat turn's anchor
    # then cuts its chunk where the rest fits a graph, rather than being kept from inside it
    short_prefill_graphs: bool = False


class Engine:
    cache_class: type[HybridCache] = HybridCache  # a tensor-parallel rank 0 builds one that logs its slot operations

    def __init__(self, model: Model, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        self.max_model_len = min(config.max_model_len, model.config.context_length)
        self.cache = self.cache_class(model.config, config.cache, device=model.device)
        cc = config.cache
        self.prefix = PrefixCache(self.cache, cc.prefix_cache_bytes, self._disk_store(model, cc)) \
            if cc.prefix_cache_bytes > 0 else None
        self.scheduler = Scheduler(self.cache, config.scheduler, self.prefix, cc.prefix_checkpoint_stride)
        self.spec = Speculator(config.spec, self.cache, model.net) if config.spec.enabled else None
        self.runner = ModelRunner(model.net, self.cache, mtp_rows=self.spec is not None and self.spec.mtp is not None,
                                  vision=getattr(model, "vision", None),
                                  short_prefill_graphs=config.short_prefill_graphs,
                                  verify_seqs=config.spec.max_batch if self.spec is not None else 0,
                                  max_seqs=config.scheduler.max_num_seqs)
        if self.spec is not None and self.spec.mtp is not None:  # its catch-up and drafts in graphs where they run
            self.spec.mtp.graphs = lambda: self.runner.mtp_graphs(config.spec.num_tokens)
        if self.runner.use_graphs and config.short_prefill_graphs:
            self.scheduler.graphed_prefill_rows = MAX_ROWS
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_batch = (0, 0)  # (sequences, tokens) of the latest step, for metrics
        self.async_scheduling = config.async_scheduling
        self.step_trace = envs.step_trace()
        self._launched: Optional[LaunchedStep] = None  # a decode step whose tokens the host has not read
        self._finishing: dict[str, bool] = {}  # request id -> retain?: finished while fed into the launched step
        self.steps_queued_ahead = 0  # for metrics

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: Optional[str] = None,
                    options: RequestOptions = RequestOptions()) -> Request:
        """Queue a request (`RequestOptions` says what it asks besides sampling). A grammar masks each sampled
        row to what it allows next and ends the request when complete; prompt logprobs come with the first
        output; a prefill-only request ends after its prompt, an embedding request (pooling "last" or "mean")
        with its one output carrying the embedding; an anchor keeps a checkpoint where the next turn will
        resume; images each fill one run of `num_tokens` image pad tokens of the prompt (the tower runs at
        prefill and the prefix cache keys on their content hashes)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        pooling, anchor = options.pooling, options.anchor
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        prefill_only = options.prefill_only or pooling is not None
        n = len(prompt_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        max_tokens = 0 if prefill_only else max_tokens
        if n + (0 if prefill_only else max(max_tokens, 1)) > self.max_model_len:
            raise PromptTooLong(f"this model's maximum context length is {self.max_model_len} tokens; the request "
                                f"has {n} prompt tokens and asks for {max_tokens} more")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        req = Request(request_id, list(prompt_ids), params, max_total_len=n + max_tokens, group=options.group,
                      prefill_only=prefill_only, prompt_logprobs=options.prompt_logprobs, pooling=pooling,
                      anchor=anchor if anchor is not None and 0 < anchor < n else None)
        if options.images:
            self._attach_images(req, list(options.images))
        grammar = options.grammar
        req.output = SequenceOutput(self.model, req, max_tokens, options.thinking_budget, options.starts_in_reasoning,
                                    options.scripted_ids, grammar.constraint() if grammar is not None else None)
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def prefill_in_background(self, prompt_ids: list[int]) -> Optional[Request]:
        """Queue a prefill of `prompt_ids` at the lowest priority that ends in a checkpoint there (see
        `Scheduler`): how a finished conversation's history will render in its next turn, which differs
        from what its turns computed. It resumes from the longest checkpoint it extends. None when nothing
        is queued: no prefix cache, a checkpoint or a queued prefill already covers these tokens, or they
        could not be a prompt."""
        prefix = self.scheduler.prefix
        n = len(prompt_ids)
        vocab = self.model.config.vocab_size
        if prefix is None or not 1 < n < self.max_model_len or any(not 0 <= t < vocab for t in prompt_ids):
            return None
        if prefix.holds(prompt_ids) or self.scheduler.has_background(list(prompt_ids)):
            prefix.stats.rerender_skipped += 1
            return None
        req = Request(f"background-{next(self._ids)}", list(prompt_ids), SamplingParams(), max_total_len=n,
                      prefill_only=True, background=True)
        self.scheduler.add_background(req)
        return req

    def _attach_images(self, req: Request, images: list) -> None:
        from hf2q.vision.prompt import image_pad_id
        from hf2q.vision.request_inputs import attach_images

        if getattr(self.model, "vision", None) is None:
            raise ValueError("this model has no vision tower: load it with its mmproj file to send images")
        if self.spec is not None:
            raise ValueError("images are not supported with speculative decoding")
        if req.keeps_hidden:
            raise ValueError("images are not supported with prompt logprobs or embeddings")
        attach_images(req, image_pad_id(self.model.tokenizer), images)

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req)
        return req.output.aborted()

    def warm_up(self) -> None:
        """Compile, tune and capture everything a first request would wait for (see ModelRunner.warm_up);
        call before taking requests. Autotuned kernels compile their candidates side by side meanwhile."""
        if self.runner.device.type != "cuda":  # nothing compiles
            return self._warm_up()
        from hf2q.kernels.tuning.parallel_compile import compile_candidates_in_parallel

        with compile_candidates_in_parallel(self._compile_workers()) as compiled:
            self._warm_up()
        log.info("warm-up: %s", compiled)

    def _disk_store(self, model: Model, cc: CacheConfig) -> Optional[PrefixStore]:
        """The checkpoint files of `--prefix-cache-dir`, if set (a tensor-parallel rank 0 keeps its shard's)."""
        if not cc.prefix_cache_dir:
            return None
        return PrefixStore(cc.prefix_cache_dir, cc.prefix_cache_disk_bytes, model_fingerprint(model, cc))

    def _compile_workers(self) -> int | None:
        """Threads for the warm-up's side-by-side compiles: None, as many as the host has cores."""
        return None

    def _warm_up_chunk(self) -> int:
        """A whole prefill chunk: the warm-up's prefill meets the prefill kernels' largest shape."""
        sched = self.config.scheduler
        return min(sched.prefill_chunk, sched.max_num_batched_tokens, self.max_model_len - 1)

    def _warm_up(self) -> None:
        # On CUDA a whole chunk; elsewhere nothing compiles.
        self.runner.warm_up(self.config.scheduler.max_num_seqs,
                            max(1, self._warm_up_chunk() if self.runner.device.type == "cuda" else 16))
        mtp_graphs = self.spec.mtp.graphs() if self.spec is not None and self.spec.mtp is not None else None
        if mtp_graphs is not None:
            mtp_graphs.capture()
        if self.runner.device.type == "cuda":  # elsewhere nothing compiles
            t0 = time.monotonic()
            self._warm_up_requests()
            if self.spec is not None:
                self._warm_up_requests(self.SPEC_WARM_UP_PROMPTS, max_tokens=self.SPEC_WARM_UP_TOKENS)
                self.spec.forget_history()
            log.info("warm-up: throwaway requests served in %.1f s", time.monotonic() - t0)

    WARM_UP_PROMPTS = throwaway.PROMPTS
    SPEC_WARM_UP_PROMPTS, SPEC_WARM_UP_TOKENS = throwaway.SPEC_PROMPTS, throwaway.SPEC_TOKENS

    def _warm_up_requests(self, prompts: tuple = WARM_UP_PROMPTS, max_tokens: int = 2) -> None:
        """Serve throwaway requests end to end (hf2q.engine.throwaway); they leave nothing behind."""
        throwaway.serve(self, prompts, max_tokens)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._launched is not None

    # ---- the loop ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step. A failure of one request's own work (its forced token, grammar, sampler row or output)
        fails only that request, with an "error" output; a failure of the forward pass raises."""
        if not self.step_trace:
            return self._step()
        t0 = time.perf_counter()
        self.runner.paths = paths = []
        outputs = self._step()
        host = time.perf_counter() - t0
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        if paths:
            log.info("step: %s: host %.2f ms, done %.2f ms, %d outputs",
                     " + ".join(f"{how} of {seqs} sequences, {tokens} tokens" for how, seqs, tokens in paths),
                     host * 1000, (time.perf_counter() - t0) * 1000, len(outputs))
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self._launched is not None:  # nobody drafts while steps are queued ahead (_may_queue_ahead)
            return self._step_launched()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        self.last_batch = (len(scheduled), sum(n for _, n in scheduled))
        sampling, logits = self.runner.run(scheduled)
        self.scheduler.retain_prefixes(scheduled)
        if sampling and len(sampling) == len(scheduled) and self._overlappable(sampling):
            self._launched = self._draw_on_device(sampling, logits)
            return self._step_launched()
        outputs = []
        for req, _ in scheduled:
            if req.prefill_only and req.num_computed == req.num_tokens:
                if req.background:
                    self.scheduler.background_done(req)
                else:
                    outputs.append(self._prefill_done(req))
        if sampling:
            states = [req.output for req in sampling]
            failed: dict[int, Exception] = {}
            forced = self._forced(states, failed)
            self._mask(logits, states, forced, failed)
            rows = [s.row for s in states]
            try:
                result = self.sampler.sample(logits, rows)
            except Exception:
                result = self._sample_each(logits, rows, failed)
            for i, (req, state) in enumerate(zip(sampling, states)):
                error = failed.get(i)
                verify = req.extras.pop("verify", None)
                if error is None:
                    try:
                        token = forced[i] if forced[i] is not None else int(result.token_ids[i])
                        out = state.append(token, result, i, forced=forced[i] is not None)
                        if req.hidden:  # its first token: the prompt's rows are complete
                            out.prompt_logprobs = self._prompt_logprobs(req)
                        if verify is not None:
                            out = self._verify(req, state, out, verify)
                    except Exception as exc:
                        error = exc
                if error is not None:
                    log.error("request %s failed: %r", req.request_id, error, exc_info=error)
                    out = state.failed(f"{type(error).__name__}: {error}")
                if out.finished:
                    self.scheduler.finish(req, retain=out.finish_reason in ("stop", "length"))
                    self.requests.pop(req.request_id, None)
                outputs.append(out)
            if self.spec is not None:
                self.spec.observe_step(sampling)
        self.scheduler.fork_siblings()
        return outputs

    # ---- async scheduling (hf2q.engine.overlap) ------------------------------------------------------
    def _overlappable(self, reqs: list[Request]) -> bool:
        """Whether the step that just sampled `reqs` may start async scheduling: every running request among
        them (nothing else would be scheduled), each a plain decode row (no prefill-only or hidden rows,
        siblings to fork, grammar, script or thinking budget), and `_may_queue_ahead`."""
        if len(reqs) != len(self.scheduler.running):
            return False
        for req in reqs:
            state = req.output
            if (req.prefill_only or req.keeps_hidden or req.siblings
                    or state.constraint is not None or state.script is not None or state.budget is not None):
                return False
        return self._may_queue_ahead(reqs)

    def _may_queue_ahead(self, reqs: list[Request]) -> bool:
        """Whether the next decode step of `reqs` may be queued before the host reads their newest tokens:
        async scheduling on, no waiting request to admit, none drafting now or in the next step (a batch of
        at least --spec-max-batch, where the speculator drafts nothing, or none that could draft), each having
        computed all the tokens it knows and drawing without the host."""
        if not self.async_scheduling or self.scheduler.admits_waiting():
            return False
        spec = self.spec
        if spec is not None and (any(req.draft_ids for req in reqs) or (
                len(reqs) < spec.config.max_batch and any(spec.may_draft_after_one_more(req) for req in reqs))):
            return False
        return all(req.num_computed == req.num_tokens and self.sampler.draws_without_host(req.output.row)
                   for req in reqs)

    def _draw_on_device(self, reqs: list[Request], logits: torch.Tensor) -> LaunchedStep:
        return LaunchedStep.queue(reqs, self.sampler.draw(logits, [req.output.row for req in reqs]))

    def _step_launched(self) -> list[RequestOutput]:
        """Queue the next decode step of the requests that go on (fed the launched step's tokens, still on
        the device), then read the launched step's tokens and turn them into outputs."""
        launched, self._launched = self._launched, None
        going_on = [req for req in launched.requests if self._goes_on(req)]
        in_launched = {req.request_id for req in launched.requests}
        if going_on and all(req.request_id in in_launched for req in self.scheduler.running) \
                and self._may_queue_ahead(going_on):
            try:
                ids = launched.rows_of(going_on)
                if self.spec is not None:  # the MTP head takes the launched step's rows before the next
                    self.spec.catch_up_queued(going_on, ids)
                logits = self.runner.run_decode(going_on, ids)
                self._launched = self._draw_on_device(going_on, logits)
            except BaseException:  # the caller fails the running requests; those stopping here finish first
                self._launched = None
                self._read(launched)
                raise
            self.last_batch = (len(going_on), len(going_on))
            self.steps_queued_ahead += 1
        outputs = self._read(launched)
        self.scheduler.fork_siblings()
        return outputs

    def _goes_on(self, req: Request) -> bool:
        """Still running after the launched step's token whatever that token is: not finished or aborted, and
        that token not its last by max_tokens."""
        state = req.output
        return (not req.finished and req.request_id not in self._finishing and self.requests.get(req.request_id) is req
                and len(req.output_ids) + 1 < state.max_tokens)

    def _read(self, launched: LaunchedStep) -> list[RequestOutput]:
        """The launched step's outputs. A request that finishes here but was already fed into the step now
        launched keeps its slot until that step is read; one that finished before this step drops its token."""
        token_ids = launched.token_ids()
        result = SampleResult(token_ids, [None] * len(token_ids), [None] * len(token_ids))
        fed_on = {req.request_id for req in self._launched.requests} if self._launched is not None else set()
        outputs = []
        for i, req in enumerate(launched.requests):
            if req.request_id in self._finishing:  # its token after the last one: dropped, the slot given up now
                self.scheduler.finish(req, retain=self._finishing.pop(req.request_id))
                continue
            if req.finished or self.requests.get(req.request_id) is not req:  # aborted meanwhile
                continue
            state = req.output
            try:
                out = state.append(token_ids[i], result, i)
            except Exception as exc:
                log.error("request %s failed: %r", req.request_id, exc, exc_info=exc)
                out = state.failed(f"{type(exc).__name__}: {exc}")
            if out.finished:
                retain = out.finish_reason in ("stop", "length")
                self.requests.pop(req.request_id, None)
                if req.request_id in fed_on:
                    self._finishing[req.request_id] = retain
                else:
                    self.scheduler.finish(req, retain=retain)
            outputs.append(out)
        return outputs

    def _prefill_done(self, req: Request) -> RequestOutput:
        """The one output of a prefill-only request: its prompt logprobs or its embedding."""
        state = req.output
        try:
            embedding = pool(torch.cat(req.hidden), req.pooling) if req.pooling is not None else None
            logprobs = self._prompt_logprobs(req) if req.prompt_logprobs is not None else None
            out = state.prefill_done()
            out.prompt_logprobs, out.embedding = logprobs, embedding
        except Exception as exc:
            log.error("request %s failed: %r", req.request_id, exc, exc_info=exc)
            out = state.failed(f"{type(exc).__name__}: {exc}")
        req.hidden = []
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        return out

    def _prompt_logprobs(self, req: Request) -> list:
        hidden, req.hidden = torch.cat(req.hidden), []
        return prompt_logprobs(self.model.net, hidden, req.prompt_ids, req.prompt_logprobs or 0)
    def _verify(self, req: Request, state: SequenceOutput, out: RequestOutput, verify: Verify) -> RequestOutput:
        """Decide the draft rows in order, each exactly as a plain decode step would, while the token just
        decided equals the draft that was fed after it (so the next row saw the right history)."""
        outs, accepted = [out], 0
        drawn = self._draw_drafts(state, verify)
        for i, draft in enumerate(verify.drafts):
            if out.finished or req.output_ids[-1] != draft:
                break
            accepted += 1
            out = self._decide(state, verify.logits[i:i + 1]) if drawn is None else self._take(state, drawn, i)
            outs.append(out)
        # Settled also when the request ends: its slot may then be kept as a retained prefix, whose state
        # must cover exactly its computed tokens.
        self.spec.settle(req, verify, accepted)
        self.spec.record(req, len(verify.drafts), accepted, len(outs))
        return merge_outputs(outs)

    def _draw_drafts(self, state: SequenceOutput, verify: Verify) -> Optional[SampleResult]:
        """Every draft row's decision in one sampler call (one read of the device, not one a row) where no row's
        draw depends on the rows before it: a greedy row with no penalties, counted minimum, logprobs or
        grammar. Else None: the rows are decided one at a time."""
        row = state.row
        if not (row.params.greedy and self.sampler.draws_without_host(row) and state.constraint is None):
            return None
        return self.sampler.sample(verify.logits, [row] * len(verify.drafts))

    @staticmethod
    def _take(state: SequenceOutput, drawn: SampleResult, i: int) -> RequestOutput:
        """`_decide` for draft row i from `_draw_drafts`' result (a greedy row forced by the thinking budget
        draws nothing either way)."""
        forced = state.forced_token()
        token = forced if forced is not None else int(drawn.token_ids[i])
        return state.append(token, drawn, i, forced=forced is not None)

    def _decide(self, state: SequenceOutput, logits: torch.Tensor) -> RequestOutput:
        """One plain decode decision on one row [1, V]: a forced token still draws from the row's
        generator, as it does in a batched step, so seeded rows stay in step."""
        forced = state.forced_token()
        if forced is None and state.constraint is not None:
            state.constraint.mask(logits[0])
        result = self.sampler.sample(logits, [state.row])
        token = forced if forced is not None else int(result.token_ids[0])
        return state.append(token, result, 0, forced=forced is not None)

    @staticmethod
    def _forced(states: list[SequenceOutput], failed: dict[int, Exception]) -> list[Optional[int]]:
        forced: list[Optional[int]] = []
        for i, state in enumerate(states):
            try:
                forced.append(state.forced_token())
            except Exception as exc:
                forced.append(None)
                failed[i] = exc
        return forced

    @staticmethod
    def _mask(logits: torch.Tensor, states: list[SequenceOutput], forced: list[Optional[int]],
              failed: dict[int, Exception]) -> None:
        """Constrained rows keep only what their grammar allows. Masking to -inf before the sampler's bias
        and penalties gives the same tokens as after them (both leave -inf alone); logprobs then describe
        the constrained distribution, as vLLM's do."""
        for i, state in enumerate(states):
            if state.constraint is not None and forced[i] is None and i not in failed:
                try:
                    state.constraint.mask(logits[i])
                except Exception as exc:
                    failed[i] = exc

    def _sample_each(self, logits: torch.Tensor, rows: list[RowState], failed: dict[int, Exception]) -> SampleResult:
        """After the batched draw raised: draw row by row, so that only the rows that raise again fail.

        Rows draw independently of the batch, so the others get the token a solo run would, unless the
        failed call had already edited their logits (bias, penalties) or drawn from their generator.
        """
        tokens: list[int] = []
        logprobs: list = []
        top: list = []
        for i, row in enumerate(rows):
            try:
                one = self.sampler.sample(logits[i:i + 1], [row])
            except Exception as exc:
                failed.setdefault(i, exc)
                one = SampleResult([0], [None], [None])
            tokens += one.token_ids
            logprobs += one.logprobs
            top += one.top_logprobs
        return SampleResult(tokens, logprobs, top)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 options: RequestOptions = RequestOptions()) -> Iterator[RequestOutput]:
        """Run one request to completion (other queued requests advance too), yielding its deltas."""
        req = self.add_request(prompt_ids, params, options=options)
        while not req.finished:
            for out in self.step():
                if out.request_id == req.request_id:
                    yield out
