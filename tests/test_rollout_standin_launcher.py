"""Tests of the stand-in's fleet: its command line and ports (rollout/standin/launcher.py)."""

from gspo_megatron.config.schema import SGLangConfig
from gspo_megatron.rollout.sglang.launcher import ServerLauncher
from gspo_megatron.rollout.standin.launcher import launch_reference_fleet, reference_server_command


def test_reference_command():
    cmd = reference_server_command("/m", 123, extra=["--delay-s", "1"], python="py")
    assert cmd == ["py", "-m", "gspo_megatron.rollout.standin.server", "--model-path", "/m",
                   "--host", "127.0.0.1", "--port", "123", "--delay-s", "1"]
    saver = reference_server_command("/m", 1, python="py", enable_memory_saver=True)
    assert "--enable-memory-saver" in saver  # colocated mode releases memory (SGLang's flag)


def test_reference_fleet_ports_and_flags(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(ServerLauncher, "start", lambda self, cmd, addr: started.append((cmd, addr)))
    launch_reference_fleet(SGLangConfig(num_servers=2, port=4000), "/m", enable_memory_saver=True)
    assert [a for _, a in started] == ["127.0.0.1:4000", "127.0.0.1:4001"]
    assert all("--enable-memory-saver" in c for c, _ in started)
