"""Tiny random models of every supported architecture, built in the tests (no download)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import types

import torch
import transformers as tf

VOCAB = 131  # 0..127 = ASCII code points, 128 = <s>, 129 = [UNK], 130 = <pad>

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
         "gpt2", "gpt_neox", "opt", "bert", "phi3")  # phi3: fused qkv_proj and gate_up_proj
ALL_ARCHS = ARCHS


def tiny_config(arch: str):
    """A 4-block config of ``arch`` with small dims; GQA (4 query, 2 KV heads) where the
    family supports it, sliding-window blocks for gemma2/gemma3."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=128)
    llama_like = dict(common, num_key_value_heads=2, head_dim=8)
    if arch == "llama":
        return tf.LlamaConfig(**llama_like)
    if arch == "mistral":
        return tf.MistralConfig(**llama_like, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**llama_like)
    if arch == "qwen3":
        return tf.Qwen3Config(**llama_like)
    if arch == "gemma":
        return tf.GemmaConfig(**llama_like)
    if arch == "gemma2":
        return tf.Gemma2Config(**llama_like, sliding_window=6, query_pre_attn_scalar=8)
    if arch == "gemma3_text":
        return tf.Gemma3TextConfig(
            **llama_like, sliding_window=6, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"],
        )
    if arch == "phi3":  # fused qkv_proj ([q; k; v], GQA) and gate_up_proj ([gate; up])
        return tf.Phi3Config(**dict(common, num_key_value_heads=2), bos_token_id=128,
                             eos_token_id=128, pad_token_id=130)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_inner=48,
                             n_positions=128)
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(**common)
    if arch == "opt":
        return tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                            num_attention_heads=4, ffn_dim=48, max_position_embeddings=128,
                            word_embed_proj_dim=32, pad_token_id=1)
    if arch == "bert":
        return tf.BertConfig(**common)
    raise KeyError(arch)


def tiny_model(arch: str, seed: int = 0):
    """A float32 random model of ``arch`` in eval mode, deterministic for ``seed``."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cls = tf.AutoModel if arch == "bert" else tf.AutoModelForCausalLM
    model = cls.from_config(cfg, attn_implementation="eager")
    # random init of norms is constant 1 / 0: perturb every parameter so that slicing and
    # reordering bugs cannot hide behind symmetric weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def tiny_tied_model(arch: str = "llama", heads: int = 4, hidden: int = 32, final_scale=None,
                    seed: int = 0):
    """A tiny causal LM whose head shares the embeddings' tensor, ``heads`` query heads of
    the tiny head size over a ``hidden``-wide stream (one KV group when the tiny KV count
    does not divide ``heads``), its final norm's scale far from constant (or the constant
    ``final_scale``)."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg.tie_word_embeddings = True
    cfg.num_attention_heads, cfg.hidden_size = heads, hidden
    if heads % cfg.num_key_value_heads:
        cfg.num_key_value_heads = 1
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        norm = model.model.norm.weight
        norm.copy_(torch.full_like(norm, final_scale) if final_scale is not None else
                   1.0 + torch.randn_like(norm) * 0.5)
    return model.eval()


def tiny_tokens(batch: int = 2, seqlen: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seqlen), generator=g)


def char_tokenizer():
    """A real ``PreTrainedTokenizerFast`` whose ids are ASCII code points (fits ``VOCAB``)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(128)}
    vocab.update({"<s>": 128, "[UNK]": 129, "<pad>": 130})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>",
                                   unk_token="[UNK]", pad_token="<pad>")


def save_tiny_checkpoint(arch: str, path, seed: int = 0):
    """Write a tiny random ``arch`` checkpoint with the char tokenizer to ``path``."""
    model = tiny_model(arch, seed)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. A small model reads this text and "
    "predicts each next character; pruning should change its loss only a little. "
) * 6


def cli_here(capsys, *args, cwd=None):
    """``prunelab ARGS`` run in this process (``cli_main``; output from ``capsys``): the same
    exit code and lines as :func:`cli`, without a new interpreter importing torch each time
    (see :func:`cli_inproc`)."""
    capsys.readouterr()
    rc = _cli_main_here(args, cwd)
    out, err = capsys.readouterr()
    return types.SimpleNamespace(returncode=rc, stdout=out, stderr=err)


def cli_inproc(*args, cwd=None, columns=120):
    """:func:`cli` run in this process, for the tests that are about what a command computes
    or writes, not about the process (exit on Ctrl-C, imports of ``--help``, a bug's exit 1:
    those keep :func:`cli`). stdout and stderr are Python's ``sys.stdout`` / ``sys.stderr``
    redirected to strings (the CLI prints through them, also its rich consoles), so no
    ``capsys`` is needed: module-scoped fixtures can run commands too. Saves the 3-5 s (one
    core) that every new interpreter spends importing torch and transformers."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = _cli_main_here(args, cwd, columns)
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def _cli_main_here(args, cwd, columns=120) -> int:
    """``cli_main(ARGS)`` with what a subprocess of :func:`cli` would see (``$COLUMNS``, the
    working folder ``cwd``); the process-wide switches a command sets (``--quiet``, the CLI
    state) are put back after it, so that they cannot leak into the next test."""
    from prunelab import log
    from prunelab.cli import cli_main
    from prunelab.cli.common import out, state

    saved_state, quiet, before = dict(state), log.is_quiet(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)
    # the rich consoles read $COLUMNS once, when first imported (maybe by an earlier test)
    consoles = [(c, c._width) for c in (out, log.console)]
    for c, _ in consoles:
        c.width = columns
    try:
        with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
            return cli_main([str(a) for a in args])
    finally:
        state.clear()
        state.update(saved_state)
        log.set_quiet(quiet)
        for c, width in consoles:
            c._width = width
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def cli(*args, cwd=None):
    """``python -m prunelab ARGS`` in a new interpreter (the process itself under test)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "prunelab", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def bpe_tokenizer():
    """A BPE tokenizer over the tiny vocabulary: ids are code points, except 1 and 2 (control
    characters), which are the merges "th" and "the" (llama.cpp wants merges)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(128)}
    del vocab[chr(1)], vocab[chr(2)]
    vocab.update({"th": 1, "the": 2, "<s>": 128, "[UNK]": 129, "<pad>": 130})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("t", "h"), ("th", "e")],
                               unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>",
                                   unk_token="[UNK]", pad_token="<pad>")
