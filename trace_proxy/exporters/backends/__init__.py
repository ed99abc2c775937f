"""The backends: each turns records into what one tool stores and sends it there. The spool,
batching, retry and processes around them are the parent package's (`runner.py`,
`pipeline.py`, `process.py`), and `exporters/__init__.py` names and builds them."""
