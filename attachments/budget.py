"""How much extracted text goes to the model, and how several files share it.

Text blocks share half the free context, ``(ctx_max - ctx_used) / 2`` tokens at
3 characters a token, or 24000 characters when ``ctx_max`` is unknown (0: a caller
that knows no size; the daemon always passes the size known or assumed, ``assumed_ctx``
for a router that does not say); the other half stays for the question's own words
and the reply (docs/DESIGN.md, "Attachments").  Three characters a token is deliberately pessimistic (English
runs near four), so the budget errs towards leaving room for the reply.  The
budget counts the extracted text itself; block headers, page markers' notes and
image labels are small and not counted.

Several files share the budget by water-filling: every file is offered an equal
share of what is left; files that need less take only what they need, and what
they leave is shared again among the rest.  So three small files and one huge
log all arrive whole except the log, which gets everything that remains, and
two huge files get half each: one file can never starve the others.

The full extracted text kept for the recall tools is bounded separately by
``FULL_TEXT_CAP`` characters, so even a 10 GB log costs at most that much memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.tokens import BUDGET_CHARS_PER_TOKEN

__all__ = [
    "DEFAULT_BUDGET_CHARS",
    "FULL_TEXT_CAP",
    "budget_chars",
    "fair_shares",
]

# the budget when the model's context size is unknown: about what an empty 16k
# context gives (8,192 tokens at 3 characters a token)
DEFAULT_BUDGET_CHARS = 24_000
# the full text kept per document for attachment_recall: 2 Mi characters (about half a
# million tokens, beyond any local context; more only costs memory and disk)
FULL_TEXT_CAP = 2 * 1024 * 1024


def budget_chars(ctx_max: int, ctx_used: int) -> int:
    """Characters of extracted text one question may carry (never negative)."""
    if ctx_max <= 0:
        return DEFAULT_BUDGET_CHARS
    free_tokens = max(ctx_max - ctx_used, 0)
    return free_tokens // 2 * BUDGET_CHARS_PER_TOKEN


def fair_shares(needs: Sequence[int], budget: int) -> list[int]:
    """Split ``budget`` over files needing ``needs`` characters: small needs met, the rest split evenly.

    Each share is at most its need, and the shares sum to at most ``budget``.
    """
    shares = [0] * len(needs)
    remaining = max(budget, 0)
    order = sorted(range(len(needs)), key=lambda index: needs[index])
    for position, index in enumerate(order):
        offer = remaining // (len(order) - position)
        shares[index] = min(max(needs[index], 0), offer)
        remaining -= shares[index]
    return shares
