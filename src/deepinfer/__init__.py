"""deepinfer: a PyTorch-native inference engine for DeepSeek-V4-class MoE models."""

from deepinfer.errors import CheckpointError
from deepinfer.llm import LLM
from deepinfer.lora import LoRARequest
from deepinfer.models.loading import load_model
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "LoRARequest",
    "CheckpointError",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "load_model",
]
__version__ = "0.1.0"
