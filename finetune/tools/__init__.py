"""Commands besides sft, dpo and export-hf: preview-data, bench, plan, prepare-checkpoint (commands.py: their flags),
and count_lines. Entered from cli.py."""
