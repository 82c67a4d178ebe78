from gumiho.modeling.drafter import DraftModel, MedusaHeads, ParallelHeads, build_draft_model
from gumiho.modeling.vocab import DraftHead, draft_size, draft_vocabulary, set_draft_vocabulary

__all__ = ["DraftHead", "DraftModel", "MedusaHeads", "ParallelHeads", "build_draft_model",
           "draft_size", "draft_vocabulary", "set_draft_vocabulary"]
