"""Capture: turns exchanges copied off the hot path into calls, keys and step events."""
