"""Per-job rollout server keys (rollout/sglang/server_keys.py): the file, the levels, and both servers.

Against the reference server (in-process) and the real SGLang 0.5.23 server on CPU (started
through ``rollout/sglang/keyed_launch.py``): requests without the key or with a wrong one to
``/generate``, ``/update_weights_from_disk``, ``/init_weights_update_group`` and
``/pause_generation`` are refused, ``/health`` answers, and our client with the keys works while
one without them gets one clear error naming the server, not retried. The keys appear in no
command line of the server's processes and not in its log.
"""

import ast
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import ServerAuthError, SGLangServerClient
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.rollout.sglang.server_keys import (ADMIN_PATHS, KeyFileError, ServerKeys, ensure_keys,
                                               new_keys, read_keys, write_keys)
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from tests.real_sglang import SGLANG_PYTHON, RealServer, listening_pids

REPO = Path(__file__).resolve().parent.parent

PROBED = [("POST", api.GENERATE), ("POST", api.UPDATE_FROM_DISK), ("POST", api.INIT_GROUP),
          ("POST", api.PAUSE)]


def test_keys_file_is_0600_whatever_the_umask_and_refused_when_others_can_read(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "secrets" / "keys.json"
        keys = ensure_keys(str(path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ensure_keys(str(path)) == keys  # a resumed job keeps its keys
    assert len(keys.api_key) >= 40 and keys.api_key != keys.admin_api_key
    assert new_keys() != new_keys()
    assert keys.api_key not in repr(keys) and keys.admin_api_key not in str(keys)
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match=rf"{path}.*chmod 600"):
        read_keys(str(path))
    bad = tmp_path / "bad.json"
    write_keys(str(bad), keys)
    bad.write_text('{"api_key": "x"}')
    with pytest.raises(KeyFileError, match="bad.json"):
        read_keys(str(bad))
    with pytest.raises(FileExistsError):  # never overwrites a file
        write_keys(str(bad), keys)


def test_a_crash_while_writing_leaves_no_key_file_and_an_empty_one_is_replaced(tmp_path, monkeypatch,
                                                                               caplog):
    """Issue 41: the keys appear whole or not at all; an empty or cut-short file (an older
    writer's crash) does not brick later launches, but a user's malformed file is still refused."""
    path = tmp_path / "secrets" / "keys.json"

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", crash)
    with pytest.raises(OSError, match="No space"):
        ensure_keys(str(path))
    monkeypatch.undo()
    assert not path.exists()  # never a half-written key file
    keys = ensure_keys(str(path))
    assert read_keys(str(path)) == keys
    for leftover in ("", '{"api_key": "abc'):
        path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, leftover.encode())
        os.close(fd)
        with pytest.raises(KeyFileError, match="keys.json"):
            read_keys(str(path))  # what a server reads: still refused, the launcher repairs
        caplog.clear()
        repaired = ensure_keys(str(path))
        assert repaired.api_key and repaired != keys and read_keys(str(path)) == repaired
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert "holds no keys" in caplog.text
    path.write_text('{"api_key": "x"}')  # valid JSON without the admin key: the user's, refused
    with pytest.raises(KeyFileError, match="KeyError"):
        ensure_keys(str(path))
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == ["keys.json"]


def test_the_keyed_launcher_names_a_key_file_this_node_does_not_see(tmp_path):
    """Across nodes without a shared filesystem the file is missing: one line, no traceback."""
    missing = tmp_path / "not_shared" / "keys.json"
    proc = subprocess.run([sys.executable, str(REPO / "gspo_megatron/rollout/sglang/keyed_launch.py"),
                           str(missing), "--port", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert str(missing) in proc.stderr and "share" in proc.stderr and "Traceback" not in proc.stderr


def _doc_key_recipe() -> str:
    text = (REPO / "docs" / "cluster.md").read_text()
    block = re.search(r"<!-- key recipe: begin.*?```bash\n(.*?)```", text, re.S)
    assert block, "docs/cluster.md lost its key recipe"
    return block.group(1)


def test_each_path_gets_the_key_sglang_wants():
    keys = ServerKeys("user", "admin")
    assert keys.for_path(api.GENERATE) == "user" and keys.for_path(api.SERVER_INFO) == "user"
    assert keys.for_path(api.PAUSE) == "admin" and keys.for_path(api.UPDATE_FROM_DISTRIBUTED) == "admin"
    assert keys.for_path(api.FLUSH_CACHE + "?timeout=1") == "admin"
    assert keys.for_path(api.HEALTH_GENERATE) is None and keys.for_path("/health") is None


def _admin_optional_routes(source: str) -> set:
    """Routes of functions decorated ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` in SGLang's
    http_server.py (parsed, not imported)."""
    routes = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if "auth_level(AuthLevel.ADMIN_OPTIONAL)" not in decorators:
            continue
        for d in node.decorator_list:
            if isinstance(d, ast.Call) and getattr(d.func, "attr", "") in ("get", "post", "api_route", "put"):
                if d.args and isinstance(d.args[0], ast.Constant):
                    routes.add(d.args[0].value)
    return routes


def test_admin_paths_match_the_installed_sglang_source():
    """Our admin list is exactly SGLang 0.5.23's ADMIN_OPTIONAL routes among those we call."""
    # Where the server virtualenv's sglang is, without importing it (that takes ~6 CPU-seconds)
    where = subprocess.run([SGLANG_PYTHON, "-c", "import importlib.util, os; print(os.path.dirname("
                            "importlib.util.find_spec('sglang').origin))"], capture_output=True,
                           text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    source = Path(where.stdout.strip(), "srt", "entrypoints", "http_server.py").read_text()
    admin = _admin_optional_routes(source)
    ours = {v for k, v in vars(api).items() if k.isupper() and isinstance(v, str) and v.startswith("/")}
    assert ours & admin == ADMIN_PATHS, (sorted(ours & admin ^ ADMIN_PATHS))


def _status(address, method, path, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.request(method, f"http://{address}{path}", json={}, headers=headers, timeout=30).status_code


def _check_refusals_and_probes(address, keys):
    for method, path in PROBED:
        assert _status(address, method, path) == 401, path
        assert _status(address, method, path, "wrong") == 401, path
    assert _status(address, "POST", api.PAUSE, keys.api_key) == 401  # the ordinary key is not admin
    assert _status(address, "GET", "/health") == 200
    assert _status(address, "GET", api.SERVER_INFO, keys.api_key) == 200


def _check_clients(address, keys):
    _, tok = build_tiny_policy(seed=0)
    requests_ = [GenerationRequest("p", tok("abc")["input_ids"], n=2)]
    with_keys = SGLangEngine([address], request_timeout_s=60, max_retries=3)
    for s in with_keys.pool.servers:
        s.client.keys = keys
    samples = with_keys.generate(requests_, SamplingParams(max_new_tokens=4, seed=1))
    assert len(samples) == 2
    with_keys.control.pause_and_abort()  # admin endpoints with the admin key
    with_keys.control._continue()
    client = SGLangServerClient(address, 60, 60, keys=None)
    with pytest.raises(ServerAuthError, match=rf"{address}.*no key was sent"):
        client.server_info()
    wrong = SGLangServerClient(address, 60, 60, keys=ServerKeys("a", "b"))
    with pytest.raises(ServerAuthError, match="key sent is wrong"):
        wrong.pause_generation()
    engine = SGLangEngine([address], request_timeout_s=60, max_retries=3)
    for s in engine.pool.servers:
        s.client.keys = None
    t0 = time.monotonic()
    with pytest.raises(ServerAuthError):  # not retried: the same key would be refused again
        engine.generate(requests_, SamplingParams(max_new_tokens=4, seed=1))
    assert time.monotonic() - t0 < 10 and engine._num_retries == 0


def test_the_reference_server_enforces_sglangs_levels(tmp_path):
    from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
    from gspo_megatron.rollout.standin.server import ReferenceServer

    key_file = tmp_path / "run" / "secrets" / "rollout_server_keys.json"
    keys = ensure_keys(str(key_file))
    server = ReferenceServer(EmbeddedEngine(*build_tiny_policy(seed=0)), keys=keys).start()
    try:
        _check_refusals_and_probes(server.address, keys)
        _check_clients(server.address, keys)
        # docs/cluster.md's inspection recipe works, and no word of it expands to a key
        recipe = _doc_key_recipe()
        assert "$(" not in recipe and "`" not in recipe
        node, port = server.address.split(":")
        command = (recipe.replace("RUN/", f"{tmp_path / 'run'}/").replace("NODE", node)
                   .replace("PORT", port))
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "model_path" in json.loads(out.stdout), out.stderr
    finally:
        server.stop()


@pytest.mark.slow  # a real server start (~30 CPU-seconds): not part of `make test-fast`
def test_the_real_server_takes_only_the_jobs_keys(tmp_path):
    save_tiny_model(*build_tiny_policy(seed=0), tmp_path / "model")
    key_file = tmp_path / "secrets" / "keys.json"
    keys = ensure_keys(str(key_file))
    server = RealServer(str(tmp_path / "model"), tmp_path / "server.log", key_file=str(key_file))
    assert keys.api_key not in " ".join(server.command)
    server.start()
    try:
        _check_refusals_and_probes(server.address, keys)
        _check_clients(server.address, keys)
        root = psutil.Process(server.process.pid)
        for proc in [root, *root.children(recursive=True)]:
            cmdline = " ".join(proc.cmdline())
            assert keys.api_key not in cmdline and keys.admin_api_key not in cmdline, proc.pid
        # the leak check of the trainer tests finds a keyed-launched server while it runs
        assert listening_pids(server.port) == [server.process.pid]
        # its /dev/shm file is its own; another server's, made meanwhile, is not (and survives)
        decoy = Path(f"/dev/shm/sglang_loads_decoy_{os.getpid()}_{server.port}.shm")
        decoy.touch()
        own = server.new_shm_files()
        assert len(own) == 1 and str(decoy) not in own
    finally:
        server.stop()
    assert listening_pids(server.port) == []
    assert decoy.exists() and not any(os.path.exists(p) for p in own)
    decoy.unlink()
    text = server.log_path.read_text()
    assert "Uvicorn running" in text and "'api_key': '<redacted>'" in text
    assert keys.api_key not in text and keys.admin_api_key not in text
