"""Extract SGLang's HTTP API from its wheel into a JSON file the conformance test checks against.

SGLang's request types cannot be imported on a CPU machine (``srt/managers/io_struct.py`` pulls
in torch, msgspec, its kernels ...), so this script reads the wheel's *source* with ``ast``,
without running any of it, and writes:

- ``endpoints``: every route of ``srt/entrypoints/http_server.py`` with its methods and the
  request type its handler parses (``null`` when it takes no body);
- ``request_types``: the fields of those types (``srt/managers/io_struct.py``, base classes
  included): annotation and whether it is required;
- ``json_contract``: the ``/generate`` JSON contract of ``api/v1/api_types.py``
  (``GenerateRequest``, ``SamplingParams``): field order, the JSON type the decoder checks first
  for each field (``i64``, ``f64``, ``bool``, ``string``, or a named alias such as
  ``StringOrList``), and whether unknown keys are rejected or ignored;
- ``memory_tags`` (``srt/constants.py``) and ``unpickle_allowed_globals`` (``SafeUnpickler``
  in ``srt/utils/common.py``).

    pip download --no-deps sglang==0.5.23 -d /tmp/whl
    python tools/extract_sglang_api.py /tmp/whl/sglang-0.5.23-*.whl --out tests/data/sglang_api_0.5.23.json
    python tools/extract_sglang_api.py WHEEL --check tests/data/sglang_api_0.5.23.json   # exit 1 on drift
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
import zipfile
from typing import Any, Dict, List, Optional

PKG = "sglang/"


class Wheel:
    """Read files from a wheel (zip) or an unpacked directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.zip = zipfile.ZipFile(path) if os.path.isfile(path) else None

    def names(self) -> List[str]:
        if self.zip:
            return self.zip.namelist()
        return [os.path.relpath(os.path.join(d, f), self.path)
                for d, _, files in os.walk(self.path) for f in files]

    def read(self, name: str) -> str:
        if self.zip:
            return self.zip.read(name).decode()
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def sha256(self) -> Optional[str]:
        if not self.zip:
            return None
        with open(self.path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()


def version(wheel: Wheel) -> str:
    meta = next(n for n in wheel.names() if n.endswith(".dist-info/METADATA"))
    return re.search(r"^Version: (.+)$", wheel.read(meta), re.M).group(1).strip()


def _const(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def endpoints(source: str) -> Dict[str, Dict[str, Any]]:
    """Routes declared with ``@app.get/post/put/api_route`` and constant paths."""
    out: Dict[str, Dict[str, Any]] = {}
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        request = None
        for arg in fn.args.args:
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
                ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
            if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req", "Input")):
                request = ann.id
                break
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and ast.unparse(dec.func.value) == "app" and dec.args):
                continue
            path = _const(dec.args[0])
            if not isinstance(path, str):
                continue  # routes named by environment variables
            kind = dec.func.attr
            if kind == "api_route":
                methods = next((_const(k.value) for k in dec.keywords if k.arg == "methods"), ["GET"])
            elif kind in ("get", "post", "put", "delete"):
                methods = [kind.upper()]
            else:
                continue
            entry = out.setdefault(path, {"methods": [], "request": request})
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
    return dict(sorted(out.items()))


def _class_fields(cls: ast.ClassDef) -> Dict[str, Dict[str, Any]]:
    fields = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = {"type": ast.unparse(stmt.annotation),
                                      "required": stmt.value is None}
    return fields


def request_types(source: str, wanted: List[str]) -> Dict[str, Dict[str, Any]]:
    classes = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> Dict[str, Dict[str, Any]]:
        cls = classes[name]
        out: Dict[str, Dict[str, Any]] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        out.update(_class_fields(cls))
        return out

    return {name: {"fields": fields(name)} for name in sorted(set(wanted)) if name in classes}


_EXPECT = {"_expect_int": "i64", "_expect_uint": "u64", "_expect_float": "f64",
           "_expect_str": "string", "_expect_bool": "bool", "_expect_seq": "sequence",
           "_expect_map": "map"}


def _json_type(expr: ast.AST) -> str:
    for node in ast.walk(expr):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id.startswith("decode_"):
                return node.func.id[len("decode_"):]
            if node.func.id in _EXPECT:
                return _EXPECT[node.func.id]
    return "any"


def json_contract(source: str, structs: List[str]) -> Dict[str, Dict[str, Any]]:
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    decoders = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    out = {}
    for name in structs:
        doc = ast.get_docstring(classes[name]) or ""
        policy = "rejected" if "unknown keys rejected" in doc else "ignored"
        types: Dict[str, str] = {}
        for node in ast.walk(decoders[f"decode_{name}"]):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) \
                    and ast.unparse(node.test.left) == "key":
                key = _const(node.test.comparators[0])
                assign = node.body[0]
                types[key] = _json_type(assign.value if isinstance(assign, ast.Assign) else assign)
        order = list(_class_fields(classes[name]))
        out[name] = {"unknown_keys": policy, "field_order": order,
                     "fields": {k: types.get(k, "any") for k in order}}
    return out


def memory_tags(source: str) -> List[str]:
    values = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if isinstance(node.value, ast.List):
                return [values[e.id] if isinstance(e, ast.Name) else _const(e) for e in node.value.elts] \
                    if target == "GPU_MEMORY_ALL_TYPES" else []
            values[target] = _const(node.value)
    raise ValueError("GPU_MEMORY_ALL_TYPES not found")


def allowed_globals(source: str) -> List[List[str]]:
    for cls in ast.walk(ast.parse(source)):
        if isinstance(cls, ast.ClassDef) and cls.name == "SafeUnpickler":
            for stmt in cls.body:
                if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "ALLOWED_GLOBALS":
                    return sorted([list(t) for t in _const(stmt.value)])
    raise ValueError("SafeUnpickler.ALLOWED_GLOBALS not found")


def extract(path: str) -> Dict[str, Any]:
    wheel = Wheel(path)
    srt = PKG + "srt/"
    routes = endpoints(wheel.read(srt + "entrypoints/http_server.py"))
    wanted = [e["request"] for e in routes.values() if e["request"]]
    return {
        "sglang_version": version(wheel),
        "source": {"wheel": os.path.basename(path), "sha256": wheel.sha256(),
                   "extracted_by": "tools/extract_sglang_api.py"},
        "endpoints": routes,
        "request_types": request_types(wheel.read(srt + "managers/io_struct.py"), wanted),
        "json_contract": json_contract(wheel.read(PKG + "api/v1/api_types.py"),
                                       ["GenerateRequest", "SamplingParams"]),
        "memory_tags": memory_tags(wheel.read(srt + "constants.py")),
        "unpickle_allowed_globals": allowed_globals(wheel.read(srt + "utils/common.py")),
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("wheel", help="sglang-*.whl or an unpacked wheel directory")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--check", help="compare with this JSON file; exit 1 if it differs")
    args = p.parse_args(argv)
    if not os.path.exists(args.wheel):
        print(f"error: {args.wheel}: no such wheel or directory", file=sys.stderr)
        return 2
    data = extract(args.wheel)
    if args.check:
        with open(args.check) as f:
            stored = json.load(f)
        stored["source"] = data["source"] = None  # the same API from another copy of the wheel
        if stored != data:
            print(f"{args.check} differs from {args.wheel}", file=sys.stderr)
            return 1
        print(f"{args.check} matches {args.wheel} (sglang {data['sglang_version']})")
        return 0
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
