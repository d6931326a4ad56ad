"""Write ``tests/data/smp_api.json``: the facts of SMP's documentation that smp-fx's API is
tested against, so that the test needs the pages only to refresh the data, never to run.

Run it from the repository root when SMP's documentation pages are at hand (by default
``../shared/seeds`` beside the checkout, or the folder ``SMP_FX_SEEDS_DIR`` names):

    python -m tests.data.extract_smp_api            # rewrites tests/data/smp_api.json
    python -m tests.data.extract_smp_api --check    # exit 1 if the data is out of date

What is read, page by page (``PAGES`` says which page is which version):

* ``.. class::`` / ``.. function::`` / ``.. method::`` / ``.. data::`` directives. A method
  belongs to the class it is nested in; on the v1.3 page, which lost its indentation and
  its directives, to the class whose text comes before it. Full signatures where a page
  gives them (the smddp guide), else the bullet lists of parameters with their
  ``default: ...`` (``smp.DistributedModel``, ``smp.save``, ``smp.load``). ``( )`` gives
  no parameters: the entry then has ``"params": null``. A name documented on several pages
  is one entry; the longest parameter list wins and every page is listed in ``sources``.
* every ``smp.<name>`` in the prose and code of every page (``mentions``), minus the
  page typos in ``TYPOS`` (kept in the data under ``left_out``, with the reason);
* every ``import smdistributed...`` / ``from smdistributed... import`` line (``imports``).

Besides the pages' facts, the data holds ``used``: every SMP name, method, attribute and
configuration key that AWS's example scripts and the last v1 documentation (SMP 1.11-1.15,
aws/sagemaker-python-sdk before December 2023) use, gathered by reading them with the
code-search tools (``used_sources`` names each repository and commit). Those sources are
not at hand here, so ``used`` is kept as it is when the pages' facts are rewritten.

The format (``SCHEMA``) is meant to grow: each entry of ``names`` says what the
documentation promises of the name in ``behaviour`` (today always ``"present"``: it exists
with the documented signature; later sources add ``"accepted"`` for configuration values
and ``"refused"`` with the documented ``error``), so a reader of the test data can add the
names of other pages and example scripts without changing the test's shape.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1
DATA = Path(__file__).resolve().parent / "smp_api.json"
REPO = Path(__file__).resolve().parents[2]

PAGES: dict[str, dict[str, str]] = {
    "smp_pytorch_api_v1.2.rst": {
        "title": "SMP PyTorch API (smd_model_parallel_pytorch.rst)",
        "version": "SMP v1.2.0 (PyTorch 1.7.1, 1.6)"},
    "smp_pytorch_api_v1.3_page.txt": {
        "title": "SMP PyTorch API, the rendered GitHub page of smd_model_parallel_pytorch.rst",
        "version": "SMP v1.3.0 (PyTorch 1.7.1, 1.6.0)"},
    "smddp_pytorch_guide.rst": {
        "title": "SageMaker distributed data parallel: Guide for PyTorch",
        "version": "not stated on the page"},
    "modify_pytorch_training_script.md": {
        "title": "Modify a PyTorch Training Script (SageMaker developer guide)",
        "version": "lists SMP v1.4.0-v1.6.0; links to the v1.2.0 API"},
    "smp_configuration_parameters.rst": {
        "title": "Configuration Parameters for distribution",
        "version": "not stated on the page"},
}
"""Every page read, with what it says about its own version."""

SIGNATURE_PAGES = ("smp_pytorch_api_v1.2.rst", "smp_pytorch_api_v1.3_page.txt",
                   "smddp_pytorch_guide.rst")
"""The pages whose directives and parameter lists give names and signatures."""

SCRIPT_PAGE = "modify_pytorch_training_script.md"
"""The page whose code blocks are whole training scripts (``mentions[].in_script_code``)."""

TYPOS = {"smp.set": (SCRIPT_PAGE, 'a typo for smp.step: "this `smp.set` decorated function"')}


@dataclass
class Name:
    """One documented name while the pages are read."""

    name: str
    kind: str  # class, function, method, property or data
    params: list[dict[str, Any]] | None = None
    var_args: bool = False
    sources: list[str] = field(default_factory=list)
    params_from: str | None = None


def _default(text: str) -> dict[str, Any]:
    """A documented default as data: the page's spelling and its Python meaning, either a
    literal ``value`` or a ``ref`` to an object the test imports."""
    raw, text = text.strip(), text.strip().strip("`").strip()
    if "pickle" in text and "module" in text:
        return {"text": raw, "ref": "pickle"}
    if text.endswith("group.WORLD"):
        # torch spells the default process group as None in its signatures
        return {"text": raw, "value": None}
    if text.endswith("ReduceOp.SUM"):
        return {"text": raw, "ref": "torch.distributed.ReduceOp.SUM"}
    value = ast.literal_eval(text)
    if isinstance(value, (tuple, set, bytes, complex)):
        raise ValueError(f"a default JSON cannot hold as documented: {text!r}")
    return {"text": raw, "value": value}


def _signature(text: str) -> tuple[list[dict[str, Any]], bool]:
    """``a, b=1, *args, **kwargs`` -> params and whether it takes *args/**kwargs."""
    if not text.strip():
        return [], False
    fn = ast.parse(f"def f({text.replace(chr(0xA0), ' ')}): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args.args
    first_default = len(args) - len(fn.args.defaults)
    params: list[dict[str, Any]] = []
    for i, a in enumerate(args):
        p: dict[str, Any] = {"name": a.arg}
        if i >= first_default:
            p["default"] = _default(ast.unparse(fn.args.defaults[i - first_default]))
        params.append(p)
    return params, fn.args.vararg is not None or fn.args.kwarg is not None


DIRECTIVE = re.compile(r"^(\s*)\.\. (class|function|method|data)::\s*([\w.]+)\s*(\((.*)\))?")
BULLET = re.compile(r"^\s*(?:-|•)\s+``?([\w]+)[^`]*``?\s*(.*)$")
PLAIN_BULLET = re.compile(r"^\s*•\s+(\w+)\s*(.*)$")
DEFAULT = re.compile(r"default\s*[:=]\s*(module\s+``\"pickle\"``|``[^`]*``|[\w.\"']+)")


def parse_page(text: str, page: str) -> list[Name]:
    """The names one page documents (see the module docstring)."""
    names: list[Name] = []
    current_class: str | None = None
    bullets_for: Name | None = None
    for line in text.splitlines():
        if line.strip().startswith("Parameters - optimizer"):  # v1.3: the optimizer's text
            current_class = "smp.DistributedOptimizer"
            names.append(Name(current_class, "class", [{"name": "optimizer"}], sources=[page]))
            continue
        if line.startswith("A sub-class of torch.nn.Module"):  # v1.3: the model's text
            current_class = "smp.DistributedModel"
        m = DIRECTIVE.match(line)
        if m:
            indent, kind, qual, paren, inner = m.groups()
            params, var = (None, False) if paren is None or not (inner or "").strip() \
                else _signature(inner)
            if not qual.startswith(("smp.", "smdistributed.")):
                qual, kind = f"{current_class}.{qual}", "method"
            elif kind == "class":
                current_class = qual
            elif not indent:
                current_class = None if not qual.startswith("smp.Distributed") else current_class
            names.append(Name(qual, kind, params, var, [page]))
            bullets_for = names[-1] if kind in ("class", "function") else None
            continue
        if bullets_for is None:
            continue
        b = BULLET.match(line) or (PLAIN_BULLET.match(line) if "(default" in line
                                   or line.strip().startswith("• module") else None)
        if b:
            pname, rest = b.groups()
            if pname == "partitioned":
                names.append(Name(f"{bullets_for.name}.partitioned", "property", sources=[page]))
                continue
            d = DEFAULT.search(rest)
            param: dict[str, Any] = {"name": pname}
            if d:
                param["default"] = _default(d.group(1))
            bullets_for.params = [p for p in bullets_for.params or [] if p["name"] != pname]
            bullets_for.params.append(param)
        elif line.strip().startswith("• partitioned"):
            names.append(Name(f"{bullets_for.name}.partitioned", "property", sources=[page]))
    return names


def documented_names(pages: dict[str, str]) -> list[dict[str, Any]]:
    """One entry per name over ``SIGNATURE_PAGES``, the longest parameter list kept."""
    by_name: dict[str, Name] = {}
    for page in SIGNATURE_PAGES:
        for n in parse_page(pages[page], page):
            if n.params is not None:
                n.params_from = page
            old = by_name.get(n.name)
            if old is None:
                by_name[n.name] = n
                continue
            sources = old.sources + [p for p in n.sources if p not in old.sources]
            if n.params and len(n.params) > len(old.params or []):
                by_name[n.name] = n
            by_name[n.name].sources = sources
    out = []
    for n in sorted(by_name.values(), key=lambda n: n.name):
        out.append({"name": n.name, "kind": n.kind, "behaviour": "present",
                    "params": n.params, "var_args": n.var_args,
                    "params_from": n.params_from, "sources": n.sources})
    return out


def mentions(pages: dict[str, str]) -> list[dict[str, Any]]:
    """Every ``smp.<name>`` of every page's prose and code, with the pages it is on."""
    code = "\n".join(re.findall(r"```\n(.*?)```", pages[SCRIPT_PAGE], flags=re.S))
    in_code = set(re.findall(r"\bsmp\.(\w+)", code))
    found: dict[str, list[str]] = {}
    for page, text in pages.items():
        for name in set(re.findall(r"\bsmp\.([A-Za-z_][\w.]*\w)", text)):
            found.setdefault(f"smp.{name}", []).append(page)
    return [{"name": name, "sources": sorted(found[name]),
             "in_script_code": name.split(".", 1)[1] in in_code}
            for name in sorted(found) if name not in TYPOS]


def imports(pages: dict[str, str]) -> list[dict[str, Any]]:
    """Every ``smdistributed`` import line of the pages, stripped, with its pages."""
    found: dict[str, list[str]] = {}
    for page, text in pages.items():
        for line in re.findall(r"^\s*((?:from|import) smdistributed[^\n]*)$", text, flags=re.M):
            pages_of = found.setdefault(line.strip(), [])
            if page not in pages_of:
                pages_of.append(page)
    return [{"line": line, "sources": sorted(found[line])} for line in sorted(found)]


def kept_facts() -> dict[str, Any]:
    """``used_sources`` and ``used`` from the committed data (see the module docstring)."""
    if not DATA.is_file():
        return {}
    old = json.loads(DATA.read_text())
    return {k: old[k] for k in ("used_sources", "used") if k in old}


def extract(folder: Path) -> dict[str, Any]:
    """The whole data document from the pages in ``folder`` (and the kept facts)."""
    missing = [p for p in PAGES if not (folder / p).is_file()]
    if missing:
        raise FileNotFoundError(f"SMP's documentation pages {missing} are not in {folder}")
    raw = {p: (folder / p).read_bytes() for p in PAGES}
    pages = {p: b.decode() for p, b in raw.items()}
    return {
        "schema": SCHEMA,
        "about": "Facts of SMP's documentation that tests/smp_fx/test_documented_api.py "
                 "checks smp-fx against; written by tests/data/extract_smp_api.py.",
        "pages": {p: {**PAGES[p], "sha256": hashlib.sha256(raw[p]).hexdigest()}
                  for p in PAGES},
        "names": documented_names(pages),
        "mentions": mentions(pages),
        "imports": imports(pages),
        "left_out": [{"name": n, "source": src, "reason": why}
                     for n, (src, why) in sorted(TYPOS.items())],
        **kept_facts(),
    }


def dumps(data: dict[str, Any]) -> str:
    """The file's text: stable, one value per line where it fits in 99 columns (so a
    changed fact is a one-line diff), ending in a newline."""
    return _format(data, 0) + "\n"


def _format(value: Any, indent: int) -> str:
    flat = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, (dict, list)) or not value or indent + len(flat) <= 99:
        return flat
    pad = " " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {_format(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + _format(v, indent + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def pages_folder() -> Path:
    """Where SMP's documentation pages are: ``SMP_FX_SEEDS_DIR``, else ``../shared/seeds``
    beside the checkout."""
    return Path(os.environ.get("SMP_FX_SEEDS_DIR") or REPO.parent / "shared" / "seeds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=Path, default=None,
                        help="folder of SMP's documentation pages (default: %(default)s, "
                             "i.e. SMP_FX_SEEDS_DIR or ../shared/seeds)")
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the data differs from the pages")
    args = parser.parse_args(argv)
    text = dumps(extract(args.pages or pages_folder()))
    if args.check:
        same = DATA.read_text() == text
        print(f"{DATA}: {'up to date' if same else 'out of date: run without --check'}")
        return 0 if same else 1
    DATA.write_text(text)
    print(f"wrote {DATA}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
