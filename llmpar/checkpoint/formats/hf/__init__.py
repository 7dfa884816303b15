"""HuggingFace's layout: weights written as ``from_pretrained`` loads them, and loaded into an engine."""
