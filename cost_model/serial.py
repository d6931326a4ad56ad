"""JSON for frozen dataclasses with a schema version: one implementation for every spec."""

from __future__ import annotations

import dataclasses
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
