"""The proxy's three processes and what composes each: the forwarder (`trace_proxy/proxy/`)
starts the capture process (`capture.py`, running a `Recorder`), which starts the export
process (`export.py`); `helper.py` starts, reaches and reaps a helper process, `lifeline.py`
ends one within a bound."""
