from gumiho.modeling.drafter import DraftModel, MedusaHeads, ParallelHeads, build_draft_model

__all__ = ["DraftModel", "MedusaHeads", "ParallelHeads", "build_draft_model"]
