"""The learner's threads beside the embedded engine's process, and whether the overlap pays.

With ``rollout.overlap_one_step`` and the embedded engine, generation runs in a second process
with ``rollout.embedded_num_threads`` torch threads while the learner updates. On a small
machine the two compete for cores: on 2 cores a wide MoE (hidden 256, 16 experts top-4) ran
0.63 s per overlapped step against 0.43 s on-policy, the learner having given a core to the
engine (issue 30; ``docs/performance.md``). Two ways to share the machine
(``rollout.overlap_thread_split``):

- ``share``: the learner gives up the engine's threads (``total - embedded``, at least one);
  nothing is oversubscribed, but the update runs on fewer cores.
- ``full``: the learner keeps all of its threads; while the engine generates the machine is
  oversubscribed, once it is done the update has every core.
- ``auto``: measure. Over the first RL steps (after step 1, which pays the warm-up) the main
  rank runs overlapped steps with each split and *serial* steps with each thread count: a
  serial step lets the in-flight generation finish before the update, so generation and update
  run one after the other as on-policy would, the update with the learner threads of ``share``
  or of ``full`` (the engine's generation keeps its own threads, so this slightly overstates an
  on-policy step). The phases take turns, one step each, for ``rollout.overlap_probe_steps``
  rounds, and each counts its fastest step, so a slow start or a busy moment of a shared
  machine does not decide. The faster split is kept for the rest of the run; a phase whose
  step takes over twice the best of its kind leaves the later rounds (on a shared machine,
  oversubscribed OpenMP threads spinning at their barriers were measured 4-40x slower).

A fixed split still runs the serial steps. When the best overlapped step is slower than the
best serial one, the overlap does not pay on this machine and shape: a WARNING names the numbers
and the thread count, and suggests ``rollout.overlap_one_step=false``. Changing the learner's
thread count can change the last bits of some reductions, as any thread setting does; nothing
else of the run changes (the rollouts and their pi_old are the same whether the update waits for
the next generation or not).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch

from gspo_megatron.config.schema import rollout_staleness

log = logging.getLogger(__name__)

SPLITS = ("auto", "share", "full")
SERIAL = "serial_"  # + a split: generation, then the update with that split's learner threads


def learner_threads(split: str, total_threads: int, engine_threads: int) -> int:
    """Torch threads of the learner under ``split`` (``share`` or ``full``)."""
    if split == "full":
        return total_threads
    return max(1, total_threads - engine_threads)


def probe_phases(split: str, total_threads: int, engine_threads: int) -> List[str]:
    """The phases the probe runs, in order: the candidate splits, then the serial steps with
    each distinct thread count (fewer threads first)."""
    distinct = ["share"]
    if learner_threads("full", total_threads, engine_threads) != \
            learner_threads("share", total_threads, engine_threads):
        distinct.append("full")
    splits = distinct if split == "auto" else [split]
    return splits + [SERIAL + s for s in distinct]


def is_serial(phase: Optional[str]) -> bool:
    return bool(phase) and phase.startswith(SERIAL)


def overlap_thread_tuner(cfg) -> Optional["OverlapThreadTuner"]:
    """The tuner of a run (main rank), or None unless the embedded engine's process overlaps the
    learner (``rollout.max_staleness=1``, alias ``overlap_one_step``, with
    ``rollout.engine=embedded``): only then does the
    engine take cores from the learner's machine."""
    r = cfg.rollout
    if not (rollout_staleness(r) == 1 and r.engine == "embedded"):
        return None
    return OverlapThreadTuner(r.overlap_thread_split, torch.get_num_threads(),
                              r.embedded_num_threads, r.overlap_probe_steps, cfg.trainer.num_steps)


class OverlapThreadTuner:
    """Sets the learner's threads step by step while probing, then keeps the faster split.

    The loop calls :meth:`before_update` once the next rollout is submitted and
    :meth:`after_step` with the step's metrics (``time/step_s``). Main rank only. The phases
    take turns, one step each, for ``probe_steps`` rounds, so a slow start or a busy moment of
    the machine does not land on one phase; each phase counts its fastest step (interference
    only adds time). A phase whose step takes more than ``CUT_FACTOR`` times the best of its
    kind (overlapped or serial) so far leaves the later rounds (OpenMP threads spinning on
    shared cores)."""

    CUT_FACTOR = 2.0

    def __init__(self, split: str, total_threads: int, engine_threads: int, probe_steps: int,
                 num_steps: int) -> None:
        self.total_threads = total_threads
        self.engine_threads = engine_threads
        self.num_steps = num_steps
        self.chosen = "share" if split == "auto" else split
        self.phases = probe_phases(split, total_threads, engine_threads) if probe_steps else []
        self.probe_steps = probe_steps
        self._first: Optional[int] = None  # the first RL step of this process (resumed runs)
        self._round: List[str] = list(self.phases)  # this round's phases still to run
        self._rounds_left = probe_steps - 1
        self._dropped: set = set()
        self.step_s: Dict[str, List[float]] = {p: [] for p in self.phases}
        self.verdict: Dict[str, float] = {}
        torch.set_num_threads(self.threads_for(self.chosen))
        log.info("learner: %d torch thread(s) beside the engine's %d (split '%s'%s)",
                 self.threads_for(self.chosen), engine_threads, self.chosen,
                 ", probing " + "/".join(self.phases) if self.phases else "")

    def _start(self, step: int) -> None:
        """The probe starts at the second step this process runs (the first pays the warm-up;
        a resumed run counts from its first step)."""
        self._first = step
        left = self.num_steps - step + 1
        # Each probed step needs a successor whose generation overlaps it (the last step has
        # none), so the run needs the warm-up step, the probe and one more.
        if self.phases and 1 + len(self.phases) * self.probe_steps >= left:
            log.info("rollout.overlap_probe_steps=%d: %d RL step(s) are too few to probe %s; "
                     "the learner keeps split '%s'", self.probe_steps, left,
                     "/".join(self.phases), self.chosen)
            self.phases, self._round = [], []

    def threads_for(self, phase: str) -> int:
        split = phase[len(SERIAL):] if is_serial(phase) else phase
        return learner_threads(split, self.total_threads, self.engine_threads)

    def phase(self, step: int) -> Optional[str]:
        """The probe phase of RL step ``step``, or None outside the probe."""
        if self._first is None:
            self._start(step)
        if step == self._first or not self._round:
            return None
        return self._round[0]

    def before_update(self, step: int) -> bool:
        """Set the threads of ``step``'s update; True when it must wait for the in-flight
        generation first (a serial probe step)."""
        phase = self.phase(step)
        torch.set_num_threads(self.threads_for(phase or self.chosen))
        return is_serial(phase)

    def after_step(self, step: int, metrics: Dict[str, float]) -> Dict[str, float]:
        """Record ``step``'s time; after the last probe step, choose and judge. Returns metrics
        to log (``overlap/*``)."""
        phase = self.phase(step)
        out = {"overlap/learner_threads": float(torch.get_num_threads())}
        if phase is None:
            return out
        times = self.step_s[phase]
        times.append(metrics["time/step_s"])
        best = [min(self.step_s[p]) for p in self.phases
                if p != phase and self.step_s[p] and is_serial(p) == is_serial(phase)]
        if best and times[-1] > self.CUT_FACTOR * min(best) and self._rounds_left:
            log.info("overlap probe: '%s' took %.3f s, over %.0fx the best of its kind; not "
                     "probed further", phase, times[-1], self.CUT_FACTOR)
            self._dropped.add(phase)
        self._round.pop(0)
        if not self._round and self._rounds_left:
            self._rounds_left -= 1
            self._round = [p for p in self.phases if p not in self._dropped]
        if not self._round:
            out.update(self._decide())
        return out

    def _decide(self) -> Dict[str, float]:
        med = {p: min(v) for p, v in self.step_s.items()}  # each phase's fastest step
        self.chosen = min((p for p in self.phases if not is_serial(p)), key=med.get)
        serial = min((p for p in self.phases if is_serial(p)), key=med.get)
        torch.set_num_threads(self.threads_for(self.chosen))
        best = med[self.chosen]
        log.info("overlap probe (fastest s per step): %s; keeping split '%s' (%d learner "
                 "thread(s))", ", ".join(f"{p} ({self.threads_for(p)} learner thread(s)) "
                                         f"{med[p]:.3f} s" for p in self.phases),
                 self.chosen, self.threads_for(self.chosen))
        if best > med[serial]:
            log.warning("rollout.overlap_one_step does not pay here: an overlapped step took "
                        "%.3f s (split '%s'), generation then update one after the other %.3f s "
                        "with %d learner thread(s) (%.2fx). Set rollout.overlap_one_step=false "
                        "(OMP_NUM_THREADS=%d): the engine's process takes cores the learner's "
                        "update needs on this machine and model.", best, self.chosen,
                        med[serial], self.threads_for(serial), best / med[serial],
                        self.threads_for(serial))
        self.verdict = {f"overlap/probe_{p}_step_s": med[p] for p in self.phases}
        self.verdict["overlap/pays"] = float(best <= med[serial])
        return dict(self.verdict)


__all__ = ["OverlapThreadTuner", "SPLITS", "learner_threads", "probe_phases"]
