"""Recount every trained token's lag from what the engine reported, without the trainer's
version map (issue 51, item 3).

The generator's drop rule and the lag metrics both read ``AsyncRollouts.lag_of``; an off-by-one
there would pass any test that reads it too. Here a token's lag is computed from first
principles: the engine tagged it with the weight version that generated it (the learner's
optimizer step at the sync, kept raw in the ledger's ``taken`` rows), the cold start took
``sft/num_steps`` optimizer steps, and every RL step takes ``num_mini_batches`` more, so
version ``v`` holds the weights after RL step ``j = (v - sft) / num_mini_batches`` and a token
trained at step ``s`` is ``(s - 1) - j`` updates old. (A run with ``algo.tis.mode=mask`` may skip
a mini-batch's update; this audit is for runs that do not.)
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List


def recounted_lags(rows: List[dict], ledger: List[dict], num_mini_batches: int) -> Dict[int, Counter]:
    """Per RL step: tokens at each lag, from the engine's versions in the ledger."""
    sft = int(rows[0].get("sft/num_steps", 0))
    out: Dict[int, Counter] = {}
    for entry in ledger:
        step = entry["step"]
        for _index, _prompt, _lag, versions in entry.get("taken", []):
            for version, tokens in versions.items():
                rl_steps, rest = divmod(int(version) - sft, num_mini_batches)
                if rest or rl_steps < 0:
                    raise AssertionError(f"step {step}: weight version {version} is not the "
                                         f"weights after an RL step (cold start {sft} steps, "
                                         f"{num_mini_batches} updates per step)")
                out.setdefault(step, Counter())[(step - 1) - rl_steps] += tokens
    return out


def lag_mismatches(rows: List[dict], ledger: List[dict], num_mini_batches: int,
                   max_staleness: int) -> List[str]:
    """Where the recount disagrees with the run: a token past the bound, a step whose
    ``async/lag<j>_token_frac`` or ``rollout/policy_lag_steps`` differs from the recount, a
    group whose recorded lag is not its oldest token's. Empty: they agree."""
    problems = []
    counts = recounted_lags(rows, ledger, num_mini_batches)
    for row in rows[1:]:
        step = row["step"]
        lags = counts.get(step)
        if not lags:
            problems.append(f"step {step}: the ledger names no token trained")
            continue
        total = sum(lags.values())
        if min(lags) < 0 or max(lags) > max_staleness:
            problems.append(f"step {step}: lags {sorted(lags)} outside 0..{max_staleness}")
        for j in range(max_staleness + 1):
            logged = row.get(f"async/lag{j}_token_frac")
            if logged is None or abs(logged - lags[j] / total) > 1e-9:
                problems.append(f"step {step}: lag {j} holds {lags[j]}/{total} tokens by the "
                                f"engine's versions, the metrics say {logged}")
        if row.get("rollout/policy_lag_steps") != max(lags):
            problems.append(f"step {step}: oldest token {max(lags)} steps old, the metrics say "
                            f"{row.get('rollout/policy_lag_steps')}")
    sft = int(rows[0].get("sft/num_steps", 0))
    for entry in ledger:
        for index, _prompt, lag, versions in entry.get("taken", []):
            oldest = (entry["step"] - 1) - (min(map(int, versions)) - sft) // num_mini_batches
            if lag != oldest:
                problems.append(f"step {entry['step']}: group {index} recorded lag {lag}, its "
                                f"oldest token is {oldest} steps old")
    return problems


def off_by_one(rows: List[dict], max_staleness: int) -> List[dict]:
    """The metrics an ``lag_of`` one step short would have logged (every lag one less, lag 0
    absorbing lag 1): what the audit must reject."""
    out = []
    for row in rows:
        row = dict(row)
        if "async/lag0_token_frac" in row:
            fracs = [row[f"async/lag{j}_token_frac"] for j in range(max_staleness + 1)]
            shifted = [fracs[0] + fracs[1]] + fracs[2:] + [0.0]
            row.update({f"async/lag{j}_token_frac": f for j, f in enumerate(shifted)})
            row["rollout/policy_lag_steps"] = max(row["rollout/policy_lag_steps"] - 1, 0)
        out.append(row)
    return out
