"""JSON for frozen dataclasses with a schema version: one implementation for every spec."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

from cost_model.errors import SMPConfigError

T = TypeVar("T")


def versioned_json(obj: Any, version: int) -> dict[str, Any]:
    """``obj``'s fields plus ``schema_version``."""
    return {"schema_version": version, **dataclasses.asdict(obj)}


def from_versioned_json(cls: type[T], data: dict[str, Any], version: int) -> T:
    """Rebuild ``cls`` from ``versioned_json`` output; a different schema is an error."""
    fields = dict(data)
    got = fields.pop("schema_version", version)
    if got != version:
        raise SMPConfigError.build(f"unsupported {cls.__name__} schema_version", got,
                                   fix=f"regenerate it with this smp-fx (schema {version})")
    return cls(**fields)


def read_spec_file(name_or_path: str, what: str, known: list[str], fix: str) -> dict[str, Any]:
    """The JSON object in the spec file ``name_or_path`` (not one of the ``known`` names)."""
    path = Path(name_or_path)
    if not path.is_file():
        raise SMPConfigError.build(f"{what} is a built-in name or a JSON file", name_or_path,
                                   what, f"use one of {known} or {fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SMPConfigError.build(f"{what} file must hold a JSON object", str(exc), str(path),
                                   f"fix the JSON or {fix}") from exc
    if not isinstance(data, dict):
        raise SMPConfigError.build(f"{what} file must hold a JSON object",
                                   type(data).__name__, str(path), f"write {{...}} or {fix}")
    return data
