"""Compiled stages equal one process on Hugging Face BERT (``BertForMaskedLM`` from a tiny
config, ``examples/models/hf_zoo.py``): pp 2 on 2 gloo processes under 1F1B, interleaved
v = 2 and ZB-V, compiled with ``aot_eager``: the loss of every step, every gradient after
every step and the ``state_dict()`` after 3 Adam steps within 1e-5 of the plain model
trained in one process; every stage compiled (whole, or under ZB-V in regions between its
eager GEMMs), none falling back, none recompiling (``test_compiled``'s checks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_ranks
from tests.smp_fx.runtime.executor.test_compiled import _all_cases, _references

CASES = tuple(("bert", pipeline, v, "aot_eager")
              for pipeline, v in (("interleaved", 1), ("interleaved", 2), ("zbv", 2)))


@pytest.mark.multiproc
def test_compiled_bert_equals_one_process(tmp_path: Path) -> None:
    path = tmp_path / "references.pt"
    _references(path, CASES)
    assert run_ranks(_all_cases, 2, str(path), CASES, False, timeout=600) == [[], []]
