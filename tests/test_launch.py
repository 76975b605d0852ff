"""gspo_megatron/launch: host lists, container mounts, the launch plan, its CLI and server tasks.

The shell side (slurm/train_job.sh running this plan, and its dry run) is tested in
tests/test_slurm_scripts.py; here the plan itself, without bash or Slurm.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.launch.__main__ import main as launch_main
from gspo_megatron.launch.hostlist import expand_hostlist
from gspo_megatron.launch.mounts import container_mounts, mounts_spec, parse_user_mounts
from gspo_megatron.launch.plan import JobSettings, Node, build_plan

REPO = Path(__file__).resolve().parent.parent
PROD = "configs/qwen3_30b_a3b_gspo.yaml"
NODES = [Node(f"n{i}", f"10.0.0.{i}") for i in range(1, 5)]


@pytest.mark.parametrize("text, hosts", [
    ("n[1-3],m", ["n1", "n2", "n3", "m"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("a[1,3-4]b,c", ["a1b", "a3b", "a4b", "c"]),
    ("single", ["single"]),
])
def test_host_lists_expand_like_scontrol(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, message", [("n[1-2", "unbalanced"), ("n[a-b]", "bad range"),
                                           ("n[1-2]x[1-2]", "one bracket group"), ("n1,n1", "twice")])
def test_bad_host_lists_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        expand_hostlist(text)


def test_mounts_come_from_the_config_paths_nested_ones_dropped():
    cfg = load_config(PROD, ["logging.run_dir=/scratch/runs/r1", "checkpoint.load_dir=/scratch/runs/r1/converted",
                             "data.eval_path=/data/math/test.jsonl", "rollout.weight_sync.disk_dir=sync"])
    mounts = container_mounts(cfg, "/src/gspo", parse_user_mounts("/opt/cache:/cache:ro"))
    assert [(m.source, m.origin) for m in mounts] == [
        ("/src/gspo", "repository"), ("/scratch/runs/r1", "logging.run_dir"),
        ("/models/Qwen3-30B-A3B", "model.hf_path"), ("/data/math", "data.train_path"),
        ("/opt/cache", "GSPO_CONTAINER_MOUNTS")]
    assert mounts_spec(mounts).endswith(",/data/math:/data/math,/opt/cache:/cache:ro")


def test_relative_paths_are_under_the_repository_and_user_mounts_replace_ours():
    cfg = load_config("configs/tiny_cpu.yaml", ["model.hf_path=../assets/model"])
    mounts = container_mounts(cfg, "/src/gspo", parse_user_mounts("/src/assets/model:/m"))
    assert [m.spec() for m in mounts] == ["/src/gspo:/src/gspo", "/src/assets/model:/m"]
    with pytest.raises(ValueError, match="expected /SRC"):
        parse_user_mounts("relative/path")


def test_a_custom_key_file_is_mounted_with_its_folder():
    """Issue 41: servers and learners read ``rollout.sglang.key_file`` inside the container."""
    cfg = load_config(PROD, ["logging.run_dir=/scratch/runs/r1",
                             "rollout.sglang.key_file=/secure/job9/keys.json"])
    mounts = container_mounts(cfg, "/src/gspo")
    assert ("/secure/job9", "rollout.sglang.key_file") in [(m.source, m.origin) for m in mounts]
    inside = load_config(PROD, ["logging.run_dir=/scratch/runs/r1",
                                "rollout.sglang.key_file=/scratch/runs/r1/secrets/k.json"])
    assert "rollout.sglang.key_file" not in [m.origin for m in container_mounts(inside, "/src/gspo")]


def job(**kw) -> JobSettings:
    return JobSettings(repo="/src/gspo", config_path=PROD, python="/usr/bin/python3", job_id="9",
                       cpus_per_node=96, **kw)


def test_four_node_plan_places_learners_and_servers():
    overrides = ["launch.num_nodes=4"]
    cfg = load_config(PROD, overrides)
    plan = build_plan(cfg, NODES, job(), overrides)
    assert [n.name for n in plan.learner_nodes] == ["n1", "n2"] and [n.name for n in plan.rollout_nodes] == ["n3", "n4"]
    assert [s.address for s in plan.servers] == ["10.0.0.3:30000", "10.0.0.3:30001", "10.0.0.4:30000", "10.0.0.4:30001"]
    server = plan.servers[1]
    assert (server.name, server.node, server.local_id, server.devices) == ("server1", "n3", 1, [4, 5, 6, 7])
    assert [s.name for s in plan.servers] == ["server0", "server1", "server2", "server3"]
    assert server.probe_url == "http://10.0.0.3:30001/health_generate"
    # the keyed launcher reads the job's keys from a file in the run directory: only its path
    # is on the line (docs/cluster.md, "Who can reach the job's servers")
    key_file = os.path.join(cfg.logging.run_dir if os.path.isabs(cfg.logging.run_dir) else
                            os.path.join("/src/gspo", cfg.logging.run_dir),
                            "secrets", "rollout_server_keys.json")
    assert server.argv[:3] == ["/usr/bin/python3",
                               "/src/gspo/gspo_megatron/rollout/sglang/keyed_launch.py",
                               key_file]
    flags = dict(zip(server.argv[3::2], server.argv[4::2]))
    assert flags["--tp-size"] == "4" and flags["--port"] == "30001" and flags["--base-gpu-id"] == "4"
    assert flags["--host"] == "10.0.0.3"  # its node's address, not every interface
    assert "--enable-memory-saver" not in server.argv  # only colocated servers release memory
    assert plan.learner_argv[:10] == [
        "/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8",
        "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29509", "--rdzv-id=9-r0", "--max-restarts=0",
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"]  # a preemption's SIGTERM is the trainer's
    assert plan.learner_argv[-3:] == ["launch.num_nodes=4", "rollout.sglang.server_addresses=[10.0.0.3:30000,"
                                      "10.0.0.3:30001,10.0.0.4:30000,10.0.0.4:30001]",
                                      f"rollout.sglang.key_file={key_file}"]
    # one step per server (its node added by slurm/fleet.sh): one server's exit ends no other
    assert plan.server_srun == ["--nodes=1", "--ntasks=1", "--cpus-per-task=48"]
    assert plan.update_group_size(cfg) == 17 and plan.learner_world_size == 16


def test_colocated_servers_share_every_node_and_release_memory():
    overrides = ["launch.num_nodes=2", "rollout.mode=colocated", "launch.num_learner_nodes=null",
                 "rollout.weight_sync.transport=nccl"]  # tensor handles: one node only
    cfg = load_config(PROD, overrides)
    plan = build_plan(cfg, NODES[:2], job(), overrides)
    assert [n.name for n in plan.learner_nodes] == [n.name for n in plan.rollout_nodes] == ["n1", "n2"]
    assert all("--enable-memory-saver" in s.argv for s in plan.servers) and len(plan.servers) == 4


def test_r3_servers_capture_routed_experts_and_others_do_not():
    plain = build_plan(load_config(PROD, ["launch.num_nodes=4"]), NODES, job(), [])
    assert not any("--enable-return-routed-experts" in s.argv for s in plain.servers)
    overrides = ["launch.num_nodes=4", "algo.routing_replay=rollout"]
    plan = build_plan(load_config(PROD, overrides), NODES, job(), overrides)
    assert all("--enable-return-routed-experts" in s.argv for s in plan.servers)
    assert len(plan.servers) == 4


def test_extra_server_flags_may_not_restate_the_fleet():
    cfg = load_config(PROD, ["launch.num_nodes=4"])
    with pytest.raises(ValueError, match="may not set --tp-size"):
        build_plan(cfg, NODES, job(sglang_extra_args=["--tp-size", "8"]))
    plan = build_plan(cfg, NODES, job(sglang_extra_args=["--chunked-prefill-size", "8192"]))
    assert plan.servers[0].argv[-2:] == ["--chunked-prefill-size", "8192"]


def run_cli(tmp_path, *args):
    out_sh, out_json = tmp_path / "plan.sh", tmp_path / "plan.json"
    code = launch_main(["--repo", str(REPO), "--out-sh", str(out_sh), "--out-json", str(out_json), *args])
    return code, out_sh, out_json


def test_cli_writes_a_plan_bash_can_source(tmp_path):
    code, out_sh, out_json = run_cli(tmp_path, "--config", PROD, "--nodelist", "n[1-4]", "--python", "py",
                                     "--job-id", "9", "--", "trainer.num_steps=3")
    assert code == 0
    shown = subprocess.run(["bash", "-c", f'source {out_sh}; echo "${{GSPO_SERVER_SRUN[*]}}|'
                            '${GSPO_LEARNER_ARGV[-2]}|${#GSPO_HEALTH_URLS[@]}|$GSPO_HEALTH_TIMEOUT_S|'
                            '${GSPO_SERVER_NAMES[*]}|${GSPO_SERVER_NODES[*]}|${GSPO_PROBE_URLS[3]}|'
                            '$GSPO_SERVER_RESTARTS_PER_HOUR|$GSPO_SERVER_HANG_TIMEOUT_S"'],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert shown == ("--nodes=1 --ntasks=1 --cpus-per-task=1|"
                     "rollout.sglang.server_addresses=[n3:30000,n3:30001,n4:30000,n4:30001]|4|900|"
                     "server0 server1 server2 server3|n3 n3 n4 n4|http://n4:30001/health_generate|3|300")
    record = json.loads(out_json.read_text())
    assert record["servers"][3]["address"] == "n4:30001" and "trainer.num_steps=3" in record["learner_argv"]


def test_cli_makes_the_servers_keys_only_when_asked_and_shows_only_their_path(tmp_path):
    run_dir = tmp_path / "run"
    args = ("--config", PROD, "--nodelist", "n[1-4]", "--python", "py", "--", f"logging.run_dir={run_dir}")
    code, _, _ = run_cli(tmp_path, *args)  # what a dry run does: no secret is made
    key_file = run_dir / "secrets" / "rollout_server_keys.json"
    assert code == 0 and not key_file.exists()
    code, out_sh, out_json = run_cli(tmp_path, "--make-keys", *args)
    assert code == 0 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    keys = json.loads(key_file.read_text())
    for text in (out_sh.read_text(), out_json.read_text()):
        assert str(key_file) in text
        assert keys["api_key"] not in text and keys["admin_api_key"] not in text
    assert run_cli(tmp_path, "--make-keys", *args)[0] == 0 and json.loads(key_file.read_text()) == keys
    key_file.chmod(0o640)  # readable by the group: refused, naming the file
    assert run_cli(tmp_path, "--make-keys", *args)[0] == 2


def test_cli_fills_in_the_world_size_the_config_leaves_open(tmp_path):
    code, _, out_json = run_cli(tmp_path, "--config", "configs/tiny_cpu.yaml", "--nodelist", "node[1-2]", "--",
                                "launch.devices_per_node=1", "rollout.engine=reference",
                                "rollout.weight_sync.transport=nccl", "rollout.mode=disaggregated",
                                "launch.num_learner_nodes=1")
    assert code == 0
    argv = json.loads(out_json.read_text())["learner_argv"]
    assert "parallel.world_size=1" in argv and "--nproc-per-node=1" in argv
    assert argv[-2] == "rollout.sglang.server_addresses=[node2:30000]"
    assert argv[-1].startswith("rollout.sglang.key_file=")


@pytest.mark.parametrize("args, message", [
    (["--nodelist", "n[1-5]"], "set num_servers=6"),
    (["--nodelist", "n[1-4]", "--devices-on-node", "4"], "launch.devices_per_node: 8, but the job has 4 GPUs"),
    ([], "no nodes"),
    (["--node", "n1"], "expected NAME=ADDR"),
    (["--nodelist", "n[1-4]", "--", "model.hf_path=null"], "model.hf_path: the rollout servers load it"),
])
def test_cli_refusals_exit_2_with_the_reason(tmp_path, capsys, args, message):
    code, out_sh, _ = run_cli(tmp_path, "--config", PROD, *args)
    assert code == 2 and not out_sh.exists()
    assert message in capsys.readouterr().err


def test_server_task_execs_the_command_of_its_name_on_its_node(tmp_path):
    plan = {"servers": [{"name": f"server{i}", "node": "n3", "local_id": i,
                         "argv": [sys.executable, "-c", f"print('server {i}')"]} for i in range(2)]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    env = {"SLURMD_NODENAME": "n3", "PATH": "/usr/bin:/bin"}

    def task(*args):
        return subprocess.run([sys.executable, "-m", "gspo_megatron.launch.server_task", str(path), *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    run = task("server1")
    assert (run.returncode, run.stdout) == (0, "server 1\n")
    run = task("server7")
    assert run.returncode == 2 and "no server named 'server7'" in run.stderr
    assert task().returncode == 2  # the name is required
    env["SLURMD_NODENAME"] = "n9"  # a step that landed on another node would bind the wrong address
    run = task("server1")
    assert run.returncode == 2 and "server server1 of the launch plan belongs on node n3, but this step runs on n9" \
        in run.stderr


def test_the_planner_imports_neither_torch_nor_megatron():
    code = ("import sys, gspo_megatron.launch.__main__, gspo_megatron.launch.server_task; "
            "print(sorted(m for m in ('torch', 'megatron', 'transformers', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
