"""Tensor parallelism: process groups and model-split sizes (parallel_state), rank 0's
launcher and reaper of the other ranks (launcher), and the step protocol and loop the other
ranks run (tp_worker). The sharded model itself is engine/models/parallel_layers.py."""
