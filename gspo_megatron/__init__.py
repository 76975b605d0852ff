"""gspo-megatron: GSPO post-training of Qwen3 MoE models with Megatron-Core learners.

Importing the package pulls in nothing GPU-only: Transformer Engine, apex and SGLang are imported
lazily, only on the code paths that a config selects.
"""

__version__ = "0.1.0"
