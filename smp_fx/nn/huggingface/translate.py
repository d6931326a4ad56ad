"""State-dict translation between a Hugging Face model and SMP's distributed modules, as
rules: one table per model family, read in both directions.

A name no rule matches is an error, so another architecture is never translated half-way;
results are views of the input where the layout allows.

>>> rules = (Rename("h.{layer}.fc.{kind}", "layers.{layer}.dense.{kind}", transpose=True),)
>>> import torch
>>> hf = {"h.0.fc.weight": torch.zeros(2, 3), "h.0.fc.bias": torch.zeros(3)}
>>> {k: tuple(v.shape) for k, v in hf_to_smp(hf, rules, family="toy").items()}
{'layers.0.dense.weight': (3, 2), 'layers.0.dense.bias': (3,)}
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from cost_model.errors import SMPCheckpointError

FIELDS = {"layer": r"\d+", "kind": r"weight|bias", "last": r"\d+",
          "prefix": r"(?:[A-Za-z_]\w*\.)*?"}


@dataclass(frozen=True)
class Rename:
    """One Hugging Face name <-> one smp name (``transpose``: a ``Conv1D`` weight)."""

    hf: str
    smp: str
    transpose: bool = False


@dataclass(frozen=True)
class Fused:
    """One Hugging Face tensor <-> ``len(smp)`` smp tensors, split along the output
    features in that order (``transpose``: a ``Conv1D`` weight)."""

    hf: str
    smp: tuple[str, ...]
    transpose: bool = False


Rule = Union[Rename, Fused]
StateDict = dict[str, Any]


def _regex(pattern: str) -> re.Pattern[str]:
    out = ""
    for piece in re.split(r"(\{\w+\})", pattern):
        name = piece[1:-1] if piece.startswith("{") else None
        out += f"(?P<{name}>{FIELDS[name]})" if name in FIELDS else re.escape(piece)
    return re.compile(out + "$")


def _match(pattern: str, key: str) -> dict[str, str] | None:
    found = _regex(pattern).match(key)
    return found.groupdict() if found else None


def _layers(state_dict: Mapping[str, Any], prefix: str) -> int:
    """The highest layer index under ``prefix`` (``prefix.{i}.``), -1 if none."""
    found = [int(m.group(1)) for k in state_dict
             for m in [re.match(re.escape(prefix) + r"\.(\d+)\.", k)] if m]
    return max(found, default=-1)


def _unknown(key: str, family: str, direction: str) -> SMPCheckpointError:
    return SMPCheckpointError.build(
        f"no {family} translation rule covers this name", key, f"{direction} ({family})",
        f"pass a {family} state dict with its own parameter names (a model of another "
        "architecture, or a prefix such as 'module.', does not translate)")


def _oriented(t: torch.Tensor, kind: str, transpose: bool) -> torch.Tensor:
    return t.t() if transpose and kind == "weight" and t.dim() == 2 else t


def hf_to_smp(state_dict: Mapping[str, Any], rules: Sequence[Rule], family: str,
              layers_prefix: str = "", dropped: Sequence[str] = (),
              passthrough: bool = False) -> StateDict:
    """Hugging Face names -> smp names by ``rules``; ``layers_prefix`` (e.g.
    ``transformer.h``) is where ``{last}`` is counted; ``passthrough`` keeps the names no
    rule matches."""
    last = str(_layers(state_dict, layers_prefix)) if layers_prefix else "-1"
    out: StateDict = {}
    for key, value in state_dict.items():
        if any(_match(p, key) is not None for p in dropped):
            continue
        for rule in rules:
            fields = _match(rule.hf, key)
            if fields is None:
                continue
            fields.setdefault("last", last)
            kind = fields.get("kind", "weight")
            if isinstance(rule, Rename):
                out[rule.smp.format(**fields)] = _oriented(value, kind, rule.transpose)
            else:
                parts = _oriented(value, kind, rule.transpose).chunk(len(rule.smp), dim=0)
                for name, part in zip(rule.smp, parts):
                    out[name.format(**fields)] = part
            break
        else:
            if not passthrough:
                raise _unknown(key, family, "translate_hf_state_dict_to_smdistributed")
            out[key] = value
    return out


def smp_to_hf(state_dict: Mapping[str, Any], rules: Sequence[Rule], family: str,
              layers_prefix: str = "", passthrough: bool = False) -> StateDict:
    """smp names -> Hugging Face names by ``rules`` (fused tensors rebuilt from all their
    parts); ``layers_prefix`` (e.g. ``transformer.seq_layers``) is where ``{last}`` is
    counted; ``passthrough`` keeps the names no rule matches."""
    last = str(_layers(state_dict, layers_prefix)) if layers_prefix else "-1"
    out: StateDict = {}
    pending: dict[tuple[str, str], dict[int, Any]] = {}
    for key, value in state_dict.items():
        for rule in rules:
            names = (rule.smp,) if isinstance(rule, Rename) else rule.smp
            hit = next(((i, f) for i, n in enumerate(names)
                        for f in [_match(n, key)] if f is not None), None)
            if hit is None or hit[1].get("last", last) != last:
                continue
            index, fields = hit
            fields.setdefault("last", last)
            kind = fields.get("kind", "weight")
            target = rule.hf.format(**fields)
            if isinstance(rule, Rename):
                out[target] = _oriented(value, kind, rule.transpose)
            else:
                pending.setdefault((target, kind), {})[index] = (value, rule)
            break
        else:
            if not passthrough:
                raise _unknown(key, family, "translate_state_dict_to_hf")
            out[key] = value
    for (target, kind), parts in pending.items():
        rule = next(iter(parts.values()))[1]
        if len(parts) != len(rule.smp):
            missing = [rule.smp[i] for i in range(len(rule.smp)) if i not in parts]
            raise SMPCheckpointError.build(
                f"a fused {family} tensor needs all its parts", target,
                "translate_state_dict_to_hf", f"include {missing} in the state dict")
        whole = torch.cat([parts[i][0] for i in range(len(rule.smp))], dim=0)
        out[target] = _oriented(whole, kind, rule.transpose).contiguous()
    return out


__all__ = ["Fused", "Rename", "Rule", "hf_to_smp", "smp_to_hf"]
