"""Ground truth for trace-proxy: realistic RL traffic with known answers, and its scoring.

`generator.run_mode` drives simulated vLLM and SGLang RL runs through running proxies and
returns what really happened (`truth.Truth`) with what the proxies recorded;
`scoring.score` compares the two.
"""
