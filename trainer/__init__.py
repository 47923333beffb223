"""Losses, advantage estimators and the trainer process."""
