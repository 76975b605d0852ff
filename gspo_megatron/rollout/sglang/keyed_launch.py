"""Start an SGLang server with the job's keys from a file, so that no command line shows them.

    python REPO/gspo_megatron/rollout/sglang/keyed_launch.py KEY_FILE [launch_server arguments ...]

Run by path with the server's own interpreter (the image's, or ``.venv-sglang``): it imports
nothing of gspo_megatron (that environment need not have it), only the standard library and
sglang. It reads ``{"api_key", "admin_api_key"}`` from ``KEY_FILE`` (refusing a file others can
read), adds ``--api-key`` / ``--admin-api-key`` to this process's own ``sys.argv`` (which
``/proc/PID/cmdline``, hence ``ps``, does not show: it keeps the arguments of the exec), and runs
``python -m sglang.launch_server`` in this process. SGLang's scheduler and detokenizer are
spawned by multiprocessing and receive the server arguments through a pipe, not their command
line.

sglang 0.5.23 logs its resolved arguments at start (``srt/entrypoints/engine.py:
_server_args_for_logging``, which redacts only the watermark secrets), so this also redacts the
two keys there. It still returns them in ``/server_info`` to any caller holding the ordinary key
(``srt/utils/common.py: build_server_info``); docs/cluster.md says what that means.
"""

import sys

# Run by path, Python puts this file's folder first on sys.path, which would make its siblings
# (``api``, ``engine``, ``launcher`` ...) top-level modules that shadow any installed module of
# the same name: drop it before importing.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    del sys.path[0]

import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import stat  # noqa: E402


def _read_keys(path):
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        import socket

        sys.exit(f"keyed_launch: key file {path} does not exist on node {socket.gethostname()}: "
                 "every node of the job reads the keys the first node wrote, so the run directory "
                 "(or rollout.sglang.key_file) must be on a filesystem all nodes share "
                 "(docs/cluster.md)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        sys.exit(f"keyed_launch: key file {path} has mode {stat.filemode(mode)}; "
                 "others could read it (chmod 600)")
    with open(path) as f:
        data = json.load(f)
    return str(data["api_key"]), str(data["admin_api_key"])


def _redact_logged_arguments():
    import sglang.srt.entrypoints.engine as engine

    original = engine._server_args_for_logging

    def redacted(server_args):
        out = original(server_args)
        for name in ("api_key", "admin_api_key"):
            if out.get(name):
                out[name] = "<redacted>"
        return out

    engine._server_args_for_logging = redacted


def keyed_argv(arguments, api_key: str, admin_api_key: str) -> list:
    """launch_server's argv with the keys. ``--flag=value``: a key may start with ``-``
    (``secrets.token_urlsafe`` draws one in 64 so), which argparse would take for an option after
    a separate ``--flag`` (SGLang then exits 2: "expected one argument")."""
    return ["sglang.launch_server", *arguments, f"--api-key={api_key}",
            f"--admin-api-key={admin_api_key}"]


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: keyed_launch.py KEY_FILE [launch_server arguments ...]")
    api_key, admin_api_key = _read_keys(sys.argv[1])
    sys.argv = keyed_argv(sys.argv[2:], api_key, admin_api_key)
    _redact_logged_arguments()
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
