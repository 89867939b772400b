"""Tensor and pipeline parallelism: process groups, the TP x PP rank layout and model-split sizes
(parallel_state), rank 0's launcher and reaper of the other ranks (launcher), the step protocol
and loop the other ranks run (rank_worker), the stages' placement and hidden-state link
(stage_link) and the pipeline planner (pipeline_plan). The sharded and staged models are
engine/models/parallel_layers.py and pipeline_layers.py."""
