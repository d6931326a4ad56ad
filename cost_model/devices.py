"""The built-in device specs by name, and ``load_device`` for a name or a calibrated file.

They live above both ``DeviceSpec`` and the calibration, which know nothing of names.
"""

from __future__ import annotations

from cost_model import gpu_specs
from cost_model.calibrate import quick_cpu_spec
from cost_model.datasheets import A100, H100, V100
from cost_model.device import DeviceSpec
from cost_model.errors import SMPConfigError
from cost_model.serial import read_spec_file

DEFAULT_DEVICE = "a100"

_BUILT_IN: dict[str, DeviceSpec] = {
    s.name: s for s in (H100, A100, V100, gpu_specs.H200_SXM, gpu_specs.B200)}
"""The GPUs by name: the rounded datasheet specs (``cost_model.datasheets``), and for the
H200 and B200, which have none, the sourced specs the built-in clusters carry
(``cost_model.gpu_specs``), so the runtime plans for the GPU it finds."""


def device_names() -> tuple[str, ...]:
    return (*_BUILT_IN, "cpu")


def get_device(name: str) -> DeviceSpec:
    """A spec by name: "h100", "a100", "v100" (datasheet), "h200", "b200" (sourced) or
    "cpu" (measured here, quick).

    >>> get_device("a100").link_bandwidth
    300000000000.0
    """
    key = name.lower()
    if key == "cpu":
        return quick_cpu_spec()
    if key not in _BUILT_IN:
        raise SMPConfigError.build("unknown device spec name", name, "cost_model.get_device",
                                   f"use one of {list(device_names())}, a spec file "
                                   "written by `smp-fx calibrate`, or build a DeviceSpec")
    return _BUILT_IN[key]


def load_device(name_or_path: str) -> DeviceSpec:
    """A built-in spec by name, or a spec JSON file (``smp-fx calibrate -o FILE.json``)."""
    if name_or_path.lower() in device_names():
        return get_device(name_or_path)
    data = read_spec_file(name_or_path, "a device spec", list(device_names()),
                          "write a file with `smp-fx calibrate -o FILE.json`")
    return DeviceSpec.from_json(data)


def spec_for_device_name(device_name: str) -> str | None:
    """The built-in spec for an accelerator's marketing name (``torch.cuda.get_device_name``):
    "NVIDIA H100 80GB HBM3" -> "h100"; ``None`` if no built-in matches."""
    upper = device_name.upper()
    for key in _BUILT_IN:
        if key.upper() in upper:
            return key
    return None
