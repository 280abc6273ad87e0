"""Torch-free contracts shared by every component: block hashing, tokenizer, chat template."""
