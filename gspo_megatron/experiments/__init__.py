"""Experiments built on the trainer: the GSPO paper's section-5 comparisons on a tiny MoE."""
