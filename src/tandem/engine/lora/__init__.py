"""Multi-LoRA serving: PEFT adapters on one base model, many in one batch (see manager.py,
layers.py, peft.py, paths.py). Only the torch-free `LoRARequest` is imported here."""

from tandem.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
