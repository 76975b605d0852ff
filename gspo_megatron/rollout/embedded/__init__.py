"""The embedded engine: generation with transformers inside the trainer's process (the CPU default).

- ``engine``: EmbeddedEngine, batched generation with per-sample generators and log-probs.
- ``process``: the same engine in a child process, so a rollout overlaps the learner's update.
- ``kv_decoder``: the lean KV-cached decoding of Qwen3 / Qwen3-MoE; ``sampling``: temperature /
  top-p draws and the log-probs they report.

Imports from rollout/ only its top (``types``); never the stand-in.
"""
