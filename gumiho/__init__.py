"""Gumiho speculative decoding (Li et al., ICML 2025, arXiv 2503.10135)."""

from gumiho.drafters import Drafter, PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, GenerationResult
from gumiho.errors import GumihoError
from gumiho.generate import SpeculativeGenerator
from gumiho.target import Target, load_target
from gumiho.tree import DraftTree

__all__ = ["DraftTree", "Drafter", "GenerateConfig", "GenerationResult", "GumihoError",
           "PlainDrafter", "SpeculativeGenerator", "Target", "load_drafter", "load_target"]
