"""Pure rules the runtime and the planner share: functions of config values, no processes.

- `layout`: which layouts are valid (with the values that would work) and the rank <->
  coordinate maps;
- `precision`: the precision policy, bytes per parameter and per activation element;
- `volumes`: which collectives a layout issues and the bytes they move (comm.py counts the
  same), and the map from comm.py's axes to the planner's;
- `params` and `flops`: the parameter count and the model FLOPs per token;
- `stages`: the pipeline's layer split; `schedules`: pipeline schedule tables and their
  simulator; `p2p_order`: whether an issued order of point-to-point groups can deadlock
  under NCCL's rules.
"""
