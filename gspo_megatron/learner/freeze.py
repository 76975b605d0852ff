"""Apply ``optimizer.freeze`` to the learner's model chunks, before DDP and the optimizer exist.

Megatron-Core leaves a parameter with ``requires_grad=False`` out of everything that trains:
DDP's contiguous fp32 gradient buffers (``distributed_data_parallel.py``: only parameters that
require a gradient get a slot), the optimizer's parameter groups (``optimizer/__init__.py:
_get_param_groups``) and so the distributed optimizer's fp32 main weights and Adam moments, and
the gradient norm. A frozen embedding's ``main_grad`` is None, which Megatron's tied-embedding
all-reduce skips (``finalize_model_grads.py``). Freezing therefore has to happen here, between
building the chunks and wrapping them; afterwards the buffers are laid out.

The parameters stay in the module: checkpoints (``sharded_state_dict``), the HF export and every
weight sync read them as before. The groups and their rules: ``config/freeze.py``.

    frozen = freeze_parameter_groups(chunks, model_cfg, parallel, ["embedding", "output_layer"])
    frozen.numel_by_group   # {"embedding": 311164928, "output_layer": 311164928} on this rank
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Sequence

from gspo_megatron.config.errors import ConfigError
from gspo_megatron.config.freeze import FREEZE_KEY, freeze_problems, frozen_set, parameter_group
from gspo_megatron.config.pipeline_split import stage_layer_counts


@dataclass
class FrozenParameters:
    """What :func:`freeze_parameter_groups` froze on this rank."""

    groups: tuple
    """The frozen groups, in ``FREEZE_GROUPS`` order."""
    numel_by_group: Dict[str, int] = field(default_factory=dict)
    """Parameters frozen on this rank, per group."""
    trainable_numel: int = 0
    """Parameters of this rank that still train."""

    @property
    def frozen_numel(self) -> int:
        return sum(self.numel_by_group.values())


def freeze_parameter_groups(chunks, model_cfg, parallel, freeze: Sequence[str]) -> FrozenParameters:
    """Set ``requires_grad=False`` on every parameter of the ``freeze`` groups in ``chunks``.

    ``model_cfg`` is the resolved model (``model.hf_path``'s config.json applied), so the rules
    of ``config/freeze.py`` are checked again against the real shapes (tied embeddings, dense or
    MoE); a rank left with nothing to train is refused too. Raises :class:`ConfigError` naming
    ``optimizer.freeze``."""
    groups = frozen_set(freeze)
    if not groups:
        return FrozenParameters(groups=())
    stages = stage_layer_counts(model_cfg.num_layers, parallel.pp,
                                parallel.num_layers_in_first_pipeline_stage,
                                parallel.num_layers_in_last_pipeline_stage)
    problems = freeze_problems(model_cfg, list(freeze), stages)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    out = FrozenParameters(groups=groups)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            group = parameter_group(name)
            if group in groups:
                param.requires_grad_(False)
                out.numel_by_group[group] = out.numel_by_group.get(group, 0) + param.numel()
            else:
                out.trainable_numel += param.numel()
    if out.trainable_numel == 0:
        raise ConfigError(f"{FREEZE_KEY}: {list(groups)} leaves this learner rank no parameter "
                          "to train (its model chunks hold only frozen groups)")
    return out


def check_same_frozen_groups(meta: dict, groups: Sequence[str], directory) -> None:
    """Refuse to resume a training checkpoint whose optimizer state was built for other frozen
    groups (its ``gspo_meta.json`` records them; checkpoints from before the key froze none):
    the distributed optimizer's state would cover other parameters. Weights alone load either
    way (``checkpoint.load_dir``)."""
    saved = tuple(meta.get("frozen") or ())
    if saved != tuple(groups):
        raise ConfigError(
            f"{FREEZE_KEY}: is {list(groups)} but {directory} was trained with {list(saved)}; its "
            "optimizer state covers other parameters. Resume with the same optimizer.freeze, or "
            "start a new run from its weights (checkpoint.load_dir)")
