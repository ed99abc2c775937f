"""The proxy's three processes and what composes each: the forwarder (`trace_proxy/proxy/`)
starts the capture process (`capture.py`, running a `Recorder`), which starts the export
process (`export.py`); `helper.py` starts, reaches and reaps a helper process, `lifeline.py`
ends one within a bound; `text_path.py` wires token2text for whichever process exports.
`detach.py` starts a proxy outside the process tree of whoever starts it (verl's plugin: a Ray
actor), tied to it by a lifeline pipe; `recover.py` writes to a store what a proxy killed with
all its processes left in its spool."""
