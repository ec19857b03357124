"""Bridges to tools outside deepinfer that drive its engine (lm-evaluation-harness)."""
