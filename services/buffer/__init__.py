"""The replay buffer process: durable log, state, typed protocol, and the clients that speak it."""
