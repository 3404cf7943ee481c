"""What a run trains besides sft's default Task: DPO/SimPO (dpo.py) and its preference pairs (pairs.py), and held-out
evaluation before and after training (evaluate.py). Entered from build.py."""
