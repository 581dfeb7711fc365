"""The assistant daemon: the socket server, its protocol and the turn engine.

Import the part you use: ``daemon.server`` (``Server``, ``serve``) is the whole daemon,
with httpx, numpy and Pillow behind it. Its clients are in ``client``, which this
package never imports.
"""
