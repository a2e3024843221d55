"""Input data for pre-training."""
