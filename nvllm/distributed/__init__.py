"""Tensor parallelism: the process group of the ranks (group.py), which piece of every weight a rank holds
(partition.py), the worker processes rank 0 starts and watches (worker_pool.py) and their loop (worker.py)."""
