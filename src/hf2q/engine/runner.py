"""Runs one scheduled batch through the model: builds the ForwardBatch, keeps the cache lengths.

On CUDA a batch of pure decode rows (one new token per request, each then sampled; a request with images
too, its token rotated by index + delta) replays a captured CUDA graph of its batch-size bucket (captured on
first use); with `short_prefill_graphs`, so does a small step with prefill rows (up to 127 rows over up to 64
requests, hf2q.engine.prefill_graphs) and (unless HF2Q_BURST_GRAPHS=0) a burst of short prompts (up to 2,048 rows,
at most 128 a request and contexts of at most 4,096 tokens); every other batch, and every batch on CPU, runs eagerly.
A speculating request (drafts after its known tokens, see hf2q.spec) replays a verify graph on CUDA where
the step has up to `verify_seqs` requests (else it runs eagerly); its draft rows' logits and the
DeltaNet state after each of its positions go to its `Verify`, and its cache and `num_computed` are settled
by the engine once it has decided.
With the MTP proposer each request keeps its rows of the forward's hidden states (`extras["mtp_rows"]`, a
graph replay's too) for the MTP head to catch up on (hf2q.spec.mtp).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from hf2q import envs
from hf2q.cache.hybrid import CacheError, HybridCache
from hf2q.cache.state_at import StateAt
from hf2q.devices import upload
from hf2q.engine import warm_up
from hf2q.engine.request import Request
from hf2q.forward import ForwardBatch
from hf2q.kernels.gdn.chunked_fla import RECURRENT_MAX_LEN
from hf2q.kernels.tuning.timing import SPENT
from hf2q.models.qwen35 import Qwen35Model
from hf2q.spec.speculator import Verify
from hf2q.spec.states import POSITIONS, PositionStates

log = logging.getLogger(__name__)

GRAPH_MAX_CONTEXT = 65536  # block-table width of the graphs; longer sequences decode eagerly
class ModelRunner:
    def __init__(self, net: Qwen35Model, cache: HybridCache, cuda_graphs: bool = True, mtp_rows: bool = False,
                 vision=None, short_prefill_graphs: bool = False, verify_seqs: int = 0, max_seqs: int | None = None):
        self.net = net
        self.vision = vision  # the vision tower, for requests with images (hf2q.vision.request_inputs)
        self.cache = cache
        self.device = net.embed.device
        self.mtp_rows = mtp_rows  # hand each request its hidden rows for the MTP head
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs = None  # DecodeGraphs, made on the first decode batch (it holds one padding slot)
        self.short_prefill_graphs = short_prefill_graphs  # small prefill steps replay graphs too, where graphs run
        self.prefill_graphs = None  # PrefillGraphs, made on the first such step (on the decode graphs' padding)
        self.bursts_graphed = envs.burst_graphs()  # HF2Q_BURST_GRAPHS: bursts of short prompts replay graphs too
        self.burst_graphs = None  # PrefillGraphs for steps of many short prompts (prefill_graphs.BURST_BUCKETS)
        self.paths: list[tuple[str, int, int]] | None = None  # HF2Q_STEP_TRACE: (how, sequences, tokens) a forward
        # steps with drafts of up to this many requests replay verify graphs (0: no speculation)
        self.verify_seqs = verify_seqs
        self.verify_graphs = None
        # the most sequences a step holds (the scheduler's max_num_seqs): a prefill graph has room for no more
        # (each sequence it has room for is a field of its pack and programs of its DeltaNet step)
        self.max_seqs = max_seqs
        self.mtp_draft_graphs = None  # MTPGraphs, with the MTP proposer (`mtp_graphs`)

    def _trace(self, how: str, seqs: int, tokens: int) -> None:
        """Note how a forward ran, where the engine traces its steps (`paths` is a list then)."""
        if self.paths is not None:
            self.paths.append((how, seqs, tokens))

    def build_batch(self, scheduled: list[tuple[Request, int]]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        for req, n in scheduled:
            ids += req.tokens(req.num_computed, req.num_computed + n) + drafts_in(req, n)
            positions += range(req.num_computed, req.num_computed + n)
        if any(req.mrope is not None for req, _ in scheduled):
            from hf2q.vision.request_inputs import rows_positions

            multimodal = torch.cat([rows_positions(req, req.num_computed, n) for req, n in scheduled], dim=1)
            positions = multimodal.to(self.device)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.as_tensor(positions, dtype=torch.long, device=self.device),
            seq_lens=[n for _, n in scheduled],
            start_lens=[req.num_computed for req, _ in scheduled],
            slots=[req.slot for req, _ in scheduled],
            cache=self.cache,
        )

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor]:
        """Advance every scheduled request; return the requests that now sample and their logits.

        A request that keeps its hidden rows (`Request.keeps_hidden`) gets each prompt chunk's rows appended
        to `req.hidden`; a prefill-only request never samples."""
        for req, n in scheduled:
            self.cache.reserve(req.slot, req.num_computed + n)
        logits = self._run_graph(scheduled)
        shape = (len(scheduled), sum(n for _, n in scheduled))
        if logits is not None:
            self._trace("decode graph", *shape)
            hidden = self.graphs.hidden_rows(len(scheduled)) if self.mtp_rows else None
            for i, (req, _) in enumerate(scheduled):
                if hidden is not None:
                    req.extras["mtp_rows"] = (req.num_computed, hidden[i:i + 1])
                req.num_computed += 1
                self.cache.commit(req.slot, req.num_computed)
            return [req for req, _ in scheduled], logits
        graphed, path = self._run_prefill_graph(scheduled), "prefill graph"
        if graphed is None:
            graphed, path = self._run_verify_graph(scheduled), "verify graph"
        self._trace(path if graphed is not None else "eager", *shape)
        if graphed is not None:
            return graphed
        batch = self.build_batch(scheduled)
        verifies, kept = {}, {}
        for i, (req, n) in enumerate(scheduled):
            drafts = drafts_in(req, n)
            if drafts:  # the DeltaNet layers keep the state after each position, for a partial accept
                states = PositionStates(self.cache, n)
                kept.setdefault(i, []).append(states)
                verifies[req.request_id] = Verify(req.num_computed, n - len(drafts), drafts, states)
            inside = []
            for at in req.extras.pop("checkpoints_inside", ()):  # and the states at checkpoints inside the chunk
                state = StateAt(self.cache, at - req.num_computed)
                kept.setdefault(i, []).append(state)
                inside.append((at, state))
            if inside:
                req.extras["kept_inside"] = inside
        batch.extras["kept_states"] = kept
        hidden = self.net(batch, input_embeds=self._image_embeds(batch, scheduled))
        rows, draft_rows, sampling = [], [], []
        row = 0
        for req, n in scheduled:
            if req.keeps_hidden and req.num_computed < len(req.prompt_ids):
                req.hidden.append(hidden[row:row + n].clone())  # chunked prefill: one chunk per step
            if self.mtp_rows and not req.prefill_only:
                req.extras["mtp_rows"] = (req.num_computed, hidden[row:row + n])
            row += n
            verify = verifies.get(req.request_id)
            d = len(verify.drafts) if verify is not None else 0
            req.num_computed += n - d  # the drafts count once the engine has accepted them
            self.cache.commit(req.slot, req.num_computed + d)
            if req.num_computed == req.num_tokens and not req.prefill_only:
                rows.append(row - 1 - d)
                sampling.append(req)
                if verify is not None:
                    draft_rows += range(row - d, row)
        if not rows:
            return [], hidden.new_zeros(0, self.net.config.vocab_size, dtype=torch.float32)
        picked = rows + draft_rows
        picked += picked[-1:] * (self._logit_rows(len(picked)) - len(picked))
        logits = self.net.compute_logits(hidden[torch.tensor(picked, device=hidden.device)])
        offset = len(rows)
        for req in sampling:
            verify = verifies.get(req.request_id)
            if verify is not None:
                verify.logits = logits[offset:offset + len(verify.drafts)]
                offset += len(verify.drafts)
                req.extras["verify"] = verify
        return sampling, logits[:len(rows)]

    def _run_prefill_graph(self, scheduled: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor] | None:
        """`run`'s result for a small step with prefill rows replayed in its graph (hf2q.engine.prefill_graphs:
        up to 127 rows over up to 64 requests, or a burst's many short prompts), or None where no graph serves
        it: drafts to verify, hidden rows kept, images, more than one checkpoint inside the chunks, too many rows
        or requests, too long a sequence. A step with one checkpoint inside a chunk (a chat turn's anchor) it
        serves: the graph keeps the DeltaNet states there, handed on as the eager forward hands them
        (`kept_inside`)."""
        if not (self.use_graphs and self.short_prefill_graphs) or not scheduled:
            return None
        if any(drafts_in(req, n) for req, n in scheduled) or not self._graphable(scheduled, keeps_one=True):
            return None
        graphs = self._serving(self._prefill_graphs(), scheduled) or self._serving(self._burst_graphs(), scheduled)
        if graphs is None:
            return None
        samples = [req.num_computed + n == req.num_tokens and not req.prefill_only for req, n in scheduled]
        order = [scheduled[i] for i in sorted(range(len(scheduled)), key=lambda i: not samples[i])]  # samplers first
        inside = [(i, req, at) for i, (req, _) in enumerate(order) for at in req.extras.pop("checkpoints_inside", ())]
        keep = (inside[0][0], inside[0][2] - inside[0][1].num_computed - 1) if inside else None  # its last token's row
        logits = graphs.step([(req.tokens(req.num_computed, req.num_computed + n), req.num_computed, req.slot)
                              for req, n in order], keep)
        for _, req, at in inside:  # views until the next replay: `Scheduler.retain_prefixes` copies them before
            req.extras["kept_inside"] = [(at, graphs.inside)]
        hidden = graphs.hidden_rows(sum(n for _, n in order)) if self.mtp_rows else None
        row = 0
        for req, n in order:
            if hidden is not None and not req.prefill_only:
                req.extras["mtp_rows"] = (req.num_computed, hidden[row:row + n])
            row += n
            req.num_computed += n
            self.cache.commit(req.slot, req.num_computed)
        k = sum(samples)
        return [req for req, _ in order[:k]], logits[:k]

    def _run_verify_graph(self, scheduled: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor] | None:
        """`run`'s result for a step with drafts replayed in a verify graph (hf2q.engine.prefill_graphs, up to
        `verify_seqs` requests and 3 drafts each): the logits of each request's drafts and the row before
        them, and its DeltaNet states after each of those rows (hf2q.spec.states.KeptPositions, read by the
        engine's settle before the next step). None where no graph serves it, as `_run_prefill_graph`."""
        if not (self.use_graphs and self.verify_seqs) or len(scheduled) > self.verify_seqs:
            return None
        drafts = [drafts_in(req, n) for req, n in scheduled]
        if not any(drafts) or any(d and n > POSITIONS for (_, n), d in zip(scheduled, drafts)):
            return None  # a verifying request's rows: its drafts and the row before them, at most POSITIONS
        if not self._graphable(scheduled):
            return None
        graphs = self._serving(self._verify_graphs(), scheduled)
        if graphs is None:
            return None
        logits = graphs.step([(req.tokens(req.num_computed, req.num_computed + n) + d, req.num_computed, req.slot)
                              for (req, n), d in zip(scheduled, drafts)]).flatten(0, 1)  # [seqs * POSITIONS, V]
        hidden = graphs.hidden_rows(sum(n for _, n in scheduled)) if self.mtp_rows else None
        sampling, rows, row = [], [], 0
        for i, ((req, n), d) in enumerate(zip(scheduled, drafts)):
            if hidden is not None and not req.prefill_only:
                req.extras["mtp_rows"] = (req.num_computed, hidden[row:row + n])
            row += n
            if d:
                req.extras["verify"] = Verify(req.num_computed, n - len(d), d, graphs.kept.of(i),
                                              logits[POSITIONS * (i + 1) - len(d):POSITIONS * (i + 1)])
            req.num_computed += n - len(d)  # the drafts count once the engine has accepted them
            self.cache.commit(req.slot, req.num_computed + len(d))
            if req.num_computed == req.num_tokens and not req.prefill_only:
                sampling.append(req)
                rows.append(POSITIONS * (i + 1) - 1 - len(d))
        picked = logits.index_select(0, upload(torch.tensor(rows, dtype=torch.long), logits.device))
        return sampling, picked

    @staticmethod
    def _graphable(scheduled: list[tuple[Request, int]], keeps_one: bool = False) -> bool:
        """Whether a graph could compute every request's rows: none keeps its hidden rows or has images, and
        no chunk holds a checkpoint inside (those need the eager forward's extras) but, with `keeps_one` (a
        prefill graph keeps the states after one row), one."""
        inside = sum(len(req.extras.get("checkpoints_inside", ())) for req, _ in scheduled)
        return inside <= keeps_one and not any(req.keeps_hidden or req.mrope is not None for req, _ in scheduled)

    def _serving(self, graphs, scheduled: list[tuple[Request, int]]):
        """`graphs` (prefill or verify flavour) if they serve the step's row counts and block-table widths."""
        blocks = [len(self.cache.block_table(req.slot)) for req, _ in scheduled]
        if graphs is None or not graphs.serves([n for _, n in scheduled], blocks):
            return None
        return graphs

    def _prefill_graphs(self):
        if self.prefill_graphs is None:
            decode = self._decode_graphs()
            if decode is None:
                return None
            from hf2q.engine.prefill_graphs import MAX_SEQS, PrefillGraphs
            self.prefill_graphs = PrefillGraphs(decode, max_seqs=min(MAX_SEQS, self.max_seqs or MAX_SEQS))
        return self.prefill_graphs

    def _burst_graphs(self):
        """The burst graphs (prefill_graphs.BURST_BUCKETS), made on first use unless HF2Q_BURST_GRAPHS=0; else None."""
        if self.burst_graphs is None:
            if not self.bursts_graphed:
                return None
            decode = self._decode_graphs()
            if decode is None:
                return None
            from hf2q.engine.prefill_graphs import (BURST_BUCKETS, BURST_CONTEXT, BURST_SEQ_ROWS, MAX_SEQS,
                                                    PrefillGraphs)
            self.burst_graphs = PrefillGraphs(decode, BURST_BUCKETS, max_seqs=min(MAX_SEQS, self.max_seqs or MAX_SEQS),
                                              width=-(-BURST_CONTEXT // decode.block_size), seq_rows=BURST_SEQ_ROWS)
        return self.burst_graphs

    def _capture_burst_graphs(self) -> None:
        """Capture the burst graphs; one that fails to capture (memory, an operation a graph cannot hold) leaves
        bursts to the eager forward, with the reason logged, rather than failing the warm-up."""
        graphs = self._burst_graphs()
        if graphs is None or not graphs.usable:
            return
        try:
            graphs.capture()
        except (RuntimeError, torch.OutOfMemoryError) as err:
            graphs.usable = False
            graphs.graphs.clear()
            log.warning("burst prefill graphs left out, bursts of short prompts run eagerly: %s", err)

    def mtp_graphs(self, k: int):
        """The MTP head's draft graphs for k drafts (hf2q.spec.mtp_graphs), made on first use, where verify steps
        replay graphs; else None."""
        if not (self.use_graphs and self.verify_seqs):
            return None
        if self.mtp_draft_graphs is None:
            decode = self._decode_graphs()
            if decode is None:
                return None
            from hf2q.spec.mtp_graphs import MTPGraphs
            self.mtp_draft_graphs = MTPGraphs(decode, k)
        return self.mtp_draft_graphs

    def _verify_graphs(self):
        if self.verify_graphs is None:
            decode = self._decode_graphs()
            if decode is None:
                return None
            from hf2q.engine.prefill_graphs import VERIFY_BUCKETS, PrefillGraphs
            self.verify_graphs = PrefillGraphs(decode, buckets=VERIFY_BUCKETS, max_seqs=self.verify_seqs,
                                               verify=True)
        return self.verify_graphs

    @torch.inference_mode()
    def run_decode(self, reqs: list[Request], ids: torch.Tensor) -> torch.Tensor:
        """One decode row per request whose newest token the host has not read yet: `ids` [n] on the device,
        each fed at the request's next position (`num_computed`, which then counts it). Logits [n, vocab]
        (graph-replayed where a graph serves the batch, a view valid until the next step)."""
        positions = [req.num_computed for req in reqs]
        slots = [req.slot for req in reqs]
        for req, p in zip(reqs, positions):
            self.cache.reserve(req.slot, p + 1)
        rope = self._decode_rope(reqs, positions)  # output tokens: every axis agrees, never None
        graphs = self._graphs_serving(slots)
        self._trace("queued decode graph" if graphs is not None else "queued eager", len(reqs), len(reqs))
        if graphs is not None:
            logits = graphs.step(ids, positions, slots, rope)
            hidden = graphs.hidden_rows(len(reqs)) if self.mtp_rows else None
        else:
            where = upload(torch.tensor(rope, dtype=torch.long), self.device)
            batch = ForwardBatch(input_ids=ids, positions=where, seq_lens=[1] * len(reqs), start_lens=positions,
                                 slots=slots, cache=self.cache)
            hidden = self.net(batch)
            logits = self.net.compute_logits(hidden)
        for i, req in enumerate(reqs):
            if self.mtp_rows:
                req.extras["mtp_rows"] = (req.num_computed, hidden[i:i + 1])
            req.num_computed += 1
            self.cache.commit(req.slot, req.num_computed)
        return logits

    def _image_embeds(self, batch: ForwardBatch, scheduled: list[tuple[Request, int]]) -> Optional[torch.Tensor]:
        """Input embeddings with image soft tokens when a scheduled chunk holds image pad rows, else None."""
        if not any(req.key_tokens is not None and req.num_computed < len(req.prompt_ids) for req, _ in scheduled):
            return None
        from hf2q.vision.request_inputs import rows_embeddings

        embeds = self.net.embed_tokens(batch.input_ids)
        row = 0
        for req, n in scheduled:
            rows_embeddings(self.vision, req, req.num_computed, n, embeds[row:row + n])
            row += n
        return embeds

    def _run_graph(self, scheduled: list[tuple[Request, int]]) -> Optional[torch.Tensor]:
        """Logits of a decode batch by graph replay (a view valid until the next step), or None to run eagerly
        (no graph serves the batch, or a row is not a plain decode row)."""
        if not self.use_graphs or any(n != 1 or req.num_computed + 1 != req.num_tokens or req.prefill_only
                                      or req.keeps_hidden for req, n in scheduled):
            return None
        reqs = [req for req, _ in scheduled]
        positions = [req.num_computed for req in reqs]
        rope = self._decode_rope(reqs, positions)
        slots = [req.slot for req in reqs]
        graphs = self._graphs_serving(slots) if rope is not None else None
        if graphs is None:
            return None
        ids = [req.token_at(p) for req, p in zip(reqs, positions)]
        return graphs.step(ids, positions, slots, rope)

    @staticmethod
    def _decode_rope(reqs: list[Request], positions: list[int]) -> Optional[list[int]]:
        """The rotary position of each request's token at `positions`, one number as the graphs take it: the
        position itself, or after a request's images index + delta (vision.request_inputs); None where a
        token's multimodal axes differ (an image row: the batch runs eagerly)."""
        if all(req.mrope is None for req in reqs):
            return positions
        from hf2q.vision.request_inputs import text_rope_position

        rope = [text_rope_position(req, p) for req, p in zip(reqs, positions)]
        return None if None in rope else rope

    def _graphs_serving(self, slots: list[int]):
        """The decode graphs, where one of their buckets takes a step of these sequences (no more than the
        largest bucket, each block table within the graphs' width), else None."""
        graphs = self._decode_graphs() if self.use_graphs else None
        if graphs is None or len(slots) > graphs.buckets[-1] \
                or any(len(self.cache.block_table(s)) > graphs.width for s in slots):
            return None
        return graphs

    @torch.inference_mode()
    def warm_up(self, max_batch: int, prefill_tokens: int) -> None:
        """Do before serving what a first request would otherwise wait for: one prefill of
        `prefill_tokens` tokens (compiles the prefill kernels) in a scratch slot, on CUDA also chunks over a
        cached prefix, prefills of two sequences and chunks beside other sequences' decode rows (engine/warm_up.py),
        then the decode graphs of every
        bucket up to `max_batch` sequences (compiles, times and captures the decode kernels). The scratch
        slots are released; the graphs keep their padding slot."""
        t0, spent = time.monotonic(), SPENT.snapshot()
        cuda = self.device.type == "cuda"  # elsewhere nothing compiles: one prefill is enough
        warm_up.prefill(self, [prefill_tokens], then=warm_up.chunks_over_prefix(prefill_tokens) if cuda else (),
                        inside=(prefill_tokens // 2,) if cuda else ())
        log.info("warm-up: a %d-token prefill%s in %.1f s (%s)", prefill_tokens,
                 " and chunks over it" if cuda else "", time.monotonic() - t0, SPENT.since(spent))
        half = prefill_tokens // 2
        if cuda and half > RECURRENT_MAX_LEN:  # two sequences in one step (`warm_up.prefill`)
            t0 = time.monotonic()
            try:
                for lengths in ([half, half], [half, half - 1]):
                    warm_up.prefill(self, lengths)
                log.info("warm-up: prefills of two sequences in %.1f s", time.monotonic() - t0)
            except CacheError as err:  # no slot or room for them: a first request compiles what they would
                log.info("warm-up: prefills of two sequences left out (%s)", err)
        if cuda:
            warm_up.beside_decode_rows(self, prefill_tokens)
        if self.use_graphs:
            graphs = self._decode_graphs()
            if graphs is not None:
                graphs.capture([b for b in graphs.buckets if b <= graphs.bucket(min(max_batch, graphs.buckets[-1]))])
            prefill = self._prefill_graphs() if self.short_prefill_graphs else None
            if prefill is not None:
                prefill.capture()
                self._capture_burst_graphs()
            verify = self._verify_graphs() if self.verify_seqs else None
            if verify is not None:
                verify.capture()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _logit_rows(self, n: int) -> int:
        """How many rows an eager step's output layer runs for n wanted: on CUDA with graphs, n padded to its
        decode-graph bucket (the last row repeated), whose mat-vec kernels the warm-up compiled and timed; a
        first step wanting 3 rows' logits otherwise waited 8.5 s for a 3-row mat-vec to compile on an H100."""
        graphs = self.graphs if self.use_graphs else None
        if graphs is None or n > graphs.buckets[-1]:
            return n
        return graphs.bucket(n)

    def _decode_graphs(self):
        if self.graphs is None:
            from hf2q.engine.cuda_graphs import DecodeGraphs
            context = min(self.cache.num_blocks * self.cache.block_size, GRAPH_MAX_CONTEXT)
            try:
                self.graphs = DecodeGraphs(self.net, self.cache, max_context=context)
            except CacheError:  # no slot or block free for the padding rows yet: eager until there is
                return None
        return self.graphs


def drafts_in(req: Request, n: int) -> list[int]:
    """The drafts a chunk of n tokens carries: what is left after the request's known tokens."""
    return req.draft_ids[:max(0, n - (req.num_tokens - req.num_computed))]
