"""Tests of rollout server command lines and process ownership (rollout/sglang/launcher.py)."""

import json
import re
import sys
import time

import pytest

from gspo_megatron.config.schema import SGLangConfig
from gspo_megatron.rollout.sglang.launcher import ServerLauncher, sglang_server_command
from tests.ahead import Command


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_sglang_command_maps_the_config():
    cfg = SGLangConfig(num_servers=4, port=31000, tp=4, dp=2, ep=8, mem_fraction_static=0.6)
    cmd = sglang_server_command(cfg, "/ckpt", index=1, host="0.0.0.0", enable_memory_saver=True,
                                deterministic=True, python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == "/ckpt" and _flag(cmd, "--host") == "0.0.0.0"
    assert _flag(cmd, "--port") == "31001"
    assert (_flag(cmd, "--tp-size"), _flag(cmd, "--dp-size"), _flag(cmd, "--ep-size")) == ("4", "2", "8")
    assert _flag(cmd, "--mem-fraction-static") == "0.6"
    assert _flag(cmd, "--base-gpu-id") == "8"  # server 1 of tp4 x dp2 starts on GPU 8
    assert "--enable-memory-saver" in cmd and "--enable-deterministic-inference" in cmd
    plain = sglang_server_command(SGLangConfig(), "/ckpt", 0)
    assert "--enable-memory-saver" not in plain and _flag(plain, "--port") == "30000"
    # CPU servers have no GPU to start from: SGLang derives their threads' NUMA node from this id
    # and asserts it below the host's node count, so a second server with id 1 died at start-up
    cpu = sglang_server_command(SGLangConfig(tp=1, device="cpu", port=31000), "/ckpt", index=1)
    assert _flag(cpu, "--base-gpu-id") == "0" and _flag(cpu, "--port") == "31001"


def test_launcher_stops_only_its_own_processes(tmp_path):
    launcher = ServerLauncher(str(tmp_path))
    a = launcher.start([sys.executable, "-c", "import time; time.sleep(60)"], "127.0.0.1:1")
    b = launcher.start([sys.executable, "-c", "import signal, time; "
                        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                        "time.sleep(60)"], "127.0.0.1:2")
    for _ in range(300):  # bounded wait until the SIGTERM handler is installed
        if "ready" in (tmp_path / "server_127.0.0.1_2.log").read_text():
            break
        time.sleep(0.1)
    assert launcher.addresses == ["127.0.0.1:1", "127.0.0.1:2"]
    launcher.stop(grace_s=2.0)
    assert a.process.returncode is not None and b.process.returncode is not None
    assert b.process.returncode == -9  # ignored SIGTERM, was killed
    assert (tmp_path / "server_127.0.0.1_1.log").exists() and launcher.servers == []


def test_cpu_engine_dtype_and_keyed_launch(tmp_path):
    """device=cpu: SGLang's CPU engine flags and switch; --dtype: the checkpoint's own unless
    the config says (SGLang's auto would serve float32 as float16); a key file: the keyed
    launcher, with only the file's path on the line."""
    from gspo_megatron.rollout.sglang.launcher import (KEYED_LAUNCH, CPU_ENGINE_ARGS,
                                                       checkpoint_dtype, sglang_server_env)

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"torch_dtype": "float32"}')
    checkpoint_dtype.cache_clear()
    cfg = SGLangConfig(device="cpu", max_total_tokens=4096)
    cmd = sglang_server_command(cfg, str(model), 0, python="py", key_file="/run/secrets/k.json")
    assert cmd[:3] == ["py", KEYED_LAUNCH, "/run/secrets/k.json"] and KEYED_LAUNCH.endswith(
        "gspo_megatron/rollout/sglang/keyed_launch.py")
    assert _flag(cmd, "--dtype") == "float32" and _flag(cmd, "--max-total-tokens") == "4096"
    assert cmd[-len(CPU_ENGINE_ARGS):] == CPU_ENGINE_ARGS and "--api-key" not in cmd
    assert sglang_server_env(cfg) == {"SGLANG_USE_CPU_ENGINE": "1"}
    gpu = sglang_server_command(SGLangConfig(dtype="bfloat16"), str(model), 0, python="py")
    assert gpu[1:3] == ["-m", "sglang.launch_server"] and _flag(gpu, "--dtype") == "bfloat16"
    assert "--device" not in gpu and sglang_server_env(SGLangConfig()) == {}
    unreadable = sglang_server_command(SGLangConfig(), str(tmp_path / "nowhere"), 0, python="py")
    assert "--dtype" not in unreadable  # SGLang decides; a warning says so


PORT_TAKEN = """
import json, socket, sys, time
from pathlib import Path
from gspo_megatron.config.schema import SGLangConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.tiny_task.assets import make_tiny_assets
from gspo_megatron.tiny_task.task import AdditionTaskConfig
from tests.real_sglang import SGLANG_PYTHON

out = Path(sys.argv[1])
assets = make_tiny_assets(out / "assets", task=AdditionTaskConfig(num_train=8, num_eval=2))
holder = socket.socket()
holder.bind(("127.0.0.1", 0))
holder.listen()
port = holder.getsockname()[1]
cfg = SGLangConfig(device="cpu", python=str(SGLANG_PYTHON), port=port, max_total_tokens=4096,
                   health_timeout_s=600)
t0 = time.monotonic()
try:
    SGLangEngine.from_config(cfg, str(assets.model_dir), log_dir=str(out / "logs"))
    error = None
except RuntimeError as exc:
    error = str(exc)
finally:
    holder.close()
print(json.dumps({"port": port, "error": error, "seconds": time.monotonic() - t0}))
"""
AHEAD = {"test_a_real_server_whose_port_is_taken_fails_the_start_naming_it": Command(
    ["{python}", "-c", PORT_TAKEN, "{dir}"], early=True, foreground_priority=True, timeout_s=900,
    min_available_gib=5.0)}
"""The start (a real server, ~35 CPU-seconds) in the background while the first tests of the
session run (``tests/ahead.py``), at the foreground's priority: its time is checked."""


@pytest.mark.slow
def test_a_real_server_whose_port_is_taken_fails_the_start_naming_it(ahead):
    """SGLang 0.5.23 logs the bind failure and keeps running (its scheduler holds the process),
    so waiting for health would poll the port's other owner until the start-up deadline: the
    engine reads the server's log and stops at once, naming the port."""
    assert ahead.returncode == 0, ahead.stderr[-3000:]
    got = json.loads(ahead.stdout.strip().splitlines()[-1])
    assert got["error"] and re.search(rf"could not listen on their ports .*127.0.0.1:{got['port']}",
                                      got["error"]), got
    assert got["seconds"] < 300  # well before the 600 s deadline
