"""What runs a model's layers faster or differently, each a model.Transform: varlen attention (the
default where the model allows: sinks, MLA, chunked layers), Liger's fused kernels, the MoE experts' implementation
and router loss, float8 Linear layers, linear-attention/state-space layers run per packed sample. Entered from
build.py."""
