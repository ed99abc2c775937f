"""`trace-proxy replay`: a recorded trajectory's calls sent again, to another server, recorded.

`requests.py` rebuilds each call's HTTP request from its record, `selection.py` finds the
trajectories in a store, `session.py` sends them through an in-process proxy so that the
answers become a new run of the store, and `command.py` is the command line's side.
"""
