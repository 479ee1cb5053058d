"""The engine: sequences, KV pages, scheduling, the model runner, sampling and the loop."""
