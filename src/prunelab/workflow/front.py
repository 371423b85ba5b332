"""``prunelab front``: the served front of a model in llama.cpp, and which file to ship.

For one model it writes the dense quantization ladder (every type of ``types``, through
llama.cpp's own quantizer) and a grid of pruned models (:mod:`.front_grid`: depth, FFN and
head width, sub-blocks, slicing; each optionally healed by distillation from the dense
model) in every type of ``grid_types``, each quantized with an importance matrix gathered
from the model's own calibration when ``imatrix`` is on (the dense model and each pruned
model their own, so the comparison stays fair; :mod:`prunelab.calib.imatrix`). Every file
is measured inside llama.cpp the way ``benchmarks/llamacpp.py`` does: its size, the
perplexity of held-out windows from llama.cpp's own logits, and prompt and generation
tokens per second in rounds that measure every file once, the dense file of the same type
first, so a ratio compares two measurements seconds apart (median and range over rounds).
The files on the Pareto front of size vs perplexity and of generation speed vs perplexity
are marked (:mod:`.front_select`), and a target (``size:MIB``, ``speed:TOK_S``, ``ppl:X``)
is answered with the best file and how it was made.

The output folder (``OUT``)::

    front.json       settings, every model and file with its figures (the resume state)
    front.md / .csv  the table; front_size.png, front_speed.png the plots
    gguf/            every GGUF file (NAME.TYPE.gguf; NAME.f16.gguf is each model's source)
    imatrix/         each model's importance matrix (llama.cpp's GGUF imatrix form)

Each step (a model built and written as f16, a file quantized and measured, a speed round)
is recorded in ``front.json`` when it ends, atomically; a rerun with the same settings skips
what is recorded (after checking the file is still there with its size) and a rerun with
other settings is refused. ``--overwrite`` starts again, removing only what the front
wrote.
"""

from __future__ import annotations

from pathlib import Path

from prunelab.workflow.front_run import FrontRun
from prunelab.workflow.front_select import best_for, parse_target
from prunelab.workflow.front_state import FrontSettings, FrontState, load_front, make_settings
from prunelab.workflow.front_table import front_rows


def answer(front: dict, target: str) -> dict:
    """The best row of ``front`` for ``target`` (``size:MIB`` | ``speed:TOK_S`` |
    ``ppl:X``), with how its file was made."""
    kind, value = parse_target(target)
    return best_for(front_rows(front), kind, value)


def build_front(settings: FrontSettings, out: str | Path, overwrite: bool = False) -> dict:
    """Build (or resume) the front of ``settings`` in ``out``; returns ``front.json``'s
    content. See the module docstring."""
    return FrontRun(FrontState(Path(out), settings, overwrite)).run()


__all__ = ["FrontSettings", "answer", "build_front", "load_front", "make_settings"]
