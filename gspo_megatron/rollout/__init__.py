"""Rollout engines behind one interface (types.RolloutEngine); never imports Megatron.

Three rooms, one per engine family, and what they share at the top:

- ``types``: SamplingParams, GenerationRequest, Sample, RolloutEngine, WeightTransport.
- ``routed_experts``: the experts a sample was routed to (R3), checked the same for every engine.
- ``factory.build_engine``: an engine from ``RolloutConfig`` (``rollout.engine``).
- ``sglang/``: the client of SGLang servers, what production runs on GPUs: the API as we use it,
  one server's client, the fleet and its weight-sync protocol, the launcher, the servers' keys,
  the broadcast group and the flat bucket layout of a weight update.
- ``embedded/``: the in-process transformers engine (the CPU default) and its child-process form.
- ``standin/``: a test double of the SGLang server, for faults the real one cannot be driven into
  and for the differential test; nothing in ``sglang/`` or ``embedded/`` imports it.
"""
