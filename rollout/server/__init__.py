"""The rollout-server process: one engine behind RolloutService, and the weights it takes."""
