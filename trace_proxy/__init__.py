"""trace-proxy: record RL rollouts as trajectories by sitting in front of the inference servers."""

__version__ = "0.1.0"
