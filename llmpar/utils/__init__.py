"""Small helpers every layer may use (they import nothing from llmpar)."""
