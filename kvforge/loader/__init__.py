"""Loading checkpoints: HF safetensors folders and GGUF files."""
