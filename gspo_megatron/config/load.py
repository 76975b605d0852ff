"""Load a run configuration: schema defaults <- YAML chain <- command-line dot-list overrides.

A YAML file may start from other files with a top-level ``defaults:`` list (paths relative to
that file, applied in order, then the file itself). Every merge happens in OmegaConf struct mode
on the typed schema, so a misspelt key or a wrong type fails here with the file (or the override)
and the full dotted key in the message, instead of being silently ignored.

    cfg = load_config("configs/tiny_cpu.yaml", ["algo.clip_eps_high=5e-4", "parallel.tp=2"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from gspo_megatron.config.schema import GSPOConfig, resolve_correction
from gspo_megatron.config.validate import ConfigError, validate_config

DEFAULTS_KEY = "defaults"


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or ""
    if isinstance(exc, ConfigKeyError):
        return f"unknown key '{key}'" if key else str(exc).splitlines()[0]
    if isinstance(exc, ValidationError):
        msg = str(exc).splitlines()[0]
        return f"bad value for '{key}': {msg}" if key else msg
    return str(exc).splitlines()[0]


def _read_yaml(path: Path) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _file_chain(path: Path, seen: Optional[List[Path]] = None) -> List[tuple]:
    """(path, body) pairs in merge order: each file's defaults first, then the file."""
    path = path.resolve()
    seen = list(seen or [])
    if path in seen:
        cycle = " -> ".join(str(p) for p in seen + [path])
        raise ConfigError(f"{path}: 'defaults' form a cycle: {cycle}")
    data = _read_yaml(path)
    parents = data.pop(DEFAULTS_KEY, []) or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: 'defaults' must be a list of file paths")
    chain: List[tuple] = []
    for parent in parents:
        chain.extend(_file_chain(path.parent / parent, seen + [path]))
    chain.append((path, data))
    return chain


def _merge(base: DictConfig, body, origin: str) -> DictConfig:
    """``OmegaConf.merge(base, body)`` into ``base`` itself: ``merge`` deep-copies the whole
    config first, ~10 ms each time, once per file and per override (a trainer's start, each of
    the reliability table's bad inputs). A failed merge may leave ``base`` half merged: every
    caller drops it and raises."""
    try:
        base.merge_with(body)
        return base
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{origin}: {_describe(exc)}") from None


def load_config(
    path: Optional[str | Path] = None,
    overrides: Sequence[str] = (),
    *,
    validate: bool = True,
    world_size: Optional[int] = None,
) -> GSPOConfig:
    """Return the merged, validated config as a typed OmegaConf object.

    ``world_size``, when given, is the number of learner processes actually launched and is
    checked against the layout (``parallel.world_size`` is used otherwise). Whether the layout
    fits the declared GPU memory is the planner's check, one floor up
    (``planner.fit_check.load_fitting_config``, which entry points call instead of this).
    """
    cfg = OmegaConf.structured(GSPOConfig)
    OmegaConf.set_struct(cfg, True)
    _unlock_free_form_mappings(cfg)
    if path is not None:
        for file_path, body in _file_chain(Path(path)):
            cfg = _merge(cfg, body, str(file_path))
    cfg = apply_overrides(cfg, overrides)
    resolve_correction(cfg)  # algo.tis "auto": what it means for this run, named in config.yaml
    if validate:
        validate_config(cfg, world_size=world_size)
    return cfg  # type: ignore[return-value]


def _unlock_free_form_mappings(node: DictConfig) -> None:
    """Let ``Dict[str, Any]`` fields (``data.chat_template_kwargs``) take keys the schema cannot
    know; every dataclass section stays locked."""
    for key in node:
        child = node[key]
        if isinstance(child, DictConfig):
            if OmegaConf.get_type(child) is dict:
                OmegaConf.set_struct(child, False)
            else:
                _unlock_free_form_mappings(child)


def apply_overrides(cfg: DictConfig, overrides: Iterable[str]) -> DictConfig:
    """Merge ``a.b=value`` strings into a copy of ``cfg``; each bad one is reported as typed."""
    cfg = OmegaConf.merge(cfg)  # one copy: the caller's config stays as it was
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command-line override '{item}': expected key=value")
        try:
            body = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as exc:
            raise ConfigError(f"command-line override '{item}': {_describe(exc)}") from None
        cfg = _merge(cfg, body, f"command-line override '{item}'")
    return cfg


def save_config(cfg: DictConfig, path: str | Path) -> Path:
    """Write the fully resolved config (what actually ran) as YAML."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    tmp.replace(path)
    return path
