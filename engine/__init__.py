"""kvserve's engine: paged KV cache, token-budget scheduler, model runner, offline API."""

from engine.config import EngineArgs, ModelConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "Logprob", "ModelConfig", "RequestOutput",
           "SamplingParams"]
