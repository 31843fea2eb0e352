"""Hydra recipes: `commsched-train +recipe=<name>` (resnet, vgg, gpt2, digits)."""
