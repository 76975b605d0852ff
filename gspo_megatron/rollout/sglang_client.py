"""HTTP client of one SGLang server (or reference server): one method per endpoint we use.

Thread-safe (one ``requests.Session`` per thread). Transport failures (connection refused or
reset, timeouts, HTTP 5xx) raise :class:`ServerUnavailable` so that callers can retry on
another server; a 4xx or a body outside the schema raises at once (retrying would not help).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Optional

import requests

from gspo_megatron.rollout import sglang_api as api

log = logging.getLogger(__name__)


class ServerUnavailable(RuntimeError):
    """The server did not answer in time, or answered 5xx: try another one."""


class SGLangServerClient:
    """Calls on ``http://host:port`` with a per-call timeout."""

    def __init__(self, address: str, timeout_s: float = 600.0) -> None:
        if "://" in address:
            address = address.split("://", 1)[1]
        if ":" not in address:
            raise ValueError(f"server address {address!r} must be host:port")
        self.address = address.rstrip("/")
        self.base_url = f"http://{self.address}"
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def request(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
                timeout_s: Optional[float] = None) -> requests.Response:
        try:
            resp = self._session().request(method, self.base_url + path, json=body,
                                           timeout=timeout_s or self.timeout_s)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise ServerUnavailable(f"{self.address}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise ServerUnavailable(f"{self.address}{path}: HTTP {resp.status_code} {resp.text[:200]}")
        return resp

    def post_json(self, path: str, body: Dict[str, Any], timeout_s: Optional[float] = None) -> Any:
        resp = self.request("POST", path, body, timeout_s)
        try:
            data = resp.json()
        except ValueError as exc:
            raise api.ProtocolError(f"{self.address}{path}: HTTP {resp.status_code}, "
                                    f"non-JSON body {resp.text[:200]!r}") from exc
        if resp.status_code >= 400 and not (isinstance(data, dict) and "success" in data):
            raise RuntimeError(f"{self.address}{path}: HTTP {resp.status_code}: {str(data)[:300]}")
        return data

    # --- endpoints --------------------------------------------------------------------------
    def generate(self, payload: Dict[str, Any], timeout_s: Optional[float] = None) -> api.GenerateResult:
        return api.parse_generate_response(self.post_json(api.GENERATE, payload, timeout_s))

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return self.request("GET", api.HEALTH, timeout_s=timeout_s).status_code == 200
        except ServerUnavailable:
            return False

    def model_info(self) -> Dict[str, Any]:
        return self.request("GET", api.MODEL_INFO).json()

    def flush_cache(self) -> None:
        resp = self.request("POST", api.FLUSH_CACHE)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.address}{api.FLUSH_CACHE}: HTTP {resp.status_code} {resp.text[:200]}")

    def release_memory(self, tags: Optional[List[str]] = None) -> None:
        self._admin_no_body(api.RELEASE_MEMORY, {"tags": tags} if tags else {})

    def resume_memory(self, tags: Optional[List[str]] = None) -> None:
        self._admin_no_body(api.RESUME_MEMORY, {"tags": tags} if tags else {})

    def _admin_no_body(self, path: str, body: Dict[str, Any]) -> None:
        resp = self.request("POST", path, body)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.address}{path}: HTTP {resp.status_code} {resp.text[:200]}")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> List[float]:
        return self.post_json(api.GET_WEIGHTS_BY_NAME, {"name": name, "truncate_size": truncate_size})

    def init_weights_update_group(self, payload: Dict[str, Any]) -> str:
        return api.check_success(api.INIT_GROUP, self.post_json(api.INIT_GROUP, payload))

    def destroy_weights_update_group(self, group_name: str = api.DEFAULT_GROUP_NAME) -> str:
        return api.check_success(api.DESTROY_GROUP,
                                 self.post_json(api.DESTROY_GROUP, {"group_name": group_name}))

    def update_weights_from_distributed(self, payload: Dict[str, Any]) -> str:
        return api.check_success(api.UPDATE_FROM_DISTRIBUTED,
                                 self.post_json(api.UPDATE_FROM_DISTRIBUTED, payload))

    def update_weights_from_disk(self, payload: Dict[str, Any]) -> str:
        return api.check_success(api.UPDATE_FROM_DISK, self.post_json(api.UPDATE_FROM_DISK, payload))

    def update_weights_from_tensor(self, payload: Dict[str, Any]) -> str:
        return api.check_success(api.UPDATE_FROM_TENSOR,
                                 self.post_json(api.UPDATE_FROM_TENSOR, payload))
