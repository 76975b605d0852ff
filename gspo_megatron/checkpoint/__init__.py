"""Hugging Face <-> Megatron checkpoints: the weight mapping (``mapping``), safetensors streaming
(``hf_io``) and its checks against config.json (``hf_checks``), conversion (``convert``),
gathering full tensors from a distributed model (``gather``, also used by weight sync), export
(``export``) and resharding (``reshard``). See docs/checkpoints.md."""
