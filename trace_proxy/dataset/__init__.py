"""`trace-proxy export`: a store's trajectories as Parquet datasets for training tools (SFT, RL)."""
