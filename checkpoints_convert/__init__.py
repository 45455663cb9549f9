"""Convert Hugging Face PyTorch LLaDA / Dream checkpoints into asynclane-jax folders.

Modules: names (declarative name tables and the tensor-listing check), reader (lazy
safetensors / .bin reading), lora (PEFT adapter merge), convert (the streaming, atomic
conversion), verify (the transformers reference), cli (`asynclane-jax convert`).
"""
