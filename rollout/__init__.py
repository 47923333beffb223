"""Two processes: the rollout-server with its engines (server/) and the orchestrator with its agent loop (orchestrator/)."""
