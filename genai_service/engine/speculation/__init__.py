"""Speculative decoding (docs/design.md, "Speculative decoding"): proposers
that guess a sequence's next tokens (``proposer.Proposer``: prompt lookup,
a draft model) and ``Speculation``, which picks a step's guesses and keeps
the tokens the target model itself chooses along them."""

from .draft_model import DraftModel
from .prompt_lookup import PromptLookup
from .proposer import MAX_BACKOFF_STEPS, Backoff, DraftWant, Proposer
from .speculator import Draft, Speculation, follow_draft

__all__ = [
    "MAX_BACKOFF_STEPS",
    "Backoff",
    "Draft",
    "DraftModel",
    "DraftWant",
    "PromptLookup",
    "Proposer",
    "Speculation",
    "follow_draft",
]
