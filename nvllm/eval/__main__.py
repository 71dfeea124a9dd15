"""`python -m nvllm.eval ...`: lm-eval's own command line with the `nvllm` backend registered.

    python -m nvllm.eval --model nvllm --model_args model=DIR,dtype=bfloat16 --tasks gsm8k

nvllm also declares the backend in the `lm_eval.models` entry-point group, for an lm-eval that discovers model
plugins that way; lm-eval 0.4.13 (the newest release the `eval` extra allows) does not, so plain
`lm_eval --model nvllm` does not find it there: use this module.
"""

import nvllm.eval.lm_eval_model  # noqa: F401  (registers "nvllm" with lm-eval)
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
