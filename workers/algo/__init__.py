"""RL algorithms as pure functions: advantages, per-token losses, aggregation, IS correction,
train/generation mismatch metrics."""
