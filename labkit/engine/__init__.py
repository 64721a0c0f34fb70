"""labkit's teaching inference engine (:doc:`chapter 2 </chapters/ch02_engines>`), with vLLM's
offline API (:ref:`ch02-offline-api`).

A real, small engine in NumPy: a Llama-family model that loads a Hugging Face directory,
attention over :mod:`labkit.kvcache`'s paged cache, continuous batching and prefix caching
from :mod:`labkit.scheduling`, and sampling with vLLM's parameters.

    from labkit.engine import LLM, SamplingParams, write_tiny_model
    llm = LLM(model=str(write_tiny_model("tiny-llama")))
    print(llm.generate("Paged attention", SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from labkit.engine.llm import LLM
from labkit.engine.llm_engine import EngineArgs, LLMEngine
from labkit.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from labkit.engine.sampling import RequestOutputKind, SamplingParams
from labkit.engine.tiny import write_tiny_model

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestMetrics",
           "RequestOutput", "RequestOutputKind", "SamplingParams", "write_tiny_model"]
