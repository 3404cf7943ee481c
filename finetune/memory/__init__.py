"""Activation memory: op-level selective checkpointing (ac.mode=op) and host offload of checkpointed blocks' inputs
(ac.offload), each an "ac" model.Transform wrapping the checkpointed blocks. Entered from build.py."""
