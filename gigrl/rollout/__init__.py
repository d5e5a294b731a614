"""Rollout stage: the Search-R1 protocol and the multi-turn engines."""
