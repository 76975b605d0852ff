"""A forward-only learner: the Learner's model, packing, schedule and log-prob pass, without
DDP, gradient buffers or an optimizer.

    rt = init_distributed(cfg.parallel, seed=0)
    policy = LogprobLearner(cfg, rt)
    load_hf_into_learner(policy, cfg.model.hf_path)   # checkpoint/learner_hf.py
    out = policy.compute_logprobs(batch)    # exactly Learner.compute_logprobs

For a frozen policy (a reference model, a judge) and for checking the learner's numerics at a
size whose training state does not fit the machine: at Qwen3-30B widths a training Learner
holds bf16 weights plus fp32 gradient buffers and fp32 main weights (about 5x the weights),
this one only the weights (``benchmarks/bench_real_geometry.py``).
"""

from __future__ import annotations

from gspo_megatron.config.schema import GSPOConfig
from gspo_megatron.learner.learner import Learner
from gspo_megatron.learner.routing import chunk_router_layers, chunk_routers
from gspo_megatron.model.provider import (build_gpt_model, build_transformer_config,
                                          resolve_model_config, resolve_transformer_impl)


class LogprobLearner(Learner):
    """:class:`Learner` minus training: ``compute_logprobs`` / ``record_routing`` only."""

    def __init__(self, cfg: GSPOConfig, runtime) -> None:  # noqa: D107 - no super(): no DDP
        from megatron.core import parallel_state as ps

        self.cfg, self.runtime = cfg, runtime
        self.model_cfg = resolve_model_config(cfg.model)
        self.tf_config = build_transformer_config(self.model_cfg, cfg.parallel)
        self.tf_config.perform_initialization = False  # every weight is loaded afterwards
        self.use_packed_seq = resolve_transformer_impl(self.model_cfg) == "transformer_engine"
        self.device = runtime.device
        vpp = cfg.parallel.vpp
        self.model = [build_gpt_model(self.model_cfg, cfg.parallel, vp_stage=i if vpp else None,
                                      config=self.tf_config).to(self.device)
                      for i in range(vpp or 1)]
        for chunk in self.model:
            chunk.requires_grad_(False)
        self.optimizer = self.scheduler = None
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() \
            if ps.get_tensor_model_parallel_world_size() > 1 else None
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp_size > 1 else None
        self.routers = [chunk_routers(chunk) for chunk in self.model]
        self.router_layers = [chunk_router_layers(chunk) for chunk in self.model]
        self.step = 0

    def train_step(self, *args, **kwargs):
        raise TypeError("LogprobLearner is forward-only: build a Learner to train")

    forward_backward = train_step
