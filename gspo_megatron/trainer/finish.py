"""The end of a run, after its last step: the final policy in Hugging Face format, the metrics
plot, and the held-out evaluation before and after RL in the log.

    finish_run(parts)      # collective: call on every rank (the export gathers the policy)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gspo_megatron.checkpoint.learner_hf import export_learner_to_hf
from gspo_megatron.trainer.evaluation import before_after_table
from gspo_megatron.trainer.plot import plot_history

if TYPE_CHECKING:
    from gspo_megatron.trainer.build import TrainerParts

log = logging.getLogger(__name__)


def finish_run(parts: TrainerParts) -> None:
    """Plot and export the final policy to Hugging Face format."""
    out = export_learner_to_hf(parts.learner, parts.run_dir / "hf_export",
                               tokenizer_dir=parts.cfg.model.hf_path)
    if parts.runtime.is_main:
        if parts.cfg.logging.plot:
            try:
                plot_history(parts.logger.history, parts.run_dir / "metrics.png",
                             bin_edges=parts.cfg.algo.diagnostics.log_ratio_bin_edges)
            except OSError as exc:  # the plot is a convenience; metrics.jsonl has the data
                log.warning("could not write %s: %s", parts.run_dir / "metrics.png", exc)
        log.info("exported the final policy to %s", out)
        table = before_after_table(parts.logger.history)
        if table:
            log.info("held-out evaluation, before and after RL:\n%s", table)
