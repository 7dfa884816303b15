"""``torch.distributed.checkpoint`` directories (FSDP2 / torchtitan): read, loaded, written."""
