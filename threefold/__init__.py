"""threefold: data, tensor, pipeline, context and expert parallel training of Llama-style models, and a planner for it."""
__version__ = "0.1.0"
