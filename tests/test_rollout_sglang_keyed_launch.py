"""The keyed SGLang launcher's argv (rollout/sglang/keyed_launch.py), parsed by SGLang 0.5.23's own
argument parser: a key that starts with ``-`` (``secrets.token_urlsafe`` draws one in 64 so)
must still be taken as the key, not as an option (CI once failed on it: "argument --api-key:
expected one argument")."""

import json
import subprocess

from gspo_megatron.rollout.sglang.keyed_launch import keyed_argv
from tests.real_sglang import SGLANG_PYTHON

PARSE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(json.loads(sys.argv[1]))
print(json.dumps([args.api_key, args.admin_api_key, args.port]))
"""


def test_keys_that_look_like_options_reach_sglang_intact():
    argv = keyed_argv(["--model-path", "m", "--port", "31234"], "-k1_-x", "--k2")
    assert argv[0] == "sglang.launch_server" and argv[1:5] == ["--model-path", "m", "--port", "31234"]
    out = subprocess.run([SGLANG_PYTHON, "-c", PARSE, json.dumps(argv[1:])], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["-k1_-x", "--k2", 31234]
