"""Other training stacks on llmpar's engine: ``llmpar.integrations.transformers`` (``transformers.Trainer``).
Import the submodule you use; nothing here is loaded with ``import llmpar``."""
