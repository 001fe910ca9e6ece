"""pdserve: prefill/decode-disaggregated serving for Qwen3."""

from pdserve.engine.llm import LLM
from pdserve.engine.lora_manager import LoRARequest
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import StructuredOutput

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutput", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
