"""What every layer runs on, free of Lightning: collectives over ranks, FSDP2 sharding, RNG states, files written
atomically, checkpoint files checked before loading, hardware checks, optimisers, optional packages, processes,
the hub probe, user errors."""
