"""Loaded at start-up by the processes of ``benchmarks/sparsity_vs_llmcompressor.py`` when
``peer_llmcompressor.py`` runs it (``PYTHONPATH`` points here): that script calls
``prunelab.log.set_quiet`` after a bare ``import prunelab``, and the lazy root package does
not expose ``log`` as an attribute, so the submodule is imported here first. Harmless in
the llm-compressor venv, which has no prunelab. Drop it once the script imports
``prunelab.log`` itself."""

try:
    import prunelab.log  # noqa: F401
except ImportError:
    pass
