"""Tests of tools/extract_sglang_api.py on a miniature unpacked wheel (the real one is 39 MB)."""

import json
import textwrap

from tools.extract_sglang_api import extract, main

FILES = {
    "sglang-9.9.dist-info/METADATA": "Name: sglang\nVersion: 9.9\n",
    "sglang/srt/entrypoints/http_server.py": '''
        @app.post("/pause_generation")
        async def pause_generation(obj: Annotated[PauseGenerationReqInput, Body()], request: Request):
            pass
        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(timeout: float = 0.0):
            pass
        @app.post(os.environ.get("ROUTE", "/api/chat"))
        async def chat(obj: ChatReq):
            pass
        ''',
    "sglang/srt/managers/io_struct.py": '''
        class BaseReq(msgspec.Struct):
            rid: Optional[str] = None
        class PauseGenerationReqInput(BaseReq, kw_only=True):
            mode: Literal["abort", "retract"] = "abort"
            needed: int
        ''',
    "sglang/api/v1/api_types.py": '''
        class GenerateRequest(msgspec.Struct):
            """x (unknown keys ignored)."""
            rid: Optional[str] = None
        class SamplingParams(msgspec.Struct):
            """x (unknown keys rejected)."""
            top_p: Optional[float] = 1.0
            max_new_tokens: Optional[int] = 128
        def decode_GenerateRequest(value):
            for key, x in m.items():
                if key == "rid":
                    kw["rid"] = None if x is None else decode_StringOrList(x)
        def decode_SamplingParams(value):
            for key, x in m.items():
                if key == "top_p":
                    kw["top_p"] = 1.0 if x is None else _expect_float(x, expected="f64")
                elif key == "max_new_tokens":
                    kw["max_new_tokens"] = None if x is None else _expect_int(x, expected="i64")
        ''',
    "sglang/srt/constants.py": 'A = "kv_cache"\nB = "weights"\nGPU_MEMORY_ALL_TYPES = [A, B]\n',
    "sglang/srt/utils/common.py": '''
        class SafeUnpickler(pickle.Unpickler):
            ALLOWED_GLOBALS = {("builtins", "list"), ("torch", "Tensor")}
        ''',
}


def _mini_wheel(root):
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_extracts_routes_types_contract_tags_and_allow_list(tmp_path):
    spec = extract(str(_mini_wheel(tmp_path / "w")))
    assert spec["sglang_version"] == "9.9"
    assert spec["endpoints"] == {"/flush_cache": {"methods": ["GET", "POST"], "request": None},
                                 "/pause_generation": {"methods": ["POST"],
                                                       "request": "PauseGenerationReqInput"}}
    fields = spec["request_types"]["PauseGenerationReqInput"]["fields"]
    assert fields["rid"] == {"type": "Optional[str]", "required": False}  # inherited
    assert fields["needed"]["required"] and fields["mode"]["type"] == "Literal['abort', 'retract']"
    sp = spec["json_contract"]["SamplingParams"]
    assert sp == {"unknown_keys": "rejected", "field_order": ["top_p", "max_new_tokens"],
                  "fields": {"top_p": "f64", "max_new_tokens": "i64"}}
    assert spec["json_contract"]["GenerateRequest"]["fields"] == {"rid": "StringOrList"}
    assert spec["memory_tags"] == ["kv_cache", "weights"]
    assert spec["unpickle_allowed_globals"] == [["builtins", "list"], ["torch", "Tensor"]]


def test_check_mode_reports_drift(tmp_path, capsys):
    wheel = _mini_wheel(tmp_path / "w")
    out = tmp_path / "spec.json"
    assert main([str(wheel), "--out", str(out)]) == 0
    assert main([str(wheel), "--check", str(out)]) == 0
    spec = json.loads(out.read_text())
    spec["memory_tags"] = ["weights"]
    out.write_text(json.dumps(spec))
    assert main([str(wheel), "--check", str(out)]) == 1
    assert main([str(tmp_path / "missing"), "--check", str(out)]) == 2
    assert "no such wheel" in capsys.readouterr().err
