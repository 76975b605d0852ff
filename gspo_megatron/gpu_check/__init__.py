"""The GPU verification kit: one command that checks the real GPU path of the project.

``tools/gpu_check.py --out DIR`` runs six checks, each pass / fail with numbers, through the
project's own code (model provider, learner, log-prob kernel, HF -> Megatron converter, CUDA-IPC
weight transport, embedded engine, CPU compatibility layer) on a slice of Qwen3-30B-A3B with its
real layer shapes, and writes ``gpu_check.json`` + ``gpu_check.txt`` into DIR. With
``--cpu-dry-run`` the same code runs on tiny sizes on CPU (CI keeps the kit working). How to run
it on a GPU machine, and what it found there: ``docs/gpu.md``.

Modules: ``sizes`` (the two size sets), ``report`` (results, JSON and text), ``inputs`` (random
HF model, batches, learner configs), ``throughput`` (matmul peak, model FLOPs), one module per
group of checks (``learner_checks``, ``kernel_check``, ``fp8_check``, ``weight_sync_check``),
``ipc_engine`` (the embedded engine in its own process behind SGLang's tensor endpoint) and
``runner`` (order, timing, output).
"""
