"""What the Slurm job scripts run where: the launch plan of a training job.

slurm/train_job.sh hands this package the allocation (node names and addresses) and the run's
config; it places the learners and the rollout servers (``config/allocation.py``), derives the
container mounts from the paths the resolved config reads, and writes every srun command line
for the shell to run (``python -m gspo_megatron.launch``). Imports only the config and the
rollout server command lines: no torch, no Megatron, so it runs anywhere the image's Python does.
"""
