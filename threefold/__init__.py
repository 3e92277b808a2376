"""threefold: data, tensor and pipeline parallel training of Llama-style models, and a planner for it."""
__version__ = "0.1.0"
