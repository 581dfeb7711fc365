"""Advice in the daemon's messages that names a protocol request.

A client of the daemon that offers its users something else (the command line's commands,
mcp serve's tools) says each in its own words, by replacing these very phrases (``ADVICE``:
every one of them); ``core.errors`` builds its messages with them.
"""

__all__ = ["ADD_KB", "ADVICE", "LIST_CONVERSATIONS", "LIST_KBS", "LIST_MODELS"]

LIST_CONVERSATIONS = "list them with the conversations request"
LIST_MODELS = "(the models request lists them)"
LIST_KBS = "kb_list shows the ones there are"
ADD_KB = "kb_add creates one"
ADVICE = (LIST_CONVERSATIONS, LIST_MODELS, LIST_KBS, ADD_KB)
