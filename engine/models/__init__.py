"""Model code: one forward pass for the Llama family (Llama, Qwen2, Qwen3)."""
from engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
