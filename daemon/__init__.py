"""The assistant daemon: the socket server, its protocol, the turn engine, and the client.

Import the part you use: ``daemon.server`` (``Server``, ``serve``) is the whole daemon,
with httpx, numpy and Pillow behind it; ``daemon.client`` is the command-line client,
which needs only the standard library and ``core``, so ``assistant.py ask`` starts fast.
"""
