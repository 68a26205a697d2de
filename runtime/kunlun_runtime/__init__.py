"""kunlun_runtime: the bundled inference engine of kunlun-inference.

Public surface (vLLM-compatible in shape): ``LLM`` and ``SamplingParams``.
"""

from kunlun_runtime.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy: importing the package must not import torch
    if name == "LLM":
        from kunlun_runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kunlun_runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
