"""metrale: an LLM inference engine built around lossless speculative decoding.

The public API is vLLM-shaped: `LLM(model, **engine_options).generate(prompts, SamplingParams)`.
"""

from metrale.api import LLM
from metrale.config import EngineConfig, SamplingParams
from metrale.outputs import CompletionOutput, Logprob, RequestOutput
from metrale.speculative.drafter import Drafter
from metrale.structured import StructuredOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "Drafter",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]
__version__ = "0.1.0"
