"""A test double: a CPU stand-in for the SGLang server, never what a production run uses.

The real SGLang server runs in CI (its CPU engine: tests/test_rollout_sglang_real_server.py).
The stand-in is kept for what that server cannot be driven into on demand: a server that hangs,
is slow, refuses or dies before answering the k-th request (``server.FaultPlan``), memory that
no longer fits (``memory_ledger``); and for the differential test, which sends the same requests
to both and holds them to the same behaviour, rows it differs on by design excepted
(tests/test_rollout_real_server_behaviour.py, docs/rollout.md's real-server table). It speaks
SGLang 0.5.23's native HTTP API (the part we use) on the embedded engine, by SGLang's rules or
stricter, so client code that the real server would refuse fails against it too.
``rollout.engine=reference`` runs the SGLang client against a fleet of them (``launcher``).

- ``server``: the HTTP server and its fault injection; ``request_validation``: ``/generate``
  bodies; ``scheduler``: generation and SGLang's state rules; ``weights``: the weight-update
  endpoints, with ``handle_unpickler`` opening tensor handles as SGLang does.

May import rollout/'s top, ``sglang/`` (the API it mirrors) and ``embedded/`` (the engine it
serves). Nothing in ``sglang/`` or ``embedded/`` imports it (tests/test_architecture.py).
"""
