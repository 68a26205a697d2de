"""kunlun_runtime: the bundled inference engine of kunlun-inference.

Public surface (vLLM-compatible in shape): ``LLM``, ``SamplingParams``,
``StructuredOutputsParams`` (a constraint on the output), ``LoRARequest`` (a LoRA adapter to
generate with, as ``vllm.lora.request.LoRARequest``) and ``Logprob`` (the entries of the offline
outputs' logprobs, as ``vllm.logprobs.Logprob``).
"""

from kunlun_runtime.engine.logprobs import Logprob
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.version import __version__

__all__ = ["LLM", "LoRARequest", "Logprob", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):  # lazy: importing the package must not import torch
    if name == "LLM":
        from kunlun_runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kunlun_runtime.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from kunlun_runtime.structured.params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)
