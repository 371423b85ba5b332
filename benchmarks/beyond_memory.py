"""Larger than RAM, for real: ``--stream`` prunes of a ~14B-parameter checkpoint that does
not fit in this machine's memory (issue 41).

1. **The checkpoint.** A Llama-architecture model with random weights (seed ``--seed``) in
   bfloat16, written tensor by tensor (:mod:`prunelab.io.shard_writer`: one tensor in
   memory at a time) as safetensors shards of at most ``--shard-gb`` GB into
   ``DIR/model``. At the defaults -- hidden 5120, FFN 13824, 42 blocks, 40 heads and 40 KV
   heads (Llama-2-13B's block, two blocks more), vocabulary 49,152 (the tokenizer of the
   embedded SmolLM2, copied in so prunelab loads the checkpoint offline), untied head --
   that is **13,825,909,760 parameters = 27.65 GB** (25.75 GiB). Each weight matrix is
   ``normal(0, 0.02)`` drawn from its own generator (seeded from ``--seed`` and the
   tensor's name); norms are ones. A complete checkpoint of the same shape and seed already
   in ``DIR/model`` is reused (its ``beyond-memory.json`` records both); an interrupted
   write (``DIR/model.partial``) is started again.
2. **The runs**, each in a fresh process (this script with ``--job``, which runs the
   ``prunelab`` command line in-process) so its peak RSS is its own:
   ``prunelab prune sparsity --method wanda --budget remove-weights:0.5 --stream`` and
   ``prunelab prune depth --probe block-influence --budget remove-blocks:N --stream``, both
   ``--dtype bfloat16`` on ``--samples`` x ``--seqlen`` windows of ``wiki-vital:calib``.
3. **Reported per run:** peak RSS (``VmHWM`` of ``/proc/self/status``, as
   ``benchmarks/stream_memory.py`` reads it) in bytes and as a share of the checkpoint's
   bytes (goal: under 25 %); wall time in total and per block for each pass over the
   blocks (timed with a listener on the streamer's block loads); bytes read from storage
   (``read_bytes`` of ``/proc/self/io``: page-ins of the memory-mapped shards count) and
   ``rchar`` (read system calls only), and bytes written. The table goes to stdout and,
   with the command, machine, commit and a projection to a 70B model, to ``--results``
   (default ``benchmarks/results/beyond-memory.md``, written atomically).

**Random weights make perplexity meaningless here**: this measures memory, time and I/O
only. Quality at scale is checked on real weights with Qwen2.5-Coder-1.5B
(``benchmarks/stream_memory.py --model qwen2.5-coder-1.5b``).

**Disk.** ``DIR`` (default ``/tmp/prunelab-beyond-memory``) needs the checkpoint's bytes
(27.65 GB at the defaults) plus, while a run goes on, about the checkpoint's bytes again:
the pruned blocks are staged beside the output and moved into it as it is saved (the
CLI's ``--stream`` consumes its staging), so staging plus output peak near one model.
Outputs are deleted once measured unless ``--keep`` (then each kept output stays: about
28 GB for sparsity, 25 GB for depth). Free space is checked before writing and before each
run; a run that would not fit is refused with one ``error:`` line.

Run (on the 2-core machine: 5 min to write the checkpoint, once; then about 17 min for the
sparsity run and 6 min for the depth run at a load average of about 3, 36 and 6.5 min at a
load average of 8)::

    nohup python benchmarks/beyond_memory.py [--dir /tmp/prunelab-beyond-memory]
        [--runs sparsity,depth] [--samples 4 --seqlen 128] [--remove 4] [--keep]
        > /tmp/beyond.log 2>&1 &
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "beyond-memory.json"
INIT_STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja")


@dataclass(frozen=True)
class Shape:
    """A Llama checkpoint's shape (head dim = hidden / heads; untied LM head)."""

    layers: int = 42
    hidden: int = 5120
    intermediate: int = 13824
    heads: int = 40
    kv_heads: int = 40
    vocab: int = 49152

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h

    def params(self) -> int:
        return self.layers * self.block_params() + 2 * self.vocab * self.hidden + self.hidden


def tensor_specs(shape: Shape):
    """Every tensor of the checkpoint, in the order written (embeddings, blocks, final
    norm, head), as :class:`prunelab.io.shard_writer.TensorSpec` in bfloat16."""
    import torch

    from prunelab.io.shard_writer import TensorSpec

    h, kv, f = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    specs = [TensorSpec("model.embed_tokens.weight", (shape.vocab, h), torch.bfloat16)]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        for name, dims in (("input_layernorm", (h,)), ("self_attn.q_proj", (h, h)),
                           ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                           ("self_attn.o_proj", (h, h)), ("post_attention_layernorm", (h,)),
                           ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)),
                           ("mlp.down_proj", (h, f))):
            specs.append(TensorSpec(f"{p}{name}.weight", dims, torch.bfloat16))
    specs.append(TensorSpec("model.norm.weight", (h,), torch.bfloat16))
    specs.append(TensorSpec("lm_head.weight", (shape.vocab, h), torch.bfloat16))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: from ``seed`` and its name (so every tensor can be
    regenerated alone, in any order)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def make_tensor(spec, seed: int):
    """One tensor's values: ones for a norm, ``normal(0, INIT_STD)`` in bfloat16 otherwise."""
    import torch

    if len(spec.shape) == 1:
        return torch.ones(spec.shape, dtype=spec.dtype)
    gen = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    return torch.empty(spec.shape, dtype=spec.dtype).normal_(0.0, INIT_STD, generator=gen)


def default_tokenizer_dir() -> Path:
    """The embedded SmolLM2's converted checkpoint (its tokenizer is copied)."""
    from prunelab.models.loading import resolve_source

    return Path(resolve_source("smollm2-135m"))


def _tokenizer_facts(tokenizer_dir: Path) -> dict:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    return {"vocab": len(tok), "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id}


def _marker_for(shape: Shape, seed: int, shard_bytes: int) -> dict:
    return {"shape": asdict(shape), "seed": seed, "dtype": "bfloat16", "init_std": INIT_STD,
            "max_shard_bytes": shard_bytes, "params": shape.params(),
            "bytes": 2 * shape.params()}


def _complete(folder: Path, want: dict) -> bool:
    """Whether ``folder`` holds a complete checkpoint written with ``want``."""
    try:
        have = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if {k: have.get(k) for k in want} != want:
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size
               for name, size in have.get("files", {}).items())


def _ours(folder: Path) -> bool:
    return (folder / MARKER).is_file() or not any(folder.iterdir())


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def write_checkpoint(folder: Path, shape: Shape, seed: int = 0,
                     tokenizer_dir: Path | None = None,
                     shard_bytes: int = 2 * 10**9) -> dict:
    """Write (or reuse) the random checkpoint in ``folder``; returns its marker plus
    ``reused`` and ``write_s``. ``shape.vocab`` must be the tokenizer's size (see
    :func:`shape_for_tokenizer`). Written into ``folder.partial``, renamed when complete;
    one tensor in memory at a time."""
    import transformers

    from prunelab.io.shard_writer import write_sharded

    folder = Path(folder)
    want = _marker_for(shape, seed, shard_bytes)
    if _complete(folder, want):
        return json.loads((folder / MARKER).read_text()) | {"reused": True}
    if folder.exists() and not _ours(folder):
        _fail(f"{folder} exists and was not written by this script: choose another --dir")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else default_tokenizer_dir()
    facts = _tokenizer_facts(tokenizer_dir)
    if facts["vocab"] != shape.vocab:
        _fail(f"the vocabulary ({shape.vocab}) must be the tokenizer's size "
              f"({facts['vocab']}, {tokenizer_dir})")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    free = shutil.disk_usage(partial).free + (_size(folder) if folder.exists() else 0)
    if free < want["bytes"] + 10**9:
        shutil.rmtree(partial, ignore_errors=True)
        _fail(f"the checkpoint needs {want['bytes'] / 1e9:.2f} GB (+1 GB) on "
              f"{folder.parent}, {free / 1e9:.2f} GB free: choose another --dir")
    start = time.perf_counter()
    cfg = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=facts["bos_token_id"], eos_token_id=facts["eos_token_id"],
        initializer_range=INIT_STD, dtype="bfloat16", architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(partial)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, partial / name)
    done = [0]

    def produce(spec):
        done[0] += 1
        if done[0] % 50 == 0:
            print(f"  writing: {done[0]} tensors after {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
        return make_tensor(spec, seed)

    write_sharded(partial, tensor_specs(shape), produce, max_shard_bytes=shard_bytes)
    files = {p.name: p.stat().st_size for p in sorted(partial.glob("*.safetensors"))}
    marker = want | {"files": files, "tokenizer_from": str(tokenizer_dir),
                     "written": datetime.datetime.now().isoformat(timespec="seconds"),
                     "write_s": round(time.perf_counter() - start, 1)}
    _atomic_write(partial / MARKER, json.dumps(marker, indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(partial, folder)
    return marker | {"reused": False}


def shape_for_tokenizer(shape: Shape, tokenizer_dir: Path | None) -> Shape:
    """``shape`` with the vocabulary of the tokenizer in ``tokenizer_dir`` (default: the
    embedded SmolLM2's, 49,152)."""
    import dataclasses

    vocab = _tokenizer_facts(Path(tokenizer_dir) if tokenizer_dir else
                             default_tokenizer_dir())["vocab"]
    return dataclasses.replace(shape, vocab=vocab)


def _size(path: Path) -> int:
    """Bytes of the files under ``path`` (files that vanish meanwhile count 0)."""
    total = 0
    try:
        for p in Path(path).rglob("*"):
            try:
                total += p.stat().st_size if p.is_file() else 0
            except OSError:
                pass
    except OSError:  # a folder removed while walked
        pass
    return total


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- the job
def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    """``VmHWM`` (peak RSS since exec) of this process; ``ru_maxrss`` as a fallback."""
    try:
        return _status_kb("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _io() -> dict[str, int]:
    try:
        rows = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, v in (r.split(": ") for r in rows)}


def _job(args) -> dict:
    """Run the ``prunelab`` command line (``args.cmd``) in this fresh process: peak RSS,
    I/O, the streamer's block loads / frees (timestamps) and an RSS timeline."""
    t0 = time.perf_counter()
    io0 = _io()
    import torch  # noqa: F401 - counted as imports, as in stream_memory.py
    import transformers  # noqa: F401

    from prunelab.cli import cli_main
    from prunelab.models import streaming

    rss_imports = _peak_rss()
    events: list[tuple[float, str, int]] = []
    before_blocks: list[int] = []  # VmHWM when the first block is about to be read
    init, acquire = streaming.Streamer.__init__, streaming.Streamer.acquire

    def timed_init(self, *a, **kw):  # a listener on every streamer the command makes
        init(self, *a, **kw)
        self.listeners.append(lambda ev, i: events.append((time.perf_counter() - t0, ev, i)))

    def first_acquire(self, block):
        if not before_blocks:
            before_blocks.append(_peak_rss())
        return acquire(self, block)

    streaming.Streamer.__init__ = timed_init
    streaming.Streamer.acquire = first_acquire
    timeline: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample():
        while not stop.wait(1.0):
            timeline.append((round(time.perf_counter() - t0, 1), _status_kb("VmRSS")))

    threading.Thread(target=sample, daemon=True).start()
    try:
        rc = cli_main(args.cmd)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    stop.set()
    io1 = _io()
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "peak_rss_bytes": _peak_rss(),
            "rss_imports_bytes": rss_imports, "events": events, "rss_timeline": timeline,
            "peak_before_blocks_bytes": before_blocks[0] if before_blocks else None,
            "io": {k: io1[k] - io0.get(k, 0) for k in io1}}


def _spawn(cmd: list[str], threads: int, watch: Path) -> dict:
    """Run one job; meanwhile every 5 s the bytes of the files under ``watch`` (the
    run's staging and output) and the load average are sampled here."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONWARNINGS="ignore")
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    disk, load = [0], []
    try:
        proc = subprocess.Popen([sys.executable, __file__, "--job", "--result", result, "--",
                                 *cmd], env=env)
        while proc.poll() is None:
            disk.append(_size(watch))
            load.append(os.getloadavg()[0])
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if proc.returncode != 0 or not Path(result).stat().st_size:
            _fail(f"the job {' '.join(cmd)} failed (exit {proc.returncode}; its output is "
                  "above)")
        out = json.loads(Path(result).read_text())
        if out["rc"] != 0:
            _fail(f"prunelab {' '.join(cmd)} exited {out['rc']} (its error is above)")
        return out | {"peak_disk_bytes": max(disk),
                      "load_avg": sum(load) / len(load) if load else os.getloadavg()[0]}
    finally:
        Path(result).unlink(missing_ok=True)


def passes(events: list, n_blocks: int) -> list[dict]:
    """The block loads split into passes over the stack (a pass starts again when a load's
    block index is not above the previous one's): blocks, start, end (the last free), s
    per block."""
    out: list[dict] = []
    last = None
    for t, ev, i in events:
        if ev == "load":
            if last is None or i <= last:
                out.append({"blocks": 0, "start": t, "end": t, "first": i})
            out[-1]["blocks"] += 1
            last = i
        if out:
            out[-1]["end"] = t
    for p in out:
        p["seconds"] = p["end"] - p["start"]
        p["s_per_block"] = p["seconds"] / p["blocks"] if p["blocks"] else float("nan")
    return out


# ----------------------------------------------------------------------------- the driver
RUNS = ("sparsity", "depth", "depth-first", "depth-middle", "depth-last")
#: depth runs that remove ``--remove`` given blocks (no probe): where they sit in the stack
PLACED = {"depth-first": "first", "depth-middle": "middle", "depth-last": "last"}


def placed_blocks(where: str, layers: int, remove: int) -> list[int]:
    """``remove`` consecutive 0-based blocks at the start, middle or end of ``layers``."""
    start = {"first": 0, "middle": (layers - remove) // 2, "last": layers - remove}[where]
    return list(range(start, start + remove))


def _command(run: str, model: Path, out: Path, args) -> list[str]:
    common = ["--model", str(model), "--out", str(out), "--stream", "--dtype", "bfloat16",
              "--samples", str(args.samples), "--seqlen", str(args.seqlen),
              "--batch-size", str(args.samples)]
    if run == "sparsity":
        return ["prune", "sparsity", "--method", "wanda",
                "--budget", f"remove-weights:{args.sparsity}", *common]
    if run in PLACED:
        blocks = placed_blocks(PLACED[run], args.layers, args.remove)
        return ["prune", "depth", "--blocks", ",".join(map(str, blocks)), *common]
    return ["prune", "depth", "--probe", "block-influence",
            "--budget", f"remove-blocks:{args.remove}", *common]


def _needed(run: str, shape: Shape, args) -> int:
    """Disk a run needs while it goes on: the staged blocks plus the output (which takes
    their place as it is written), the side units, two blocks' slack and 2 GB."""
    model = 2 * shape.params()
    return model + 2 * 2 * shape.block_params() + 2 * 10**9


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    mem = _status_meminfo()
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} cores ({cpu}), {mem / 2**30:.1f} GiB RAM "
            f"({mem / 1e9:.1f} GB), {platform.system()} {platform.release()}")


def _status_meminfo() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f}"


def _ratio(written: int, out: int) -> str:
    """Bytes written per byte of output (``2.98x``)."""
    return f"{written / out:.2f}x" if out else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) /
                   "prunelab-beyond-memory", help="checkpoint (DIR/model) and run outputs")
    p.add_argument("--layers", type=int, default=Shape.layers)
    p.add_argument("--hidden", type=int, default=Shape.hidden)
    p.add_argument("--intermediate", type=int, default=Shape.intermediate)
    p.add_argument("--heads", type=int, default=Shape.heads)
    p.add_argument("--kv-heads", type=int, default=Shape.kv_heads)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--runs", default="sparsity,depth",
                   help="comma-separated: sparsity, depth (blocks chosen by the probe), "
                        "depth-first / depth-middle / depth-last (--remove given blocks)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--remove", type=int, default=4, help="blocks the depth run removes")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--keep", action="store_true", help="keep the runs' outputs")
    p.add_argument("--write-only", action="store_true", help="write the checkpoint, no runs")
    p.add_argument("--results", type=Path,
                   default=ROOT / "benchmarks" / "results" / "beyond-memory.md")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("cmd", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        Path(args.result).write_text(json.dumps(_job(args)))
        return
    runs = [r for r in args.runs.split(",") if r]
    if any(r not in RUNS for r in runs):
        _fail(f"--runs takes {', '.join(RUNS)}, got {args.runs!r}")
    shape = shape_for_tokenizer(Shape(args.layers, args.hidden, args.intermediate, args.heads,
                                      args.kv_heads), None)
    model_dir = args.dir / "model"
    model_bytes = 2 * shape.params()
    print(f"checkpoint: {model_dir}: Llama, {shape.layers} blocks, hidden {shape.hidden}, "
          f"FFN {shape.intermediate}, {shape.heads} heads / {shape.kv_heads} KV heads, "
          f"vocabulary {shape.vocab}, untied head: {shape.params():,} parameters = "
          f"{_gb(model_bytes)} GB bfloat16 ({model_bytes / 2**30:.2f} GiB; RAM "
          f"{_status_meminfo() / 2**30:.2f} GiB)", flush=True)
    print(f"disk: {_gb(model_bytes)} GB for the checkpoint, about "
          f"{_gb(_needed('sparsity', shape, args))} GB more during each run; "
          f"{_gb(shutil.disk_usage(args.dir if args.dir.exists() else args.dir.parent).free)}"
          " GB free now", flush=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    info = write_checkpoint(model_dir, shape, args.seed, shard_bytes=int(args.shard_gb * 1e9))
    how = (f"reused (written in {info['write_s']:.0f} s by an earlier run)" if info["reused"]
           else f"written in {info['write_s']:.0f} s")
    print(f"checkpoint {how}: {len(info['files'])} shards", flush=True)
    if args.write_only:
        return
    args.commit = _git_commit()  # the code the runs use (HEAD may move meanwhile)
    rows = []
    for run in runs:
        out = args.dir / "runs" / run
        out.parent.mkdir(exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)  # a leftover of an interrupted run of ours
        for stale in out.parent.glob(".prunelab-stream-*"):
            shutil.rmtree(stale, ignore_errors=True)
        need, free = _needed(run, shape, args), shutil.disk_usage(out.parent).free
        if free < need:
            _fail(f"the {run} run needs about {_gb(need)} GB free on {out.parent} (staged "
                  f"blocks, then the output in their place), {_gb(free)} GB free: free "
                  "space or choose another --dir")
        cmd = _command(run, model_dir, out, args)
        print(f"\n== {run}: prunelab {' '.join(cmd)}", flush=True)
        row = _spawn(cmd, args.threads, out.parent)
        row.update(run=run, command="prunelab " + " ".join(cmd), out_bytes=_size(out),
                   passes=passes(row["events"], shape.layers))
        row.pop("events")
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
        rows.append(row)
        _print_row(row, model_bytes)
    text = report(rows, shape, info, args)
    print("\n" + text)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(args.results, text)
    print(f"results: {args.results}")


def _print_row(r: dict, model_bytes: int) -> None:
    print(f"{r['run']}: peak RSS {r['peak_rss_bytes']:,} B ({r['peak_rss_bytes'] / 2**30:.2f} "
          f"GiB) = {100 * r['peak_rss_bytes'] / model_bytes:.2f} % of the model (before the "
          f"blocks {_base(r) / 2**30:.2f} GiB, imports {r['rss_imports_bytes'] / 2**30:.2f} "
          f"GiB); wall "
          f"{r['wall_s']:.0f} s; read {_gb(r['io'].get('read_bytes', 0))} GB from storage; "
          f"wrote {_gb(r['io'].get('write_bytes', 0))} GB "
          f"({_ratio(r['io'].get('write_bytes', 0), r['out_bytes'])} the output's "
          f"{_gb(r['out_bytes'])} GB); peak disk (staging + output) "
          f"{_gb(r['peak_disk_bytes'])} GB; load average {r['load_avg']:.1f}", flush=True)
    for k, ps in enumerate(r["passes"], 1):
        print(f"  pass {k}: {ps['blocks']} blocks in {ps['seconds']:.0f} s = "
              f"{ps['s_per_block']:.1f} s/block", flush=True)


# ----------------------------------------------------------------------------- the report
LLAMA_70B = Shape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8,
                  vocab=128256)


def _pass_names(run: str, n: int) -> list[str]:
    """What each pass over the blocks is: the method's pass first, the save last; depth's
    middle pass scores the pruned stack (its calibration KL)."""
    if run in PLACED:  # given blocks: the dense pass (KL reference) instead of the probe
        first = "dense outputs"
    else:
        first = "calibrate + prune" if run == "sparsity" else "probe"
    middle = "KL of the pruned model" if run.startswith("depth") else "pass"
    return ([first] + [middle] * max(n - 2, 0) + ["save"])[:n] if n > 1 else [first]


def _base(r: dict) -> int:
    """Peak RSS before the first block was read (imports, tokenized calibration data,
    the embeddings' capture pass)."""
    return r.get("peak_before_blocks_bytes") or r["peak_rss_bytes"]


def report(rows: list[dict], shape: Shape, info: dict, args) -> str:
    """The results page (markdown)."""
    model_bytes = 2 * shape.params()
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        "# Results: larger than RAM, for real (`--stream` on a 14B checkpoint)", "",
        f"Measured on {now} (finished) at commit `{args.commit}` by "
        "[`benchmarks/beyond_memory.py`](../beyond_memory.py); machine: "
        f"{_machine()}. The machine is shared with other sessions (the mean 1-minute load "
        "average during each run is in the table), so wall times are indicative; memory, "
        "disk and bytes read are not affected by the load.", "",
        "**Random weights**: the checkpoint is a Llama model whose weights are drawn at "
        "random, so its perplexity (and the quality of any pruned model of it) means "
        "nothing; these runs measure memory, time and disk only. Pruning quality at scale "
        "is checked on real weights with Qwen2.5-Coder-1.5B ([scale.md](scale.md)).", "",
        "## The checkpoint", "",
        f"Llama, {shape.layers} blocks, hidden {shape.hidden}, FFN {shape.intermediate}, "
        f"{shape.heads} heads / {shape.kv_heads} KV heads, vocabulary {shape.vocab} (the "
        "embedded SmolLM2's tokenizer), untied head: "
        f"**{shape.params():,} parameters = {_gb(model_bytes)} GB in bfloat16** "
        f"({model_bytes / 2**30:.2f} GiB, {model_bytes / _status_meminfo():.2f}x this "
        f"machine's RAM); {shape.block_params():,} parameters "
        f"({_gb(2 * shape.block_params())} GB) per block; {len(info['files'])} shards of at "
        f"most {args.shard_gb:g} GB; seed {args.seed}, weights normal(0, {INIT_STD}), norms "
        f"ones. Written tensor by tensor with `prunelab.io.shard_writer` in "
        f"{info.get('write_s', 0):.0f} s" + (" (by an earlier run; reused here)"
                                             if info["reused"] else "") + ".", "",
        "## Runs", "",
        "Each run is a fresh process (`beyond_memory.py --job`, the `prunelab` command line "
        f"in-process) with {args.threads} threads; calibration: {args.samples} x "
        f"{args.seqlen} tokens of `wiki-vital:calib` (seed 0). Peak RSS is the process's "
        "`VmHWM`; bytes read are `read_bytes` of `/proc/self/io` (storage reads, page-ins "
        "of the memory-mapped shards included); per-block times come from the streamer's "
        "block loads (a pass is one sweep over the blocks).", "",
    ]
    for r in rows:
        lines += [f"- {r['run']}: `{r['command']}`"]
    lines += [
        "", "| run | peak RSS (bytes) | peak RSS GiB | / model bytes | imports GiB | "
        "before the blocks GiB | wall s | before the blocks s | passes: blocks x s per "
        "block | read from storage GB | rchar GB | written GB | output GB | written / output "
        "| peak disk GB (staging + output) | load avg |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: |"]
    for r in rows:
        names = _pass_names(r["run"], len(r["passes"]))
        per = "; ".join(f"{nm} {ps['blocks']} x {ps['s_per_block']:.1f}"
                        for nm, ps in zip(names, r["passes"], strict=True))
        io = r["io"]
        start = r["passes"][0]["start"] if r["passes"] else float("nan")
        lines.append(
            f"| {r['run']} | {r['peak_rss_bytes']:,} | {r['peak_rss_bytes'] / 2**30:.2f} | "
            f"**{100 * r['peak_rss_bytes'] / model_bytes:.2f} %** | "
            f"{r['rss_imports_bytes'] / 2**30:.2f} | {_base(r) / 2**30:.2f} | "
            f"{r['wall_s']:.0f} | {start:.0f} | {per} | {_gb(io.get('read_bytes', 0))} | "
            f"{_gb(io.get('rchar', 0))} | {_gb(io.get('write_bytes', 0))} | "
            f"{_gb(r['out_bytes'])} | {_ratio(io.get('write_bytes', 0), r['out_bytes'])} | "
            f"{_gb(r['peak_disk_bytes'])} | {r['load_avg']:.1f} |")
    lines += ["", "Imports: `VmHWM` after importing torch, transformers and prunelab; before "
              "the blocks: `VmHWM` when the first block is about to be read (the imports, "
              "the model's skeleton and tokenizer, the tokenized calibration corpus, the "
              "embeddings read for the capture pass); the rest of the peak is the block "
              "resident at the time and its work. Peak disk: the most bytes of files under "
              "the runs' folder (the staged blocks and the output), sampled every 5 s."]
    goal = [r for r in rows if r["peak_rss_bytes"] >= 0.25 * model_bytes]
    lines += ["", "Goal: peak RSS under 25 % of the model's bytes "
              f"({_gb(0.25 * model_bytes)} GB): "
              + ("**met** by every run." if not goal else "**missed** by "
                 + ", ".join(f"{r['run']} ({100 * r['peak_rss_bytes'] / model_bytes:.2f} %)"
                             for r in goal) + "."), ""]
    lines += _projection(rows, shape)
    return "\n".join(lines) + "\n"


def _projection(rows: list[dict], shape: Shape) -> list[str]:
    big = LLAMA_70B
    ratio = big.block_params() / shape.block_params()
    big_bytes = 2 * big.params()
    out = ["## Projection to a 70B model", "",
           f"A Llama-70B-shaped model (80 blocks, hidden 8192, FFN 28672, 64 heads / 8 KV "
           f"heads, vocabulary 128256): {big.params():,} parameters = {_gb(big_bytes)} GB "
           f"in bfloat16; {big.block_params():,} parameters per block, {ratio:.2f}x the "
           "measured block. Per-block time scales with the block's parameters (the matmuls "
           "over a fixed number of tokens, Wanda's per-row selection and the bytes read and "
           "written all grow with them): 70B time = 80 x ratio x the measured time of all "
           "passes per block of the stack. Memory: the part before the blocks grows by "
           f"the larger embeddings ({_gb(2 * big.vocab * big.hidden)} GB instead of "
           f"{_gb(2 * shape.vocab * shape.hidden)} GB in bfloat16), the rest of the peak "
           "(the block and its work) by the ratio. These are linear extrapolations from "
           "one measurement, not measurements.", "",
           "| run | measured s / block (all passes) | 70B: s / block | 70B: hours (80 "
           "blocks) | measured: before blocks + block part GiB | 70B: projected peak GiB "
           "| / 70B bytes |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        per = sum(ps["seconds"] for ps in r["passes"]) / shape.layers
        base, part = _base(r), r["peak_rss_bytes"] - _base(r)
        base70 = base + 2 * (big.vocab * big.hidden - shape.vocab * shape.hidden)
        peak70 = base70 + ratio * part
        out.append(f"| {r['run']} | {per:.1f} | {ratio * per:.1f} | "
                   f"{80 * ratio * per / 3600:.1f} | {base / 2**30:.2f} + "
                   f"{part / 2**30:.2f} | {peak70 / 2**30:.1f} | "
                   f"{100 * peak70 / big_bytes:.1f} % |")
    out += ["", "**One machine.** The run needs the checkpoint on disk "
            f"({_gb(big_bytes)} GB) plus about as much free while it runs (staged blocks, "
            "then the output in their place), RAM for one block and its work (the "
            "projected peak above), and time roughly proportional to the parameters at the "
            "per-block rate above (disk throughput and the CPU's matmul speed set it; a GPU "
            "with `--device cuda --stream` computes each block there while the weights "
            "stay on the host).", "",
            "**A Ray cluster.** prunelab's Ray support (`--ray` on `sweep depth`, `compare` "
            "and `run`; `prunelab.workflow.ray_backend`) distributes *points* of a study "
            "(a sparsity level, a depth budget, a recipe stage) as whole tasks, one per "
            "worker; it does not split one prune's blocks across machines (each block's "
            "calibration input is the previous block's output, so one prune is sequential). "
            "Those points load the model resident (the workflow commands have no "
            "`--stream`), so today a 70B study on Ray needs workers that hold the whole "
            f"model ({_gb(big_bytes)} GB in bfloat16); N such workers run N points in the "
            "time of one. Streamed points on Ray would need `--stream` in the workflow "
            "stages and the checkpoint on a filesystem every node mounts (each point reads "
            "it once per pass); each point would then take the one-machine time above with "
            "the one-machine memory.", ""]
    return out


if __name__ == "__main__":
    main()
