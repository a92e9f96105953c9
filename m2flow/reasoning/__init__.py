"""Reasoning RL (GRPO for language models) on the same engine: not built yet (see the issues)."""
