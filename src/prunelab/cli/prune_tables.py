"""The tables ``prune depth|sparsity|width`` print after pruning (0-based blocks)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from prunelab.cli.common import fmt_bytes, out


def show_depth(lm, rep, model: str, out_dir: Path, recovery: str) -> None:
    """Print what depth pruning did (0-based blocks)."""
    t = Table(title=f"depth pruning of {model}", show_header=False)
    div = "1 - cos (pooled)" if lm.is_encoder else "KL"
    b, a = rep["size_before"], rep["size_after"]
    hidden = {"beam", "selection_stability", "steps", "repaired_cuts", "repair_spans",
              "layer_values"}
    rows = [("removed blocks (0-based, original numbering)", str(rep["removed_blocks"])),
            ("blocks", f"{rep['num_blocks_before']} -> {rep['num_blocks_after']}"),
            ("selection", ", ".join(f"{k}={v}" for k, v in rep["selection"].items()
                                    if v is not None and k not in hidden))]
    if rep.get("removed_sublayers"):
        rows.append(("removed sub-blocks (0-based, original numbering)",
                     ", ".join(f"{i}:{'attn' if p == 'attention' else 'mlp'}"
                               for i, p in rep["removed_sublayers"])))
    stab = rep["selection"].get("selection_stability")
    if stab:
        rows.append(("selection stability", f"{stab['share_same']:.0%} of "
                     f"{stab.get('resamples', stab.get('bootstrap', '?'))} resamples give "
                     "the same blocks"))
    rows += [
            ("recovery", rep["recovery"]),
            ("parameters", f"{b['params']:,} -> {a['params']:,} "
                           f"({a['params'] / b['params']:.1%})"),
            ("bytes", f"{fmt_bytes(b['bytes'])} -> {fmt_bytes(a['bytes'])}"),
            (f"calibration {div} before recovery", f"{rep['calib_kl_before_recovery']:.5f}"),
            (f"calibration {div} after recovery", f"{rep['calib_kl_after_recovery']:.5f}"),
            ("checkpoint", str(out_dir))]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    if rep["needs_remote_code"]:
        from prunelab.checkpoint.remote import load_hint

        why = ("blocks that kept one branch" if rep.get("partial_blocks")
               else f"{recovery} adds linear bridges")
        out.print(f"note: {why}: load the checkpoint with {load_hint(lm.model)}")


def show_sparsity(lm, rep, model: str, out_dir: Path, method: str) -> None:
    """Print what sparsity pruning did (0-based blocks)."""
    t = Table(title=f"{method} sparsity of {model} (blocks 0-based)")
    for col in ("block", "target", "achieved (mean over linears)"):
        t.add_column(col)
    for layer in rep["layers"]:
        vals = list(layer["linears"].values())
        t.add_row(str(layer["block"]), f"{layer['target']:.4f}",
                  f"{sum(vals) / max(len(vals), 1):.4f}")
    out.print(t)
    out.print(f"achieved sparsity over pruned linears: {rep['achieved_sparsity']:.4f}; "
              f"{rep['seconds']:.1f} s; checkpoint {out_dir} (plain transformers)")


def show_width(lm, rep, model: str, out_dir: Path, unit: str, score: str, allocation: str) -> None:
    """Print what width pruning did (0-based blocks)."""
    t = Table(title=f"width pruning of {model}: {unit} by {score}, {allocation} "
                    "(blocks 0-based)")
    for col in ("block", "heads (q/kv)", "ffn", "removed"):
        t.add_column(col, overflow="fold")
    for b in rep["blocks"]:
        gone = []
        if b.get("removed_groups"):
            gone.append("groups " + ",".join(map(str, b["removed_groups"])))
        if "kept_query_heads" in b:
            gone.append("kept q heads " + str(b["kept_query_heads"]))
        if b.get("removed_channels") is not None:
            gone.append(f"{len(b['removed_channels'])} channels")
        t.add_row(str(b["block"]), f"{b['heads_before']}/{b['kv_heads_before']} -> "
                  f"{b['heads_after']}/{b['kv_heads_after']}",
                  f"{b['ffn_before']} -> {b['ffn_after']}", "; ".join(gone) or "-")
    out.print(t)
    bf, af = rep["size_before"], rep["size_after"]
    out.print(f"parameters {bf['params']:,} -> {af['params']:,} "
              f"({af['params'] / bf['params']:.1%}); bytes {fmt_bytes(bf['bytes'])} -> "
              f"{fmt_bytes(af['bytes'])}; compensation: "
              f"{len(rep['compensation']['least_squares'])} least-squares refits, "
              f"{len(rep['compensation']['bias'])} bias updates; {rep['seconds']:.1f} s")
    if rep["needs_remote_code"]:
        from prunelab.checkpoint.remote import load_hint

        out.print(f"note: per-block widths ({'; '.join(rep['vanilla_problems'])}): load "
                  f"{out_dir} with {load_hint(lm.model)}")
    else:
        out.print(f"checkpoint {out_dir} (plain transformers)")
