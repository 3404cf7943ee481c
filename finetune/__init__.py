"""finetune: fine-tune Hugging Face causal LMs with FSDP2 and DCP."""
__version__ = "0.1.0"
