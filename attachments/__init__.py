"""Files attached to a question: classify, extract, budget, image references.

Filled by the attachments work (seed 003); until then ``ask`` refuses files.
"""

__all__: list[str] = []
