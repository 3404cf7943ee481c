"""Adapters on a frozen base: LoRA (the "adapters" model.Transform, merge math), QLoRA's NF4 base
(lora.quantize_base: quantized on load, shard by shard) and their exports (merged onto the original base, or a PEFT
adapter dir). Entered from build.py (lora.rank) and export's hooks."""
