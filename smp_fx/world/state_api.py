"""What SMP scripts read from ``smp.state``: ``cfg`` and ``module_manager``.

>>> from smp_fx.config import load_config
>>> cfg = ConfigView(load_config({"partitions": 2}, env={}))
>>> cfg.pipeline_parallel_degree, cfg.partitions, cfg.fp16
(2, 2, False)
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator
from typing import Any

from smp_fx.config import ALIASES, BY_NAME, SMPConfig

StateDict = dict[str, Any]
Translator = Callable[[StateDict], StateDict]


class ConfigView:
    """Read-only attribute access to the configuration, as ``smp.state.cfg``: a value changed
    on one rank would make ranks disagree."""

    __slots__ = ("_config",)

    def __init__(self, config: SMPConfig) -> None:
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str) -> Any:
        param = ALIASES.get(name, name)
        if param in BY_NAME:
            return getattr(self._config, param)
        close = difflib.get_close_matches(name, [*BY_NAME, *ALIASES], n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise AttributeError(f"smp.state.cfg has no parameter '{name}'{hint}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"smp.state.cfg is read-only (tried to set '{name}'): pass the "
                             "parameter to smp.init or SM_HP_MP_PARAMETERS instead")

    def get_config_dict(self) -> dict[str, Any]:
        """Every parameter name -> its resolved value."""
        return self._config.values()

    def __repr__(self) -> str:
        return f"ConfigView({self._config.values()!r})"


class ModuleManager:
    """SMP's ``state.module_manager.translate_functions``: ``(smp_to_hf, hf_to_smp)`` pairs
    that full checkpoints apply on save and load; empty until a module renames."""

    def __init__(self) -> None:
        self.translate_functions: list[tuple[Translator, Translator]] = []

    def register_translate_function(self, functions: tuple[Translator, Translator]) -> None:
        """Add one ``(smp_to_hf, hf_to_smp)`` pair."""
        self.translate_functions.append(functions)

    def reset(self) -> None:
        self.translate_functions.clear()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No translation inside the block: transformers' ``save_pretrained`` in SMP mode
        runs every ``smp_to_hf`` on the state it is given, which would translate a state
        already in Hugging Face's names a second time."""
        held = list(self.translate_functions)
        self.translate_functions.clear()
        try:
            yield
        finally:
            self.translate_functions[:] = held


module_manager = ModuleManager()
