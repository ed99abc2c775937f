"""`trace-proxy ui`: a rollout viewer in the browser, over the jsonl store (see server.py)."""
