"""Lion Cub under DistributedDataParallel: the communication hook and the trainer adapters."""
