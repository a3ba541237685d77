"""Speculative decoding: proposers guess draft tokens, the scheduler gives them leftover
budget, the runner verifies k+1 positions per request in one forward and rolls back what was
rejected (see each module's docstring). Configured by `SpeculativeConfig`."""
from runtime.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
