"""The backends: each turns records into what one tool stores and sends it there. The spool,
batching and retry around them are the parent package's (`spool.py`, `runner.py`,
`pipeline.py`; the export process that runs them is `processes/export.py`), and
`exporters/__init__.py` names and builds them."""
