"""prunelab.registry: the one registration style (``@REGISTRY.register(key, **meta)``) for
configs by name, plain objects by name and handlers by config type, and the one discovery
helper (``import_submodules``)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from prunelab.errors import ConfigError
from prunelab.registry import Registry, import_submodules

SRC = Path(__file__).resolve().parent.parent / "src" / "prunelab"


@dataclass(frozen=True)
class Base:
    x: int = 0


@dataclass(frozen=True)
class Child(Base):
    pass


@dataclass(frozen=True)
class GrandChild(Child):
    pass


def test_by_type_lookup_picks_the_nearest_registered_base():
    reg = Registry("handler", by_type=True)

    @reg.register(Base)
    def for_base(cfg):
        return "base"

    assert reg.for_config(GrandChild()) is for_base  # nearest: Base (Child not registered)

    @reg.register(Child)
    def for_child(cfg):
        return "child"

    assert reg.for_config(GrandChild()) is for_child  # now Child is nearer
    assert reg.for_config(Base()) is for_base
    assert reg.for_config(Child) is for_child  # a class works as well as an instance
    assert reg.names() == [Base, Child]


def test_by_type_instantiate_registers_one_instance_of_the_class():
    reg = Registry("pruner", by_type=True, instantiate=True)

    @reg.register(Base)
    class Handler:
        pass

    assert isinstance(Handler, type) and isinstance(reg.for_config(Child()), Handler)
    assert reg.for_config(Base()) is reg.for_config(GrandChild())


def test_by_type_miss_is_a_one_line_config_error():
    reg = Registry("handler", by_type=True)
    reg.register(Child)(lambda cfg: None)
    with pytest.raises(ConfigError, match=r"^no handler for Base; registered for: Child$"):
        reg.for_config(Base())
    custom = Registry("pruner", by_type=True, missing=lambda cls: f"nothing for {cls.__name__}")
    with pytest.raises(ConfigError, match=r"^nothing for Base$"):
        custom.for_config(Base())
    with pytest.raises(TypeError, match="config type"):
        reg.register("by-name")


def test_pruner_for_an_unregistered_config_lists_the_methods():
    from prunelab.pruning import METHODS, PRUNERS, Depth, SparsityConfig, pruner_for
    from prunelab.pruning.sparsity.methods import Wanda

    assert pruner_for(Wanda()) is PRUNERS.for_config(SparsityConfig)  # nearest base
    assert type(pruner_for(Depth(remove=1))).__name__ == "DepthPruner"
    with pytest.raises(ConfigError) as err:
        pruner_for(Base())
    assert str(err.value) == ("no pruning method for Base; registered: "
                              + ", ".join(METHODS.names()))


def test_unknown_name_error_lists_the_registered_names():
    reg = Registry("widget")

    @reg.register("a")
    @dataclass(frozen=True)
    class A:
        pass

    @reg.register("b", colour="red")
    @dataclass(frozen=True)
    class B:
        pass

    assert A.registry_name == "a" and reg.meta("b") == {"colour": "red"}
    with pytest.raises(ConfigError, match=r"^unknown widget 'c'; available: a, b$"):
        reg.get("c")
    with pytest.raises(TypeError, match="must be a dataclass"):
        reg.register("d")(type("D", (), {}))


def test_function_registry_holds_plain_functions_and_refuses_a_taken_name():
    reg = Registry("task metric", configs=False)

    @reg.register("double", description="twice")
    def double(x):
        return 2 * x

    assert reg.get("double") is double and reg.get("double")(3) == 6
    assert not hasattr(double, "registry_name")
    assert reg.meta("double") == {"description": "twice"} and list(reg) == ["double"]
    reg.register("double", description="twice")(double)  # the same object again: fine
    with pytest.raises(ConfigError, match=r"^task metric 'double' is already registered by "
                       r"test_registry.*double; test_registry.*<lambda> cannot take it"):
        reg.register("double")(lambda x: x)


def test_task_metrics_are_a_function_registry():
    from prunelab.eval.task_metric import TASK_METRICS, make_task_metric

    with pytest.raises(ConfigError, match=r"^unknown task metric 'nope' \(known: "):
        make_task_metric("nope", None)
    # (listed sorted in errors: their order is the order the family modules were imported)
    assert {"wer", "embed-cos", "knn-agree", "lfw-acc"} <= set(TASK_METRICS.names())
    assert TASK_METRICS.meta("wer")["description"].startswith("word error rate")


def _package(tmp_path, name: str, files: dict[str, str]) -> str:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for fname, text in files.items():
        (pkg / fname).write_text(text)
    return name


def test_import_submodules_imports_first_in_order_then_registering_modules_by_name(
        tmp_path, monkeypatch):
    body = ("import {0}.log as log\nlog.ORDER.append(__name__.rsplit('.', 1)[1])\n"
            "@log.REG.register('{1}')\nclass X:\n    pass\n")
    files = {"log.py": "from prunelab.registry import Registry\nORDER = []\n"
                       "REG = Registry('thing', configs=False)\n",
             "zeta.py": body.format("regpkg", "zeta"),
             "alpha.py": body.format("regpkg", "alpha"),
             "mid.py": body.format("regpkg", "mid"),
             "helper.py": "import regpkg.log as log\nlog.ORDER.append('helper')\n"
                          "text = '''\n    @log.REG.register(\"indented\")\n'''\n"}
    name = _package(tmp_path, "regpkg", files)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        order = import_submodules(name, first=("zeta",))
        log = sys.modules["regpkg.log"]
        assert order == ["zeta", "alpha", "mid"]  # helper does not register: not imported
        assert log.ORDER == ["zeta", "alpha", "mid"] and log.REG.names() == order
        assert "regpkg.helper" not in sys.modules
        with pytest.raises(ImportError, match="no submodule 'missing'"):
            import_submodules(name, first=("missing",))
    finally:
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]


def test_listing_orders_of_the_builtin_registries():
    """The order --help, docs/options.md and errors list the pieces in (set by the
    ``first`` arguments of the packages' import_submodules)."""
    from prunelab.probes import PROBES
    from prunelab.pruning import METHODS, RECOVERIES, STRATEGIES

    listed = [n for n in METHODS.names() if METHODS.get(n).__module__.startswith("prunelab.")]
    assert listed == [
        "depth", "width", "elastic", "svd-llm", "basis-sharing", "shared-dict", "slicegpt",
        "gates", "prunepath", "magnitude", "wanda", "sparsegpt", "rose", "qk-wanda", "admm",
        "cactus", "tokens"]
    assert STRATEGIES.names() == ["one-shot", "no-adjacent", "span", "iterative", "beam",
                                  "sleb", "blend", "last-n", "random", "validation"]
    assert RECOVERIES.names() == ["none", "foldable", "boundary", "ghost", "lra"]
    assert PROBES.names()[:3] == ["leave-one-out", "sublayer-ablation", "dla"]


_OTHER_FORMS = re.compile(
    r"register_pruner|register_task_metric|^\s*@register\(|_PRUNERS\b|pkgutil\.iter_modules"
    r"|#\s*noqa: F401 - registers", re.M)


def test_no_module_uses_another_registration_form():
    """One style: ``@REGISTRY.register(key, **meta)``, and ``import_submodules`` (the only
    pkgutil loop, in registry.py) instead of imports kept only to register."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "registry.py" and path.parent == SRC:
            continue
        for m in _OTHER_FORMS.finditer(path.read_text()):
            found.append(f"{path.relative_to(SRC)}: {m.group(0).strip()}")
    assert found == []


def test_from_dict_takes_only_true_or_false_for_a_bool_field():
    """YAML's ``"false"`` is a non-empty string: a recipe's method config must not turn
    it into a truthy value (every built-in bool field, e.g. width's ``compensate``)."""
    from prunelab.pruning import METHODS

    reg = Registry("widget")

    @reg.register("w")
    @dataclass(frozen=True)
    class W:
        on: bool = False
        n: int = 1

    assert reg.from_dict({"name": "w", "on": True}) == W(on=True)
    for bad in ("false", "true", 0, 1, None):
        with pytest.raises(ConfigError, match=rf"widget 'w': on must be true or false, "
                                              rf"got {re.escape(repr(bad))}"):
            reg.from_dict({"name": "w", "on": bad})
    with pytest.raises(ConfigError, match="compensate must be true or false, got 'false'"):
        METHODS.from_dict({"name": "width", "unit": "ffn", "ratio": 0.2,
                           "compensate": "false"})
    assert METHODS.from_dict({"name": "width", "unit": "ffn", "ratio": 0.2,
                              "compensate": False}).compensate is False
