"""LoRA adapters served on top of the base model (vLLM's ``--enable-lora``): PEFT checkpoints, several in one batch."""
