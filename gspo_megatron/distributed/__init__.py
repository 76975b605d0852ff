"""Process groups, device choice and the Megatron-Core CPU compatibility layer."""
