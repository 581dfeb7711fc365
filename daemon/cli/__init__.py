"""The command-line client's parts: rendering events for people (``render``), the manners
of a terminal and a pipe (``terminal``) and the interactive conversation (``chat``).

``daemon.client`` puts them together behind ``assistant.py``'s subcommands. Like it, they
use the standard library and ``core`` only: the system ``python3`` runs the client.
"""
