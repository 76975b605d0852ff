"""Memory and parallelism planner: will a layout fit, and which layouts fit best?

Pure Python (no torch, no Megatron at import), so ``gspo-plan`` answers in well under a second
and config loading can run the same estimate (``planner/fit_check.py``).

* ``model_shape.py`` -- parameter counts per pipeline stage and rank (dense vs expert).
* ``precision.py`` -- bytes per parameter of weights, gradients, optimizer state (distributed
  optimizer, precision-aware optimizer, CPU offload, FP8 copies) and of activations.
* ``activations.py`` -- saved activations per layer for each recompute mode and attention kernel,
  the logits / log-prob pass, pipeline in-flight micro-batches.
* ``learner_memory.py`` -- the per-GPU learner total, term by term, for the most loaded stage.
* ``rollout_memory.py`` -- SGLang servers: weights per TP rank, KV cache, sequences that fit.
* ``hardware.py`` -- GPU memory, peaks and links a plan is made for.
* ``timing.py`` -- rough step, rollout and weight-sync times, and the RL step against the
  rollout staleness k (``rollout.max_staleness``).
* ``plan.py`` -- one config (or one layout of it) -> one :class:`Plan` with all of the above.
* ``search.py`` -- enumerate layouts that fit N nodes and rank them.
* ``report.py`` -- text / JSON rendering for ``gspo-plan``.
* ``fit_check.py`` -- the config-load check (refuses a layout predicted not to fit).

How the estimate was validated (Megatron's own formula, and peak memory measured on CPU):
``docs/planner.md``. Command line: ``gspo-plan CONFIG [overrides] --nodes N``.
"""
