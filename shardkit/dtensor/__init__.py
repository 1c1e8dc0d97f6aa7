"""Turning parameters into sharded DTensors and back."""
