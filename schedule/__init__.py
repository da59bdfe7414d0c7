"""Schedules: a ComputeDAG's loop state and the transform steps that make it (TVM's loop_state +
transform_step), the layer that search proposes and codegen lowers."""
