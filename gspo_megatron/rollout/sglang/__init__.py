"""The SGLang client side: what a production run uses to generate on a fleet of SGLang servers.

- ``api``: SGLang 0.5.23's endpoint names, request bodies and response parsing.
- ``client``: one server; ``server_pool``: membership; ``control``: pause / abort / session /
  flush / continue and memory release, fleet-wide; ``engine``: the fleet as a RolloutEngine.
- ``launcher``: server processes (``keyed_launch``, run by path, starts one with the job's keys
  from ``server_keys``' file).
- ``update_group``, ``flat_bucket``: the weight update's broadcast group and SGLang's flat bucket
  layout (the learner's weight_sync/ sends through them).

Imports from rollout/ only its top (``types``, ``routed_experts``); never the stand-in.
"""
