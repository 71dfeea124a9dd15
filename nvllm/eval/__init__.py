"""Evaluation on nvllm's engine: lm-evaluation-harness tasks (GSM8K, MMLU, ...), perplexity, and the
regression gate between a model and its baseline. Needs the `eval` extra (`pip install "nvllm[eval]"`).

- `lm_eval_model.NvllmLM`: the lm-eval backend (`--model nvllm`)
- `tasks`: local copies of lm-eval's gsm8k / mmlu task configs reading the published files
- `perplexity`: WikiText-2 / C4 / any text file
- `datafiles`: reading the local data files (JSON lines or a JSON array), errors naming file and line
- `regression`: baseline vs candidate on identical samples
- `harness_results`: lm-eval's results as `nvllm eval` keeps a task
- `runner`: what `nvllm eval` runs
- `pipeline`: `nvllm pipeline` (quantize, gate, benchmark, one report)
- `quiet`: keeping lm-eval, datasets and transformers quiet under nvllm's own progress
"""
