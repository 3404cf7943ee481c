"""Activation memory: op-level selective checkpointing (ac.mode=op: checkpoint()'s arguments) and host offload of
checkpointed blocks' inputs (ac.offload: the AC wrapper). Entered from build.py."""
