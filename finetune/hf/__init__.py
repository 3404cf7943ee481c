"""Hugging Face model dirs beyond what every run loads: weights' fingerprints (a run continued on its own model, LoRA's
base), what an export copies from the source (passthrough: each tensor's dtype, the tensors the model class does not
own), the export's gather from the live model and its streamed check against the source, the run's
chat_template_kwargs as the exported template's defaults, and what an export reads and writes (files). Entered from
export.py, preflight.py, build.py (LoRA's base fingerprint), tools/prepare.py and adapters/lora_export.py."""
