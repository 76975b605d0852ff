"""The same requests to the real SGLang 0.5.23 server (CPU) and to the stand-in, and what each did.

``servers.py`` starts them (each real server a process group of its own, the stand-in a process
of its own, both on one tiny float32 checkpoint), ``probes.py`` sends the requests and turns each
server's answers into one table cell, ``rows.py`` holds the hand-written half of each row (what
is sent, what we do about it, why a difference is known) and renders docs/rollout.md's table.
``tools/real_server_behaviour.py`` runs it and writes the doc; the differential test
(``tests/test_rollout_real_server_behaviour.py``) runs it and checks the doc against the run.
"""
