"""Write docs/options.md: every registered method, probe, press, depth strategy and
recovery, width score and allocation, sparsity allocation, with each option's type, default
and help, read from the config dataclasses (the same metadata the CLI and recipes use); and
the options of `prunelab heal`.

Usage: python scripts/options_doc.py [--check]   (--check: exit 1 when the page is stale)"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "options.md"

INTRO = """# Options of every registered piece

Written by `python scripts/options_doc.py` from the config dataclasses (field, type,
default, the `help` of the field's metadata); `tests/test_options_doc.py` fails when it is
stale. The options are a recipe stage's keys and the Python configs' arguments; on the
command line `prunelab <command> --help` gives each one's spelling, and `--set KEY=VALUE`
reaches any of them. A method or piece registered by your own file is listed by the CLI and
taken by recipes the same way (see [adding-methods.md](adding-methods.md)).
"""


class _One:
    """A registry-like view of one config class (``heal``'s :class:`HealConfig`)."""

    def __init__(self, name: str, cls: type):
        self._name, self._cls = name, cls

    def names(self) -> list[str]:
        return [self._name]

    def get(self, name: str) -> type:
        return self._cls


def registries():
    """(title, registry) pairs, in reading order."""
    import prunelab.inference
    import prunelab.pruning  # noqa: F401 - importing the package registers every method
    from prunelab.heal import HealConfig
    from prunelab.inference.config import PRESSES
    from prunelab.probes.base import PROBES
    from prunelab.pruning.base import METHODS
    from prunelab.pruning.depth.recoveries.base import RECOVERIES
    from prunelab.pruning.depth.strategies.base import STRATEGIES
    from prunelab.pruning.sparsity.config import ALLOCATIONS
    from prunelab.pruning.width.allocation.base import WIDTH_ALLOCATIONS
    from prunelab.pruning.width.scoring.base import WIDTH_SCORES

    return [("Pruning methods (`prunelab prune ...`, recipe `prune` stages)", METHODS),
            ("Sparsity allocations (`--allocation`)", ALLOCATIONS),
            ("Depth selection strategies (`prune depth --strategy`)", STRATEGIES),
            ("Depth recoveries (`prune depth --recovery`)", RECOVERIES),
            ("Width scores (`prune width --score`)", WIDTH_SCORES),
            ("Width allocations (`prune width --allocation`)", WIDTH_ALLOCATIONS),
            ("Probes (`prunelab probe --probe`)", PROBES),
            ("Presses (`prunelab eval --press`; each option as `--press-OPTION`)", PRESSES),
            ("Healing (`prunelab heal`)", _One("heal", HealConfig))]


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        d = f.default
    elif f.default_factory is not dataclasses.MISSING:
        d = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(d):
        return f"`{getattr(type(d), 'registry_name', type(d).__name__)}`"
    return f"`{d!r}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def piece(name: str, cls: type) -> list[str]:
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    lines = [f"#### `{name}`", "", _cell(doc) or "(no description)", ""]
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
    if not fields:
        return lines + ["No options.", ""]
    lines += ["| option | type | default | help |", "|---|---|---|---|"]
    for f in fields:
        lines.append(f"| `{f.name}` | {_type(f)} | {_default(f)} | "
                     f"{_cell(f.metadata.get('help', ''))} |")
    return lines + [""]


def builtin(reg) -> list[str]:
    """The names of ``reg`` registered by prunelab itself (a user's file may add more in the
    same process), sorted."""
    return sorted(n for n in reg.names() if reg.get(n).__module__.startswith("prunelab."))


def render() -> str:
    out = [INTRO]
    for title, reg in registries():
        out += [f"## {title}", ""]
        for name in builtin(reg):
            out += piece(name, reg.get(name))
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        return 0 if OUT.exists() and OUT.read_text() == text else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
