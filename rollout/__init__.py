"""Rollout engines, the rollout-server and the orchestrator's agent loop."""
