"""`python -m finetune ...` (what torchrun runs on every node: `torchrun ... -m finetune sft ...`)."""
from .cli import main

main()
