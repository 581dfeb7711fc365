"""Knowledge bases: ingest, chunk, embed, hybrid search, auto-injection."""

__all__: list[str] = []
