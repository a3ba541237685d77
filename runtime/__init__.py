"""Runtime: requests, scheduling, model execution and the user-facing `LLM`."""
from runtime.beam_search import BeamSearchOutput, BeamSearchParams, BeamSequence
from runtime.llm import LLM
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams",
           "BeamSearchOutput", "BeamSequence", "StructuredOutputsParams"]
