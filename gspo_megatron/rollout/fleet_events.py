"""What the Slurm job did to its rollout servers, read by the trainer for its metrics.

slurm/fleet.sh appends one JSON line per event to ``<run dir>/fleet_events.jsonl``: a server
``down`` (its step's exit code, a hang, a restart that never got healthy: ``reason``), then
``restarted`` (a new step on the same node and port), then ``healthy`` (with ``down_s``, the
time from its death to its health: what the death cost that server), or ``gave_up`` when its
restart budget was spent. The trainer logs them (``rollout/server_restarts``,
``rollout/servers_down``, ``rollout/server_down_s``) next to what its own pool sees
(``rollout/live_servers``), so a run's metrics say how much of its time a smaller fleet served.
The file is read from where the last read stopped; a line the job is still writing is read
the next time.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional

log = logging.getLogger(__name__)

EVENTS_FILE = "fleet_events.jsonl"


class FleetEventLog:
    """Incremental reader of one run's ``fleet_events.jsonl``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self.num_restarts = 0
        """``restarted`` events read so far (every run of the job: the file is the run's)."""
        self.down_s = 0.0
        """Sum of ``down_s`` of the ``healthy`` events: server time lost to deaths."""
        self.down: Dict[str, str] = {}
        """Servers down now (not healthy since their last ``down``): name -> reason."""

    @classmethod
    def for_run(cls, run_dir: Optional[str]) -> Optional["FleetEventLog"]:
        return cls(os.path.join(run_dir, EVENTS_FILE)) if run_dir else None

    def poll(self) -> List[dict]:
        """The events appended since the last call (each one also logged)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # an unfinished last line waits for the next read
        self._offset += end
        events = []
        for number, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                name, kind = str(event["server"]), str(event["event"])
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("%s: unreadable line skipped (%s): %r", self.path, exc, line[:200])
                continue
            self._count(name, kind, event)
            events.append(event)
        return events

    def _count(self, name: str, kind: str, event: dict) -> None:
        where = f"rollout server {name} ({event.get('address')})"
        if kind == "down":
            self.down[name] = str(event.get("reason") or "")
            log.warning("%s went down: %s", where, self.down[name])
        elif kind == "restarted":
            self.num_restarts += 1
            log.warning("%s restarted by the job (%s restart(s) of it within the hour)", where,
                        event.get("restarts_last_hour"))
        elif kind == "healthy":
            self.down.pop(name, None)
            self.down_s += float(event.get("down_s") or 0.0)
            log.info("%s healthy again after %ss; it rejoins at the next weight sync", where,
                     event.get("down_s"))

    def metrics(self) -> Dict[str, float]:
        self.poll()
        return {"rollout/server_restarts": float(self.num_restarts),
                "rollout/servers_down": float(len(self.down)),
                "rollout/server_down_s": self.down_s}
