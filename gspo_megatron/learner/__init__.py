"""The Megatron-Core learner: batches, forward passes, optimizer, checkpoints (see docs/learner.md)."""
