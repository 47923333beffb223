"""Reward scoring by domain and the reward-server. Imports no torch."""
