"""``assistant.py --test``: the daemon end to end against a fake model server, from a checkout.

A feature of the product, so it ships with it: ``checks`` (``run_selfcheck``) runs the
attachment cases (text, code, images, text and scanned PDFs, refusals), the tools,
compaction and knowledge bases through the real socket; ``fakerouter`` is the
OpenAI-compatible server it (and the test suite, and the benchmarks) talks to, a real
HTTP server on loopback that mirrors llama-server's habits (``fakeprompt``: its prompt
cache); ``samples`` builds the PDFs and images the checks attach.  Nothing is imported
here, so ``python -m selfcheck.fakerouter`` loads the fake alone.
"""
