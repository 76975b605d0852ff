"""Imported once by the fork server that starts ``run_on_ranks``' processes (``tests/multiproc.py``).

Every rank process of the multi-process tests needs torch, the CPU compatibility layer applied
before Megatron-Core is imported, and Megatron-Core itself: ~5 s of imports per process on the
2-core machine, paid by every rank of every multi-process test when each starts a fresh
interpreter. The fork server imports them once and forks each rank from that state; a rank
still starts with no process group, no parallel state and no model, as a fresh one does.
"""

from __future__ import annotations

import torch

if not torch.cuda.is_available():  # the patches must precede Megatron-Core's import
    from gspo_megatron.distributed.cpu_compat import apply_cpu_compat

    apply_cpu_compat()

import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.parallel_state  # noqa: E402,F401

import gspo_megatron.learner.learner  # noqa: E402,F401
import gspo_megatron.model.provider  # noqa: E402,F401
