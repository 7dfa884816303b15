"""Other training stacks on llmpar's engine: ``llmpar.integrations.transformers`` (``transformers.Trainer``) and
``llmpar.integrations.accelerate`` (accelerate's ``Accelerator`` with a DeepSpeed plugin).
Import the submodule you use; nothing here is loaded with ``import llmpar``."""
