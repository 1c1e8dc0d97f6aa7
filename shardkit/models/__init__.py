"""Small models for the demo and the tests."""

from shardkit.models.gpt import GPT, Block, GPTConfig, apply_fully_shard

__all__ = ["GPT", "GPTConfig", "Block", "apply_fully_shard"]
