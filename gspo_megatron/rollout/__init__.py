"""Rollout engines behind one interface (types.RolloutEngine); never imports Megatron.

- ``types``: SamplingParams, GenerationRequest, Sample, RolloutEngine, WeightTransport.
- ``embedded``: in-process transformers engine (the CPU default).
- ``sglang_engine`` / ``sglang_client`` / ``sglang_api`` / ``sglang_launcher``: SGLang fleet.
- ``reference_server``: SGLang's HTTP API subset on the embedded engine, for CPU machines.
- ``factory.build_engine``: an engine from ``RolloutConfig``.
"""
