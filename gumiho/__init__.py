"""Gumiho speculative decoding (Li et al., ICML 2025, arXiv 2503.10135).

The public names below load on first use, so `python -m gumiho.<command>` imports each
module once (no runpy warning) and Ctrl-C while torch imports prints one line.
"""

import importlib

from gumiho.errors import GumihoError, install_interrupt_hook

install_interrupt_hook()  # a command's Ctrl-C during its imports: `interrupted`, exit 130

_EXPORTS = {"ChatSession": "gumiho.chat", "Cycle": "gumiho.generate",
            "DraftTree": "gumiho.tree", "Drafter": "gumiho.drafters",
            "GenerateConfig": "gumiho.engine", "GenerationResult": "gumiho.engine",
            "PlainDrafter": "gumiho.drafters", "SpeculativeGenerator": "gumiho.generate",
            "Target": "gumiho.target", "load_drafter": "gumiho.drafters",
            "load_target": "gumiho.target"}

__all__ = ["ChatSession", "Cycle", "DraftTree", "Drafter", "GenerateConfig", "GenerationResult",
           "GumihoError", "PlainDrafter", "SpeculativeGenerator", "Target", "load_drafter",
           "load_target"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gumiho' has no attribute {name!r}")
