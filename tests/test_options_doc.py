"""docs/options.md is the registries' own description: regenerated, it is unchanged (run
`python scripts/options_doc.py` after adding or changing an option)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("options_doc", ROOT / "scripts" /
                                                  "options_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_options_page_is_current():
    mod = _script()
    assert (ROOT / "docs" / "options.md").read_text() == mod.render(), \
        "docs/options.md is stale: run python scripts/options_doc.py"


def test_options_page_lists_every_registered_name():
    mod = _script()
    text = (ROOT / "docs" / "options.md").read_text()
    for _title, reg in mod.registries():
        for name in mod.builtin(reg):
            assert f"#### `{name}`" in text
