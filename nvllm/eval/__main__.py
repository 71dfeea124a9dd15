"""`python -m nvllm.eval ...`: lm-eval's own command line with the `nvllm` backend registered.

    python -m nvllm.eval --model nvllm --model_args model=DIR,dtype=bfloat16 --tasks gsm8k

lm-eval releases that read the `lm_eval.models` entry-point group find the backend by themselves (nvllm
declares it), so there plain `lm_eval --model nvllm ...` works too; this module covers the releases that
do not.
"""

import nvllm.eval.lm_eval_model  # noqa: F401  (registers "nvllm" with lm-eval)
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
