"""HTTP client of one SGLang server (or reference server): one method per endpoint we use.

Thread-safe (one ``requests.Session`` per thread). Transport failures (connection refused or
reset, timeouts, HTTP 5xx) raise :class:`ServerUnavailable` so that callers can retry on another
server; a refusal (HTTP 4xx, ``success: false``) raises :class:`api.ServerRefused` naming
the server, the endpoint and SGLang's own message; a body outside the schema raises
:class:`api.ProtocolError`. Status codes and bodies follow sglang 0.5.23's
``srt/entrypoints/http_server.py``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Optional, Sequence

import requests

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang import server_keys
from gspo_megatron.rollout.sglang.server_keys import ServerKeys

log = logging.getLogger(__name__)


class ServerUnavailable(RuntimeError):
    """The server did not answer in time, or answered 5xx: try another one."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        """The server may still be working on the request (the client gave up waiting)."""


class ServerAuthError(api.ServerRefused):
    """401 / 403: this job's key is missing or wrong for that server. Never retried: another
    attempt would carry the same key."""

    def __init__(self, server: str, endpoint: str, status: int, sent_key: bool) -> None:
        why = ("the key sent is wrong (the server was started with other keys)" if sent_key else
               "no key was sent, and the server requires one")
        super().__init__(server, endpoint, f"HTTP {status}: {why}; the job's keys are in "
                         "rollout.sglang.key_file (default <run_dir>/secrets/"
                         f"{server_keys.KEY_FILE_NAME})")
        self.status = status


_PROCESS_KEYS: Any = object()
"""Default of ``keys``: this process's keys (``server_keys.use_keys``)."""


def _json_or_text(resp: requests.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text


class SGLangServerClient:
    """Calls on ``http://host:port`` with a per-call timeout."""

    def __init__(self, address: str, timeout_s: float = 600.0, control_timeout_s: float = 600.0,
                 keys: Optional[ServerKeys] = _PROCESS_KEYS) -> None:
        if "://" in address:
            address = address.split("://", 1)[1]
        if ":" not in address:
            raise ValueError(f"server address {address!r} must be host:port")
        self.address = address.rstrip("/")
        self.base_url = f"http://{self.address}"
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.keys = server_keys.process_keys() if keys is _PROCESS_KEYS else keys
        """Bearer tokens sent on every call (``rollout/sglang/server_keys.py``); None sends none."""
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def request(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
                timeout_s: Optional[float] = None, answers: Sequence[int] = ()) -> requests.Response:
        """One call; ``answers``: statuses returned as they are (an answer, not an outage)."""
        token = self.keys.for_path(path) if self.keys is not None else None
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            resp = self._session().request(method, self.base_url + path, json=body,
                                           timeout=timeout_s or self.timeout_s, headers=headers)
        except requests.Timeout as exc:
            raise ServerUnavailable(f"{self.address}{path}: timed out: {exc}", timed_out=True) from exc
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
            # ChunkedEncodingError: the server died while sending its answer (a SIGKILLed real
            # server mid-response, seen in tests/test_rollout_sglang_real_server.py)
            raise ServerUnavailable(f"{self.address}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (401, 403):
            raise ServerAuthError(self.address, path, resp.status_code, token is not None)
        if resp.status_code >= 500 and resp.status_code not in answers:
            raise ServerUnavailable(f"{self.address}{path}: HTTP {resp.status_code} {resp.text[:200]}")
        return resp

    def _refused(self, path: str, resp: requests.Response) -> api.ServerRefused:
        return api.ServerRefused(self.address, path,
                                 f"HTTP {resp.status_code}: {api.error_message(_json_or_text(resp))}")

    def _control(self, path: str, body: Optional[Dict[str, Any]], method: str = "POST",
                 timeout_s: Optional[float] = None) -> Any:
        """A control call: 200 or raise ServerRefused (4xx or ``success: false``)."""
        resp = self.request(method, path, body, timeout_s or self.control_timeout_s)
        data = _json_or_text(resp)
        if isinstance(data, dict) and data.get("success") is False:
            raise api.ServerRefused(self.address, path, str(data.get("message", "")))
        if resp.status_code != 200:
            raise self._refused(path, resp)
        return data

    # --- generation -------------------------------------------------------------------------
    def generate(self, payload: Dict[str, Any], timeout_s: Optional[float] = None) -> api.GenerateResult:
        resp = self.request("POST", api.GENERATE, payload, timeout_s)
        if resp.status_code != 200:
            raise self._refused(api.GENERATE, resp)
        data = _json_or_text(resp)
        if not isinstance(data, dict):
            raise api.ProtocolError(f"{self.address}{api.GENERATE}: non-JSON body {str(data)[:200]!r}")
        return api.parse_generate_response(data)

    def prefill(self, payload: Dict[str, Any], timeout_s: Optional[float] = None) -> None:
        """Send an :func:`api.prefill_payload`; 200 or raise (:class:`api.ServerRefused` on 4xx)."""
        resp = self.request("POST", api.GENERATE, payload, timeout_s)
        if resp.status_code != 200:
            raise self._refused(api.GENERATE, resp)

    def health(self, timeout_s: float = 30.0) -> bool:
        """``/health_generate``: the server generated a token (or is generating) within the timeout."""
        try:
            return self.request("GET", api.HEALTH_GENERATE, timeout_s=timeout_s).status_code == 200
        except ServerUnavailable:
            return False

    def ready(self, timeout_s: float = 10.0) -> bool:
        """``/ready``: 200 while the server takes new requests, 503 while generation is paused
        (tokenizer_manager.is_ready: ``not is_pause``); generates nothing. An unreachable
        server raises :class:`ServerUnavailable`."""
        resp = self.request("GET", api.READY, timeout_s=timeout_s, answers=(503,))
        if resp.status_code not in (200, 503):
            raise self._refused(api.READY, resp)
        return resp.status_code == 200

    def model_info(self, timeout_s: float = 10.0) -> Dict[str, Any]:
        """``/model_info`` (``/get_model_info`` is deprecated in 0.5.23); answers while paused."""
        resp = self.request("GET", api.MODEL_INFO, timeout_s=timeout_s)
        if resp.status_code != 200:
            raise self._refused(api.MODEL_INFO, resp)
        return resp.json()

    def server_info(self, timeout_s: float = 30.0) -> Dict[str, Any]:
        resp = self.request("GET", api.SERVER_INFO, timeout_s=timeout_s)
        if resp.status_code != 200:
            raise self._refused(api.SERVER_INFO, resp)
        return resp.json()

    # --- generation control -----------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        self._control(api.PAUSE, api.pause_payload(mode))

    def continue_generation(self, timeout_s: Optional[float] = None) -> None:
        self._control(api.CONTINUE, {}, timeout_s=timeout_s)

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False,
                      timeout_s: Optional[float] = None) -> None:
        resp = self.request("POST", api.ABORT, api.abort_payload(rid, abort_all), timeout_s)
        if resp.status_code != 200:
            raise self._refused(api.ABORT, resp)

    def flush_cache(self, timeout_s: Optional[float] = None) -> None:
        """Refused (400, text body) while requests run or wait (scheduler.flush_cache)."""
        self._control(api.FLUSH_CACHE, None, timeout_s=timeout_s)

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        self._control(api.RELEASE_MEMORY, api.memory_payload(tags))

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        self._control(api.RESUME_MEMORY, api.memory_payload(tags))

    # --- weights ----------------------------------------------------------------------------
    def begin_weight_update(self) -> str:
        return str(self._control(api.BEGIN_UPDATE, {}).get("message", ""))

    def end_weight_update(self, timeout_s: Optional[float] = None) -> str:
        return str(self._control(api.END_UPDATE, {}, timeout_s=timeout_s).get("message", ""))

    def init_weights_update_group(self, payload: Dict[str, Any]) -> str:
        return str(self._control(api.INIT_GROUP, payload).get("message", ""))

    def destroy_weights_update_group(self, group_name: str = api.DEFAULT_GROUP_NAME,
                                     timeout_s: Optional[float] = None) -> str:
        """Refused (``success: false``) when the server holds no group of that name."""
        return str(self._control(api.DESTROY_GROUP, {"group_name": group_name},
                                 timeout_s=timeout_s).get("message", ""))

    def update_weights_from_distributed(self, payload: Dict[str, Any]) -> str:
        return str(self._control(api.UPDATE_FROM_DISTRIBUTED, payload).get("message", ""))

    def update_weights_from_tensor(self, payload: Dict[str, Any]) -> str:
        return str(self._control(api.UPDATE_FROM_TENSOR, payload).get("message", ""))

    def update_weights_from_disk(self, payload: Dict[str, Any]) -> str:
        return str(self._control(api.UPDATE_FROM_DISK, payload).get("message", ""))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> List[float]:
        resp = self.request("POST", api.GET_WEIGHTS_BY_NAME,
                            {"name": name, "truncate_size": truncate_size})
        if resp.status_code != 200:
            raise self._refused(api.GET_WEIGHTS_BY_NAME, resp)
        return resp.json()
