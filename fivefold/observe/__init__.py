"""What a run measures, beside what the planner predicted.

- `metrics`: MFU, the phases of a step, peak memory, the per-rank measurements logged to
  metrics.jsonl and TensorBoard, the profiler;
- `prediction`: the planner's prediction for the run's own layout and the drift warnings;
- `timeline`: per-rank timelines of a pipeline step, its measured bubble, Gantt charts;
- `held_memory`: the model-state bytes a rank holds, by tensor storage.
"""
