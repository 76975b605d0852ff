"""Job submitters: chain the Slurm stages of a run, or fan a grid of overrides out as a job array."""
