"""Conformance with SGLang 0.5.23: the client's requests and the stand-in's routes against the API
extracted from the pinned wheel (tests/data/sglang_api_0.5.23.json, by tools/extract_sglang_api.py).

SGLang's request types do not import on this machine (io_struct pulls in its GPU stack), so the
extracted field lists are the referee: every request the client sent during a full weight-sync
protocol run (colocated: tensor handles and memory release; disaggregated: disk) and every body
builder is checked for path, method, field names, required fields and value types; the stand-in's
routes, sampling fields, memory tags, pause modes and unpickling allow-list must match SGLang's.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.rollout.standin import handle_unpickler
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.standin.server import ROUTES, ReferenceServer
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync.disk import DiskTransport
from gspo_megatron.weight_sync.tensor_ipc import CudaIpcTransport

VERSION = "0.5.23"
SPEC_PATH = Path(__file__).parent / "data" / f"sglang_api_{VERSION}.json"
SPEC = json.loads(SPEC_PATH.read_text())


# ---- a small checker for io_struct annotations and api_types JSON types ---------------------

def matches(value, annotation: str) -> bool:
    """Does a JSON value fit a Python annotation string of io_struct (the cases we send)? An
    annotation this checker does not know fails (it must be taught, not waved through)."""
    node = ast.parse(annotation, mode="eval").body
    if isinstance(node, ast.Name):
        known = {"str": isinstance(value, str), "bool": isinstance(value, bool),
                 "int": isinstance(value, int) and not isinstance(value, bool),
                 "float": isinstance(value, (int, float)) and not isinstance(value, bool),
                 "bytes": isinstance(value, str),  # bytes travel as base64
                 "dict": isinstance(value, dict), "list": isinstance(value, list), "Any": True}
        assert node.id in known, f"annotation {annotation!r}: unknown to the conformance checker"
        return known[node.id]
    if isinstance(node, ast.Subscript):
        outer = ast.unparse(node.value)
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if outer == "Optional":
            return value is None or matches(value, ast.unparse(args[0]))
        if outer == "Annotated":
            return matches(value, ast.unparse(args[0]))
        if outer == "List":
            return isinstance(value, list) and all(matches(v, ast.unparse(args[0])) for v in value)
        if outer == "Literal":
            return value in [ast.literal_eval(a) for a in args]
        if outer == "Union":
            return any(matches(value, ast.unparse(a)) for a in args)
        if outer in ("Dict", "dict"):
            return isinstance(value, dict)
    raise AssertionError(f"annotation {annotation!r}: unknown to the conformance checker")


JSON_TYPES = {"i64": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "f64": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "bool": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
              "StringOrList": lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
              "Int64List": lambda v: isinstance(v, list) and all(isinstance(t, int) for t in v),
              "TokenIdsOrList": lambda v: isinstance(v, list) and all(isinstance(t, int) for t in v),
              "BoolOrList": lambda v: isinstance(v, bool), "SamplingParamsOrList": lambda v: isinstance(v, dict)}


def check_request(method: str, path: str, body) -> None:
    """Raise AssertionError unless SGLang 0.5.23 accepts this request as we mean it."""
    endpoint = SPEC["endpoints"].get(path)
    assert endpoint is not None, f"{path} is not an endpoint of SGLang {VERSION}"
    assert method in endpoint["methods"], f"{method} {path}: SGLang allows {endpoint['methods']}"
    if path == api.GENERATE:
        # http_server.generate_request: the JSON contract gate (api_types.GenerateRequest) checks
        # the fields it knows and ignores the rest; the handler's GenerateReqInput is what is
        # served, so a field outside the contract (return_routed_experts) must be one of its.
        contract = SPEC["json_contract"]["GenerateRequest"]["fields"]
        served = SPEC["request_types"]["GenerateReqInput"]["fields"]
        for key, value in body.items():
            if key not in contract:
                assert key in served, f"/generate field {key!r} would be ignored by SGLang"
                assert matches(value, served[key]["type"]), f"/generate {key}={value!r}"
                continue
            assert JSON_TYPES[contract[key]](value), f"/generate {key}={value!r} is not {contract[key]}"
        sampling = SPEC["json_contract"]["SamplingParams"]["fields"]
        for key, value in body.get("sampling_params", {}).items():
            assert key in sampling, f"sampling_params {key!r} is unknown to SGLang (400)"
            assert JSON_TYPES[sampling[key]](value), f"sampling_params {key}={value!r} is not {sampling[key]}"
        return
    request = endpoint["request"]
    if request is None:
        assert not body, f"{path} takes no body, got {body}"
        return
    fields = SPEC["request_types"][request]["fields"]
    body = body or {}
    for key, value in body.items():
        assert key in fields, f"{path}: {key!r} is not a field of {request} (SGLang would drop it)"
        assert matches(value, fields[key]["type"]), f"{path}: {key}={str(value)[:80]!r} is not {fields[key]['type']}"
    missing = [k for k, f in fields.items() if f["required"] and k not in body]
    assert not missing, f"{path}: required fields {missing} of {request} missing"


def test_the_spec_is_sglang_0_5_23_and_the_client_speaks_it():
    assert SPEC["sglang_version"] == VERSION == api.SGLANG_VERSION
    assert SPEC["source"]["extracted_by"] == "tools/extract_sglang_api.py"


def test_checker_catches_what_sglang_would_refuse_or_drop():
    for method, path, body in [("POST", "/generate", {"rid": "r", "return_logprobs": True}),
                               ("POST", "/generate", {"sampling_params": {"min_pp": 1}}),
                               ("POST", "/generate", {"sampling_params": {"temperature": "1"}}),
                               ("GET", api.PAUSE, {"mode": "abort"}),
                               ("POST", api.PAUSE, {"mode": "later"}),
                               ("POST", api.UPDATE_FROM_DISTRIBUTED, {"names": ["a"], "dtypes": ["f"]}),
                               ("POST", "/update_weights", {}),
                               ("POST", api.INIT_GROUP, {"master_address": "h", "master_port": "1",
                                                         "rank_offset": 1, "world_size": 2})]:
        with pytest.raises(AssertionError):
            check_request(method, path, body)


def test_every_body_builder_conforms():
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5, stop=("x",), stop_token_ids=(2,))
    bodies = [
        ("POST", api.GENERATE, api.generate_payload("r", [1, 2], sp, seed=3)),
        ("POST", api.GENERATE, api.generate_payload("r", [1, 2], sp, seed=3,
                                                    return_routed_experts=True)),  # R3
        ("POST", api.PAUSE, api.pause_payload()), ("POST", api.CONTINUE, {}),
        ("POST", api.ABORT, api.abort_payload("r")), ("POST", api.ABORT, api.abort_payload(abort_all=True)),
        ("POST", api.BEGIN_UPDATE, {}), ("POST", api.END_UPDATE, {}), ("POST", api.FLUSH_CACHE, None),
        ("POST", api.RELEASE_MEMORY, api.memory_payload()),
        ("POST", api.RESUME_MEMORY, api.memory_payload(["weights"])),
        ("POST", api.INIT_GROUP, api.init_group_payload("10.0.0.1", 29500, 1, 5, "g_pp1", "nccl")),
        ("POST", api.DESTROY_GROUP, {"group_name": "g"}),
        ("POST", api.UPDATE_FROM_DISTRIBUTED,
         api.update_distributed_payload(["a", "b"], ["bfloat16"] * 2, [[2, 3], [4]], "g", weight_version="7")),
        ("POST", api.UPDATE_FROM_TENSOR, api.update_tensor_payload(["YWJj"], weight_version="7")),
        ("POST", api.UPDATE_FROM_DISK, api.update_disk_payload("/w", weight_version="7")),
        ("POST", api.GET_WEIGHTS_BY_NAME, {"name": "lm_head.weight", "truncate_size": 10}),
        ("GET", api.HEALTH_GENERATE, None), ("GET", api.MODEL_INFO, None), ("GET", api.SERVER_INFO, None)]
    for method, path, body in bodies:
        check_request(method, path, body)


def test_requests_of_a_full_protocol_run_conform(tmp_path):
    """Generate, colocated release / tensor-handle update / resume, then a disk update: every
    request the client made, as the stand-in received it."""
    torch.set_num_threads(1)
    policy = build_tiny_policy(seed=0)
    servers = [ReferenceServer(EmbeddedEngine(*policy), enable_memory_saver=True).start() for _ in range(2)]
    eng = SGLangEngine([s.address for s in servers], request_timeout_s=60)
    new, tok = build_tiny_policy(seed=4)
    reqs = [GenerationRequest("p", tok("1+2=")["input_ids"], n=2)]
    params = SamplingParams(max_new_tokens=4, seed=1, stop=("=",))
    try:
        eng.wait_healthy(30)
        eng.check_versions()
        eng.generate(reqs, params)
        eng.release_memory()
        eng.attach_weight_transport(CudaIpcTransport(eng, 64 * 1024))
        eng.resume_memory(["weights"])
        eng.update_weights(new.state_dict().items(), "v1")
        eng.resume_memory()
        eng.generate(reqs, params)
        eng.attach_weight_transport(DiskTransport(str(tmp_path), 64 * 1024, servers=True))
        eng.update_weights(new.state_dict().items(), "v2")
        eng.generate(reqs, params)
        eng.clients[0].get_weights_by_name("lm_head.weight", 4)
        seen = {p for s in servers for _, p, _ in s.request_log}
        assert {api.GENERATE, api.PAUSE, api.BEGIN_UPDATE, api.UPDATE_FROM_TENSOR, api.END_UPDATE,
                api.FLUSH_CACHE, api.CONTINUE, api.RELEASE_MEMORY, api.RESUME_MEMORY,
                api.UPDATE_FROM_DISK, api.HEALTH_GENERATE, api.SERVER_INFO} <= seen
        for s in servers:
            for method, path, body in s.request_log:
                check_request(method, path, body)
    finally:
        eng.shutdown()
        for s in servers:
            s.stop()


def test_the_stand_in_mirrors_sglang():
    for path, methods in ROUTES.items():
        assert path in SPEC["endpoints"], f"the stand-in serves {path}, which SGLang {VERSION} lacks"
        assert sorted(methods) == SPEC["endpoints"][path]["methods"], path
    order = SPEC["json_contract"]["SamplingParams"]["field_order"]
    assert list(api.SGLANG_SAMPLING_FIELDS) == order  # also the order of the 400 message
    assert SPEC["json_contract"]["SamplingParams"]["unknown_keys"] == "rejected"
    assert api.SAMPLING_FIELDS <= set(order)
    served = set(SPEC["json_contract"]["GenerateRequest"]["fields"])
    served |= set(SPEC["request_types"]["GenerateReqInput"]["fields"])  # past the contract gate
    assert api.GENERATE_FIELDS <= served
    assert SPEC["json_contract"]["GenerateRequest"]["unknown_keys"] == "ignored"
    assert list(api.MEMORY_TAGS) == SPEC["memory_tags"]
    mode = SPEC["request_types"]["PauseGenerationReqInput"]["fields"]["mode"]["type"]
    assert set(api.PAUSE_MODES) == set(re.findall(r"'(\w+)'", mode))
    allowed = {tuple(g) for g in SPEC["unpickle_allowed_globals"]}
    assert handle_unpickler.ALLOWED_GLOBALS <= allowed, sorted(handle_unpickler.ALLOWED_GLOBALS - allowed)


def _wheel(cache: Path) -> str:
    """The pinned wheel: $SGLANG_WHEEL, else downloaded once from PyPI (no dependencies) into
    the ignored ``.cache/wheels`` folder of the checkout."""
    found = os.environ.get("SGLANG_WHEEL")
    if found:
        assert os.path.exists(found), f"SGLANG_WHEEL={found} does not exist"
        return found
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{VERSION}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", f"sglang=={VERSION}", "-d", str(cache)],
                       check=True, timeout=900)
        wheels = sorted(cache.glob(f"sglang-{VERSION}-*.whl"))
    assert wheels, f"pip download of sglang=={VERSION} left no wheel in {cache}"
    return str(wheels[0])


@pytest.mark.slow
def test_spec_matches_a_fresh_extraction_from_the_wheel():
    """The checked-in spec is what tools/extract_sglang_api.py reads from the pinned wheel today."""
    from tools.extract_sglang_api import main

    wheel = _wheel(Path(__file__).resolve().parents[1] / ".cache" / "wheels")
    assert main([wheel, "--check", str(SPEC_PATH)]) == 0


def test_the_annotation_checker_fails_on_what_it_does_not_know():
    assert matches([1, 2], "Optional[List[int]]") and not matches(["a"], "List[int]")
    assert matches("abort", "Literal['abort', 'retract']") and not matches("x", "Literal['abort']")
    for unknown in ("torch.Tensor", "Tuple[int, int]", "MyStruct"):
        with pytest.raises(AssertionError, match="unknown to the conformance checker"):
            matches(1, unknown)
