"""Runtime: requests, scheduling, model execution and the user-facing `LLM`."""
from runtime.llm import LLM
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
