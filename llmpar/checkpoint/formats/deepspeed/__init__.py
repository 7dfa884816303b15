"""DeepSpeed's checkpoint files (ZeRO 0-3, pipeline, tensor-parallel): read, checked, written, loaded."""
