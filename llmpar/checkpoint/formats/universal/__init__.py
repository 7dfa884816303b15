"""DeepSpeed's universal checkpoint layout (``zero/<param>/fp32.pt``): read and written."""
