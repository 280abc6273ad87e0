"""Tensor parallelism: the sharded model (`tp`), the step plans rank 0 broadcasts (`plan`,
`comm`), the executors that run the other ranks (`executor`, `ray_executor`, `worker`) and
KV page moves between ranks for P/D (`kv_moves`)."""
