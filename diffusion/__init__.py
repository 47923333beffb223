"""Diffusion models' shared math and built-in task: what the trainer and the engines must
compute alike (see ARCHITECTURE.md, floor 3). `flow` (sampling steps and their
log-probabilities), `digits` (the built-in model), `data` and `judge` (torch-free)."""
