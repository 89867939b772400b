"""kvserve's engine: paged KV cache, token-budget scheduler, model runner, offline API.

Layout, by concern: core/ (requests, scheduler, KV cache manager and block pool, parallel
sampling), worker/ (the worker thread, model runner, input batch, CUDA graphs, sampler),
model_loader/ (model resolution, safetensors, gguf/), models/ (model definitions); the front
(LLM, LLMEngine, AsyncEngine, input and output processing, metrics, capacity) at this level.
"""

from engine.config import EngineArgs, ModelConfig
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "InvalidRequestError", "Logprob",
           "ModelConfig", "RequestOutput", "SamplingParams"]
