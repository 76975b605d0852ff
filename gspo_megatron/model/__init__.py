"""Hugging Face Qwen3 / Qwen3-MoE configs -> Megatron TransformerConfig, layer specs, GPTModel."""
