"""The shares of a context: reply caps, the prompt's limit, and cutting an oversize message."""

from __future__ import annotations

import pytest

from core import Budget, cut_text, estimate_messages, fit_message


def test_a_reply_is_capped_at_a_quarter_and_leaves_room_for_the_next_question() -> None:
    budget = Budget(8192)
    assert budget.reply_cap == 2048
    assert budget.reply_tokens(100) == 2048
    # a fuller prompt: what is left less an eighth kept for the next question
    assert budget.reply_tokens(6000) == 8192 - 6000 - 1024
    # never less than the smallest reply, which the prompt limit keeps room for
    assert budget.reply_tokens(budget.prompt_limit) == budget.min_reply == 1024
    assert budget.prompt_limit + budget.min_reply == 8192


def test_a_configured_cap_wins_but_never_passes_the_context() -> None:
    assert Budget(8192, max_reply_tokens=300).reply_tokens(100) == 300
    assert Budget(8192, max_reply_tokens=300).min_reply == 300
    assert Budget(1024, max_reply_tokens=100_000).reply_cap == 1023


@pytest.mark.parametrize("ctx", [512, 1024, 4096, 32768])
def test_prompt_and_reply_fit_the_context(ctx: int) -> None:
    budget = Budget(ctx)
    for prompt in range(0, budget.prompt_limit + 1, max(1, ctx // 50)):
        assert prompt + budget.reply_tokens(prompt) <= ctx
    assert budget.summary_tokens <= min(600, ctx // 8)


def test_cut_text_keeps_head_and_tail_and_says_where_the_rest_is() -> None:
    text = "".join(f"line {n}\n" for n in range(5000))
    cut = cut_text(text, 2000)
    assert cut.startswith("line 0\n") and cut.endswith("line 4999\n")
    assert len(cut) <= 2000 and "characters of this message are left out" in cut
    assert "conversation_search" in cut and "attachment_recall" in cut
    assert cut_text("short", 10) == "short" and cut_text("short", 0) == "short"
    assert cut_text(text, 2000) == cut  # the same cut every time: a server's cache keeps it


def test_fit_message_shares_the_cut_in_proportion_and_keeps_images() -> None:
    big = "x" * 40_000
    message = {"role": "user", "content": [
        {"type": "text", "text": "what does it say?"},
        {"type": "text", "text": big},
        {"type": "image_ref", "name": "a.png", "path": "/a.png", "sha256": "0"},
    ]}
    fitted = fit_message(message, 1000)
    parts = fitted["content"]
    assert parts[0]["text"] == "what does it say?"  # the question keeps its words
    assert parts[2] == message["content"][2]
    assert estimate_messages([{"role": "user", "content": parts[:2]}], 0) <= 1000 + 10
    assert message["content"][1]["text"] == big  # the stored message is not touched
    small = {"role": "assistant", "content": "fine"}
    assert fit_message(small, 1000) is small
    assert len(fit_message({"role": "assistant", "content": big}, 1000)["content"]) <= 4000
