"""Speculative decoding: drafters, verify ordering and keys, depth planning, acceptance."""
