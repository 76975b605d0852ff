"""Rollout engines behind one interface (types.RolloutEngine); never imports Megatron.

- ``types``: SamplingParams, GenerationRequest, Sample, RolloutEngine, WeightTransport.
- ``embedded``: in-process transformers engine (the CPU default).
- ``sglang_api`` (SGLang 0.5.23's names and bodies), ``sglang_client`` (one server),
  ``server_pool`` (membership), ``sglang_control`` (pause / abort / session / flush / continue,
  memory release), ``sglang_engine`` (the fleet), ``sglang_launcher`` (server processes).
- ``reference_server`` (+ ``reference_requests``, ``reference_scheduler``,
  ``reference_weights``, ``handle_unpickler``): the strict CPU stand-in for SGLang.
- ``update_group``, ``flat_bucket``: the broadcast group and SGLang's flat bucket layout.
- ``factory.build_engine``: an engine from ``RolloutConfig``.
"""
