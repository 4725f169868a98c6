"""Weight layouts and transport between the trainer (HF layout) and the generator (vLLM layout).

Modules are imported by name (``forge_ext.weights.convert``, ...); this package file stays
empty so that one module's optional dependencies never break another's import.
"""
