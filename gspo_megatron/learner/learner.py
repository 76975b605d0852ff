"""The Megatron-Core learner: log-prob passes and GSPO / GRPO / SFT optimizer steps.

    rt = init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    learner = Learner(cfg, rt)
    out = learner.compute_logprobs(batch)           # per sequence, on every rank
    policy = LogprobLearner(cfg, rt)                # forward only: no DDP, no optimizer
    metrics = learner.train_step(mini_batch, get_policy_loss(cfg.algo.loss))
    learner.save_checkpoint("ckpt/step_10", extra={"data_cursor": 123})

Every rank receives the whole (mini-)batch; each computes the same deterministic split across
data-parallel ranks and the same packing (``batch.plan_step``), so no data is scattered. A step
runs all micro-batches through Megatron's pipeline schedule (``get_forward_backward_func``: no
pipelining, 1F1B or interleaved), then one guarded optimizer step.

Loss scaling: the losses are already normalised by the *global* mini-batch sequence / token
count, so the mini-batch gradient is the plain sum over micro-batches and DP ranks. Megatron
divides each micro-batch loss by the number of micro-batches and averages gradients over DP, so
the loss handed to Megatron is multiplied by ``num_micro_batches * dp_size`` (exact: integers).
The MoE auxiliary loss keeps Megatron's usual per-micro-batch mean.

Context parallelism (CP): every CP rank of a DP rank plans the same micro-batches and keeps its
load-balanced share of each (``learner/batch.py``); the losses complete per-sequence
sums over the CP group (``PolicyLossInputs.cp_group``, full ``seq_token_counts``), so each CP
rank's loss is its share of the objective and the gradient is the *sum* over CP ranks. Megatron
multiplies a 2-tuple loss by ``cp_size`` and DDP averages over DP x CP, which cancel: the scale
above stays ``num_micro_batches * dp_size`` (DP without CP). Loss values and metrics are summed
over DP x CP; ``compute_logprobs`` reassembles each sequence from its CP shares.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.metrics import accumulate_metrics, all_reduce_metrics, metrics_to_floats
from gspo_megatron.algorithms.types import LossOutput, PolicyLossInputs
from gspo_megatron.config.schema import GSPOConfig, resolve_correction
from gspo_megatron.config.sequence_padding import pad_multiple_for
from gspo_megatron.distributed.host_heap import trim_host_heap
from gspo_megatron.learner import checkpointing
from gspo_megatron.learner.checkpoint_files import checkpoint_root
from gspo_megatron.learner.batch import MicroBatch, SequenceBatch, StepPlan, plan_step
from gspo_megatron.learner.freeze import (FrozenParameters, check_same_frozen_groups,
                                          freeze_parameter_groups)
from gspo_megatron.learner.forward import forward_chunk, response_logprobs, split_by_sequence
from gspo_megatron.learner.optimizer import (build_optimizer, build_scheduler, current_lr,
                                             guarded_step, wrap_ddp)
from gspo_megatron.learner.release import release_model
from gspo_megatron.learner.routing import (RECORD, REPLAY, RoutingSession, RoutingTape,
                                           check_routing_supported, chunk_router_layers,
                                           chunk_routers, rollout_tape, routing_change_metrics)
from gspo_megatron.model.provider import (build_gpt_model, build_transformer_config,
                                          resolve_model_config, resolve_params_dtype,
                                          resolve_transformer_impl)

log = logging.getLogger(__name__)

LossFn = Callable[[PolicyLossInputs, object], LossOutput]


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient norm."""


@dataclass
class LogprobOutput:
    """Per sequence, in the batch's order: response-token log-probs and entropies, fp32 CPU."""

    logprobs: List[torch.Tensor]
    entropy: List[torch.Tensor]
    routing: Optional[RoutingTape] = None
    """This rank's recorded MoE routing of the pass (``record_routing=True``), for replay."""


class Learner:
    """Megatron model chunks + DDP + optimizer + scheduler for one learner process."""

    def __init__(self, cfg: GSPOConfig, runtime, total_steps: Optional[int] = None) -> None:
        from megatron.core import parallel_state as ps

        self.cfg, self.runtime = cfg, runtime
        resolve_correction(cfg)  # a config built without load_config: the losses need no "auto"
        self.model_cfg = resolve_model_config(cfg.model)
        self.tf_config = build_transformer_config(self.model_cfg, cfg.parallel)
        self.use_packed_seq = resolve_transformer_impl(self.model_cfg) == "transformer_engine"
        self.device = runtime.device
        vpp = cfg.parallel.vpp
        chunks = [build_gpt_model(self.model_cfg, cfg.parallel, vp_stage=i if vpp else None,
                                  config=self.tf_config) for i in range(vpp or 1)]
        for chunk in chunks:
            chunk.to(self.device)
        # Before DDP and the optimizer: frozen parameters get no grad buffer and no Adam state.
        self.frozen = freeze_parameter_groups(chunks, self.model_cfg, cfg.parallel,
                                              cfg.optimizer.freeze)
        if self.frozen.groups and runtime.is_main:
            log.info("optimizer.freeze: %s frozen (%d parameters on rank 0), %d train",
                     ", ".join(self.frozen.groups), self.frozen.frozen_numel,
                     self.frozen.trainable_numel)
        self.model = wrap_ddp(chunks, self.tf_config, cfg.optimizer.use_distributed_optimizer)
        self.optimizer = build_optimizer(cfg.optimizer, self.model,
                                         resolve_params_dtype(self.model_cfg))
        total = total_steps or cfg.trainer.num_steps * cfg.batch.num_mini_batches
        self.scheduler = build_scheduler(cfg.optimizer, self.optimizer, total)
        self._wire_schedule_hooks()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() \
            if ps.get_tensor_model_parallel_world_size() > 1 else None
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp_size > 1 else None
        self.routers = [chunk_routers(chunk) for chunk in self.model]  # [] per chunk when dense
        self.router_layers = [chunk_router_layers(chunk) for chunk in self.model]
        self.step = 0
        self.consecutive_nonfinite = 0
        self.num_nonfinite_skipped = 0
        self._save_caches: dict = {}
        """Per optimizer form, what repeated saves reuse (``checkpoint_write.SaveCache``)."""
        self._trim_heap()  # the weights DDP copied into its buffers were freed just now

    def _trim_heap(self) -> None:
        """On CPU, hand freed heap pages back to the OS (``distributed/host_heap.py``)."""
        if self.device.type == "cpu":
            trim_host_heap()

    # ---- set-up ---------------------------------------------------------------------------

    def _wire_schedule_hooks(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        c = self.tf_config
        c.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 \
            else self.model[0].no_sync
        c.finalize_model_grads_func = finalize_model_grads
        c.grad_scale_func = self.optimizer.scale_loss

    def plan(self, batch: SequenceBatch) -> StepPlan:
        """This rank's micro-batches (same count and length on every rank)."""
        multiple = self.cfg.parallel.pp if self.cfg.parallel.vpp else 1
        # TP (SP), CP and FP8 padding: one rule, shared with config validation.
        return plan_step(batch, self.dp_rank, self.dp_size,
                         self.cfg.batch.max_tokens_per_micro_batch,
                         pad_multiple=pad_multiple_for(self.cfg.parallel, self.model_cfg),
                         num_micro_multiple=multiple,
                         layout="packed" if self.use_packed_seq else "rows",
                         cp_size=self.cp_size, cp_rank=self.cp_rank)

    # ---- running the schedule -------------------------------------------------------------

    def _sp_shard(self) -> tuple:
        """(size, rank) of the sequence-parallel split of the routers' tokens."""
        sp = self.cfg.parallel.tp if self.cfg.parallel.sp else 1
        return sp, self.tp_rank if sp > 1 else 0

    def _routing_session(self, mode: Optional[str], tape: Optional[RoutingTape] = None):
        """Record / replay MoE routing during one schedule run (``learner/routing.py``)."""
        if mode is None:
            return None
        check_routing_supported(self.tf_config, self.routers, mode)
        sp, sp_rank = self._sp_shard()
        return RoutingSession(self.model, self.routers, mode, tape, sp_size=sp, sp_rank=sp_rank)

    def rollout_routing(self, batch: SequenceBatch) -> RoutingTape:
        """R3: the rollout engine's routing of ``batch`` (``batch.routed_experts``) cut into this
        rank's micro-batches and MoE layers, to replay in :meth:`compute_logprobs` and
        :meth:`train_step` on the same batch (no communication: every rank plans alike)."""
        if batch.routed_experts is None:
            raise ValueError("rollout routing replay: the batch carries no routed experts "
                             "(SequenceBatch.routed_experts)")
        top_k = batch.routed_experts[0].shape[2] if len(batch) else self.model_cfg.moe_router_topk
        if top_k != self.model_cfg.moe_router_topk:
            raise ValueError(f"rollout routing replay: the engine routed to top-{top_k}, the "
                             f"learner's model to top-{self.model_cfg.moe_router_topk}")
        sp, sp_rank = self._sp_shard()
        return rollout_tape(self.plan(batch).micro_batches, self.router_layers, sp, sp_rank)

    def _run_schedule(self, plan: StepPlan, loss_func: Callable, forward_only: bool,
                      routing: Optional[RoutingSession] = None) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbs = plan.micro_batches
        data = [iter(mbs) for _ in self.model] if len(self.model) > 1 else iter(mbs)

        def forward_step(data_iterator, chunk):
            mb = next(data_iterator)
            if routing is not None:
                routing.before_forward(chunk, mb)
            output = forward_chunk(chunk, mb, self.use_packed_seq, self.device)
            if routing is not None:
                routing.after_forward(chunk, mb)
            return output, partial(loss_func, mb)

        with routing if routing is not None else contextlib.nullcontext():
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=self.model,
                num_microbatches=len(mbs), seq_length=plan.padded_len,
                micro_batch_size=plan.rows_per_micro_batch,
                forward_only=forward_only)

    def _logprobs(self, output, mb: MicroBatch, temperature: float, compute_entropy: bool):
        return response_logprobs(output, mb, self.model_cfg.vocab_size, self.tp_group,
                                 self.tp_rank, temperature, compute_entropy)

    # ---- log-prob pass --------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, temperature: Optional[float] = None,
                         record_routing: bool = False,
                         replay: Optional[RoutingTape] = None) -> LogprobOutput:
        """Forward only; per-sequence response log-probs and entropies on every rank, and with
        ``record_routing`` this rank's MoE routing of the pass (to replay in ``train_step``).
        ``replay``: route every token to these experts instead (R3: :meth:`rollout_routing`)."""
        if record_routing and replay is not None:
            raise ValueError("compute_logprobs: record_routing and replay exclude each other")
        temp = self.cfg.rollout.temperature if temperature is None else temperature
        plan = self.plan(batch)
        mode = REPLAY if replay is not None else RECORD if record_routing else None
        session = self._routing_session(mode, replay)

        def loss_func(mb, output):
            if mb.num_seqs == 0:
                return output.sum() * 0.0, {}
            lp, ent = self._logprobs(output, mb, temp, compute_entropy=True)
            where = [w.long() for w in split_by_sequence(mb.response_token_index(), mb)]
            per_seq = dict(zip(mb.seq_ids, zip(where, split_by_sequence(lp, mb),
                                               split_by_sequence(ent, mb))))
            return lp.sum(), {"per_seq": per_seq}

        for m in self.model:
            m.eval()
        try:
            results = self._run_schedule(plan, loss_func, forward_only=True, routing=session)
        finally:
            for m in self.model:
                m.train()
        mine: Dict[int, tuple] = {}
        if self.is_last_stage and self.tp_rank == 0:
            for item in results:
                mine.update(item.get("per_seq", {}))
        out = _assemble_sequences(batch, _all_gather_objects(mine))
        out.routing = session.tape if record_routing else None
        return out

    def record_routing(self, batch: SequenceBatch) -> RoutingTape:
        """Forward only: the top-k experts every MoE layer picks for every token of ``batch``."""
        return self.compute_logprobs(batch, record_routing=True).routing

    def routing_change(self, before: RoutingTape, after: RoutingTape) -> Dict[str, float]:
        """Expert volatility between two recordings of the same batch, over all ranks
        (each rank holds distinct (token, layer) pairs: DP / CP / SP shards, PP stages)."""
        metrics = routing_change_metrics(before, after, self.model_cfg.num_experts)
        all_reduce_metrics(metrics)
        return metrics_to_floats(metrics)

    # ---- training -------------------------------------------------------------------------

    def _policy_inputs(self, mb: MicroBatch, plan: StepPlan, lp, ent) -> PolicyLossInputs:
        extras = {k: v.to(lp.device) for k, v in mb.extras.items()}
        counts = mb.seq_token_counts().to(lp.device)
        return PolicyLossInputs(
            logprobs=lp, old_logprobs=extras.get("old_logprobs", lp.detach()),
            advantages=extras.get("advantages", torch.zeros_like(lp)),
            seq_index=mb.seq_index.to(lp.device), num_seqs=mb.num_seqs,
            seq_token_counts=counts, global_num_seqs=plan.global_num_seqs,
            global_num_tokens=plan.global_num_tokens, entropy=ent,
            ref_logprobs=extras.get("ref_logprobs"),
            rollout_logprobs=extras.get("rollout_logprobs"), cp_group=self.cp_group,
            token_lag=extras.get("token_lags"))

    def forward_backward(self, mini_batch: SequenceBatch, loss_fn: LossFn,
                         temperature: Optional[float] = None,
                         routing: Optional[RoutingTape] = None) -> Dict[str, object]:
        """Accumulate the mini-batch gradient in the DDP grad buffers (no optimizer step);
        ``routing`` (recorded on the same mini-batch) is replayed in every MoE layer."""
        temp = self.cfg.rollout.temperature if temperature is None else temperature
        plan = self.plan(mini_batch)
        scale = float(len(plan.micro_batches) * self.dp_size)

        def loss_func(mb, output):
            if mb.num_seqs == 0:
                return output.sum() * 0.0, {}
            lp, ent = self._logprobs(output, mb, temp, compute_entropy=True)
            out = loss_fn(self._policy_inputs(mb, plan, lp, ent), self.cfg.algo)
            return out.loss * scale, {"loss": out.loss.detach(), "metrics": out.metrics}

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        session = self._routing_session(REPLAY if routing is not None else None, routing)
        results = self._run_schedule(plan, loss_func, forward_only=False, routing=session)
        loss_sum = torch.zeros((), dtype=torch.float64)
        metrics: dict = {}
        for item in results if self.is_last_stage else []:
            if "loss" in item:
                loss_sum += item["loss"].double().cpu()
                accumulate_metrics(metrics, {k: v.cpu() for k, v in item["metrics"].items()})
        return {"plan": plan, "loss_sum": loss_sum, "metrics": metrics}

    def _reduce_step_metrics(self, fb: Dict[str, object]) -> Dict[str, float]:
        """Loss and loss metrics reduced over DP x CP on the last stage, then shared with all ranks
        (each CP rank's loss is its share of the objective, so shares add up)."""
        from megatron.core import parallel_state as ps

        out: Dict[str, float] = {}
        if self.is_last_stage:
            metrics = fb["metrics"]
            loss = fb["loss_sum"].clone()
            if self.dp_size * self.cp_size > 1:
                group = ps.get_data_parallel_group(with_context_parallel=True)
                all_reduce_metrics(metrics, group=group)
                dist.all_reduce(loss, group=group)
            out = metrics_to_floats(metrics)
            out["loss"] = float(loss)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            holder = [out]
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast_object_list(holder, src=last,
                                       group=ps.get_pipeline_model_parallel_group())
            out = holder[0]
        return out

    def train_step(self, mini_batch: SequenceBatch, loss_fn: LossFn,
                   temperature: Optional[float] = None,
                   routing: Optional[RoutingTape] = None) -> Dict[str, float]:
        """Forward/backward over all micro-batches, one guarded optimizer step; metrics.
        ``routing``: replay this recorded MoE routing (routing replay)."""
        start = time.perf_counter()
        fb = self.forward_backward(mini_batch, loss_fn, temperature, routing)
        metrics = self._reduce_step_metrics(fb)
        loss_finite = math.isfinite(metrics["loss"])
        result = guarded_step(self.optimizer, self.cfg.optimizer.clip_grad, loss_finite)
        self._trim_heap()  # the step's activations and temporaries are gone
        if result.updated:
            self.scheduler.step(increment=1)
            self.step += 1
            self.consecutive_nonfinite = 0
        else:
            self._on_skipped_step(metrics["loss"], result.grad_norm)
        elapsed = time.perf_counter() - start
        plan: StepPlan = fb["plan"]
        num_tokens = sum(len(t) for t in mini_batch.token_ids)
        metrics.update(grad_norm=result.grad_norm, lr=current_lr(self.optimizer) or 0.0,
                       skipped=float(not result.updated),
                       num_nonfinite_skipped=float(self.num_nonfinite_skipped),
                       num_micro_batches=float(len(plan.micro_batches)),
                       padded_len=float(plan.padded_len), num_tokens=float(num_tokens),
                       step_time_s=elapsed, tokens_per_s=num_tokens / max(elapsed, 1e-9))
        return metrics

    def _on_skipped_step(self, loss: float, grad_norm: float) -> None:
        self.num_nonfinite_skipped += 1
        self.consecutive_nonfinite += 1
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        limit = self.cfg.optimizer.max_consecutive_nonfinite
        log.warning("step %d skipped: loss=%s grad_norm=%s (%d in a row, limit %d)",
                    self.step, loss, grad_norm, self.consecutive_nonfinite, limit)
        if self.consecutive_nonfinite >= limit:
            where = self.last_good_dir()
            self.save_checkpoint(where, extra={"stopped_for": "non-finite loss or grad norm"})
            raise NonFiniteTrainingError(
                f"{self.consecutive_nonfinite} consecutive steps had a non-finite loss or grad "
                f"norm (optimizer.max_consecutive_nonfinite={limit}); the last good state "
                f"(step {self.step}) was saved to {where}")

    # ---- checkpoints ----------------------------------------------------------------------

    def last_good_dir(self) -> Path:
        return checkpoint_root(self.cfg.checkpoint, self.cfg.logging.run_dir) / "last_good"

    def _meta(self) -> dict:
        return {"step": self.step, "model": self.model_cfg, "parallel": self.cfg.parallel,
                "frozen": list(self.frozen.groups)}

    def save_checkpoint(self, directory, extra: Optional[dict] = None,
                        meta: Optional[dict] = None,
                        form: str = checkpointing.FAST_FORM, background: bool = False):
        """Training checkpoint; ``extra`` goes into the checkpoint, ``meta`` into gspo_meta.json;
        ``form``: the optimizer's (``learner/checkpointing.py``: fast by default, portable for
        a resume under another layout); ``background``: the writes go on in a thread, and
        the returned ``PendingSave`` must be finished before the next optimizer step."""
        return checkpointing.save_training_checkpoint(
            self.model, self.optimizer, self.scheduler, directory,
            {**(meta or {}), **self._meta()}, extra, form=form, background=background,
            caches=self._save_caches)

    def load_checkpoint(self, directory, load_optimizer: bool = True) -> dict:
        """Restore a training checkpoint (a portable one under any layout, a fast one under its
        own up to the data-parallel size); returns the saved ``extra`` dict."""
        if not load_optimizer:
            self.load_weights(directory)
            return {}
        check_same_frozen_groups(checkpointing.read_meta(directory), self.frozen.groups, directory)
        state = checkpointing.load_training_checkpoint(
            self.model, self.optimizer, self.scheduler, directory, self.cfg.parallel)
        self.step = state["step"]
        return state["extra"]

    def load_weights(self, directory) -> dict:
        """Model weights only (e.g. a converted HF checkpoint); optimizer state is kept."""
        meta = checkpointing.load_model_weights(self.model, directory)
        self.optimizer.reload_model_params()
        return meta

    def save_weights(self, directory) -> None:
        checkpointing.save_model_weights(self.model, directory, self._meta())

    def close(self) -> None:
        """End this learner's run: its model, optimizer and the process groups they hold can
        then be freed (``learner/release.py``: Megatron keeps them alive otherwise). Safe to
        call twice; nothing trains or computes with this learner after it."""
        self._save_caches = {}  # their strategies hold process groups and cached plans
        release_model(self.model, self.optimizer)


def _assemble_sequences(batch: SequenceBatch, parts: List[dict]) -> LogprobOutput:
    """Merge ``{seq_id: (token_index, logprobs, entropy)}`` from every rank into per-sequence
    tensors in response order (under CP a sequence arrives in pieces from its CP ranks)."""
    lps = [torch.full((batch.response_len(i),), float("nan")) for i in range(len(batch))]
    ents = [torch.full((batch.response_len(i),), float("nan")) for i in range(len(batch))]
    filled = [torch.zeros(batch.response_len(i), dtype=torch.bool) for i in range(len(batch))]
    for part in parts:
        for i, (where, lp, ent) in part.items():
            lps[i][where], ents[i][where] = lp, ent
            filled[i][where] = True
    missing = [i for i in range(len(batch)) if not bool(filled[i].all())]
    if missing:
        raise RuntimeError(f"compute_logprobs: no result for (part of) sequences {missing[:10]}")
    return LogprobOutput(lps, ents)


def _all_gather_objects(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class LogprobLearner(Learner):
    """:class:`Learner` minus training: the same model, packing, schedule and
    ``compute_logprobs`` / ``record_routing``, without DDP, gradient buffers or an optimizer.

    For a frozen policy and for checking the learner's numerics where its training state does
    not fit: at Qwen3-30B widths a Learner holds bf16 weights plus fp32 gradient buffers and fp32
    main weights (~5x the weights), this one the weights only
    (``benchmarks/bench_real_geometry.py``). Weights: ``checkpoint.learner_hf.load_hf_into_learner``.
    """

    def __init__(self, cfg: GSPOConfig, runtime) -> None:  # noqa: D107 - no super(): no DDP
        from megatron.core import parallel_state as ps

        self.cfg, self.runtime = cfg, runtime
        resolve_correction(cfg)  # a config built without load_config: the losses need no "auto"
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
        self.frozen = FrozenParameters(groups=())  # nothing trains: no optimizer to keep out of
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
