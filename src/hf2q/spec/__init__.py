"""Exact speculative decoding: proposers draft tokens, the engine verifies them in one target forward."""
from hf2q.spec.proposer import Proposer, SpecConfig, TokenView

__all__ = ["Proposer", "SpecConfig", "TokenView"]
