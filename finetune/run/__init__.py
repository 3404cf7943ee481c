"""What guards and reports a run: the output dir's lock and pins, the checkpointer (async saves, a failed save as
one line), the console report and progress bar, MFU, W&B, resume notes, train.tokens_per_step, config checks and
flag hints, one line for ranks that refused their input. Entered from cli.py, preflight.py and build.py."""
