"""The mesh, every collective, and the five strategies, applied to a plain model from outside.

- `mesh` (the process groups of a layout) and `comm` (every collective, named by its axis
  and counted in bytes, with the flight recorder and watchdog);
- `sharding` (where each local tensor sits in the full model), `protocols` (what an
  optimizer offers), `optim` (AdamW, the global norm), `buckets` and `flat_adamw` (what data
  parallel and ZeRO share), `deferred` (linears whose weight gradient comes later);
- one module per strategy: `data_parallel`, `zero`, `tensor_parallel`, `expert_parallel`,
  `context_parallel`, `pipeline`; and `compile` (regional compilation).

`fivefold/parallelize.py` applies them in order; nothing here imports it or the loop.
"""
