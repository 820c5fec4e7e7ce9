"""Model code: one forward pass for the Llama family (Llama, Qwen2, Qwen3), registered by
architecture name in `MODELS` (a new architecture: a class decorated with `@register_model`,
imported here)."""
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import MODELS, register_model

__all__ = ["MODELS", "LlamaForCausalLM", "register_model"]
