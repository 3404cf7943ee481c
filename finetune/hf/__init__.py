"""Hugging Face model dirs beyond the slice reader: hub ids and layouts converted on load (loader: rank 0 reads
and scatters; prepared DCP dirs), weights' fingerprints, what an export copies from the source (passthrough: each
tensor's dtype, the tensors the model class does not own), the export's gather from the live model and its streamed
check against the source, the run's chat_template_kwargs as the exported template's defaults, and what an export
reads and writes (files). Entered from build.py (the loader), export.py, tools/prepare.py, adapters/lora_export.py."""
