"""Convert Hugging Face PyTorch LLaDA / Dream checkpoints into asynclane-jax folders."""
