"""A sparsity method in one file, used from the command line without editing prunelab:

    prunelab --plugin examples/one_file_method.py prune sparsity --help
    prunelab --plugin examples/one_file_method.py prune sparsity --method input-power \\
        --power 2 --budget remove-weights:0.5 --model DIR --out OUT

(or ``PRUNELAB_PLUGINS=examples/one_file_method.py prunelab prune sparsity ...``). Its field
``power`` becomes the option ``--power`` with the help text below; ``tests/cli/test_cli_plugin.py``
runs it; a recipe uses it with ``plugins: [one_file_method.py]``
(``tests/workflow/test_workflow_recipe.py``).
"""
from dataclasses import dataclass, field

from prunelab.calib.stats import SumSquares
from prunelab.pruning import METHODS, SparsityConfig


@METHODS.register("input-power")
@dataclass(frozen=True)
class InputPower(SparsityConfig):
    """|W| times the input norm ||X_j|| to the power p (0: magnitude, 1: Wanda)"""

    power: float = field(default=1.0, metadata={
        "help": "input-power: exponent p of the input norm ||X_j|| in |W| * ||X_j||^p"})

    def accumulators(self):
        return lambda path: [SumSquares()]  # sum of x_j^2 over the calibration tokens

    def prune_weight(self, w, accs, sparsity):  # w: [d_out, d_in]
        norm = accs[0].sum_sq.to(w.device).sqrt()
        return w * self.keep_mask(w.abs() * norm ** self.power, sparsity)
