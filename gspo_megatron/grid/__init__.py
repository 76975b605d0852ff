"""Scaling and ablation studies on Slurm: a grid of config overrides submitted as one job array
(``spec.py``, ``sbatch.py``), each point's state read back from its run directory and the
scheduler (``state.py``), and the results gathered into one table and figures (``report.py``).
The console entry point is ``gspo-grid`` (``cli/grid.py``)."""
