"""Grouped collectives, streams and the collective trace."""
