"""Hydra configuration: train.yaml and its groups (schedule, fusion, model, data, trainer)."""
