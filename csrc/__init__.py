"""CUDA C++ sources of ``llmpar._C``, shipped as package data so that llmpar/ops/_ext.py can JIT-build them."""
