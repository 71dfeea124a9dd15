"""Tensor parallelism: the process group of the ranks (group.py), which piece of every weight a rank holds
(partition.py), the worker processes rank 0 starts and watches (worker_pool.py), their loop (worker.py) and the
one-shot all-reduce over symmetric memory for decoding's small all-reduces (one_shot.py)."""
