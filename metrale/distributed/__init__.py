"""Tensor parallelism on torch.distributed: the group and its collectives (`parallel.py`), the
sharded layers of a dense Qwen3 target (`layers.py`) and the worker processes that run the other
ranks' shards in step with the engine's (`workers.py`)."""
