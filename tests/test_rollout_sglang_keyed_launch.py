"""The keyed SGLang launcher's argv (rollout/sglang/keyed_launch.py), parsed by SGLang 0.5.23's own
argument parser: a key that starts with ``-`` (``secrets.token_urlsafe`` draws one in 64 so)
must still be taken as the key, not as an option (CI once failed on it: "argument --api-key:
expected one argument")."""

import json

from gspo_megatron.rollout.sglang.keyed_launch import keyed_argv
from tests.ahead import Command
from tests.real_sglang import SGLANG_PYTHON

PARSE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(json.loads(sys.argv[1]))
print(json.dumps([args.api_key, args.admin_api_key, args.port]))
"""


ARGV = keyed_argv(["--model-path", "m", "--port", "31234"], "-k1_-x", "--k2")
AHEAD = {"test_keys_that_look_like_options_reach_sglang_intact": Command(
    [SGLANG_PYTHON, "-c", PARSE, json.dumps(ARGV[1:])], timeout_s=300)}
"""SGLang's parser in its own interpreter (importing SGLang: ~10 CPU-seconds), in the background
while the tests before this one run (``tests/ahead.py``)."""


def test_keys_that_look_like_options_reach_sglang_intact(ahead):
    assert ARGV[0] == "sglang.launch_server" and ARGV[1:5] == ["--model-path", "m", "--port", "31234"]
    assert ahead.returncode == 0, ahead.stderr[-2000:]
    assert json.loads(ahead.stdout.strip().splitlines()[-1]) == ["-k1_-x", "--k2", 31234]
