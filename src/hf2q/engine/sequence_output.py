"""Per-request output state: sampler row, UTF-8-safe detokenization, stop rules, thinking budget, grammar.

Turns each sampled token into a `RequestOutput` delta and decides when the request finishes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from hf2q.engine.request import Request, RequestOutput, TokenLogprob
from hf2q.engine.sampler import RowState
from hf2q.engine.stop import StopStringMatcher
from hf2q.engine.thinking_budget import ThinkingBudget
from hf2q.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # xgrammar is imported only by requests that use a grammar
    from hf2q.engine.grammar import Constraint

REASONING_END_TEXT = "\n</think>\n\n"
REASONING_CLOSE_TEXT = "</think>"
TOOL_CALL_OPEN_TEXT = "<tool_call>"


class SequenceOutput:
    def __init__(self, model, req: Request, max_tokens: int, thinking_budget: Optional[int],
                 starts_in_reasoning: bool, scripted_ids: Optional[Sequence[int]] = None,
                 constraint: Optional[Constraint] = None):
        self.req = req
        self.params = req.params
        self.max_tokens = max_tokens
        self.eos_ids = frozenset() if self.params.ignore_eos else model.eos_token_ids
        self.stop_ids = frozenset(self.params.stop_token_ids or ())
        self.row = RowState(self.params, req.prompt_ids, eos_token_ids=model.eos_token_ids)
        self.detok = IncrementalDetokenizer(model.tokenizer)
        self.stop = StopStringMatcher(list(self.params.stop or []))
        self.budget = None
        self.constraint = constraint  # masks this row's logits (engine) and follows every appended token
        tok = model.tokenizer
        # A scripted reply replaces sampling token by token (a testing aid: `hf2q serve --scripted-replies`).
        self.script = list(scripted_ids) if scripted_ids is not None else None
        if self.script is not None:
            self.script.append(min(model.eos_token_ids))
        self.tool_open_id = tok.token_to_id(TOOL_CALL_OPEN_TEXT)
        if thinking_budget is not None and starts_in_reasoning:
            self.budget = ThinkingBudget(thinking_budget, tok.encode(REASONING_END_TEXT),
                                         tok.encode(REASONING_CLOSE_TEXT))

    def forced_token(self) -> Optional[int]:
        if self.script is not None:
            return self.script.pop(0) if self.script else None
        return self.budget.next_forced_token() if self.budget is not None else None

    def append(self, token: int, result, row: int, forced: bool = False) -> RequestOutput:
        req = self.req
        req.output_ids.append(token)
        self.row.append(token)
        if self.constraint is not None and not self.constraint.accept(token):
            self.constraint = None  # a forced token the grammar refuses (scripted reply): stop constraining
        if self.budget is not None:
            self.budget.observe(req.output_ids, tool_opened=token == self.tool_open_id)
        logprobs = self._logprobs(token, result, row, forced)
        finish, text = None, ""
        if token in self.eos_ids or token in self.stop_ids:
            finish = "stop"
        else:
            text, stopped = self.stop.push(self.detok.push(token))
            if stopped:
                finish = "stop"
        if finish is None and self.constraint is not None and self.constraint.is_terminated():
            finish = "stop"
        if finish is None and len(req.output_ids) >= self.max_tokens:
            finish = "length"
        if finish is not None and not self.stop.stopped:
            tail, stopped = self.stop.push(self.detok.flush())
            text += tail if stopped else tail + self.stop.flush()
        return self._output([token], text, finish, logprobs)

    def prefill_done(self) -> RequestOutput:
        """The last output of a prefill-only request: no token, finish reason "length" (max_tokens 0)."""
        return self._output([], "", "length", None)

    def aborted(self) -> RequestOutput:
        return self._output([], "", "abort", None)

    def failed(self, error: str) -> RequestOutput:
        """The last output of a request whose own work raised: finish reason "error", and why."""
        return self._output([], "", "error", None, error)

    def _output(self, tokens, text, finish, logprobs, error: Optional[str] = None) -> RequestOutput:
        req = self.req
        if finish is not None:
            req.finish_reason = finish
        return RequestOutput(req.request_id, tokens, text, finished=finish is not None, finish_reason=finish,
                             num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids),
                             num_cached_tokens=req.num_cached, logprobs=logprobs, error=error)

    def _logprobs(self, token: int, result, row: int, forced: bool) -> Optional[list[TokenLogprob]]:
        if not self.params.logprobs:
            return None
        if forced:  # a forced token was not sampled: it gets logprob 0
            return [TokenLogprob(token, 0.0, [])]
        return [TokenLogprob(token, float(result.logprobs[row]), list(result.top_logprobs[row] or []))]
