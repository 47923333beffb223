"""The orchestrator process: drives episodes (prompt or env, generate, step, score) into the buffer."""
