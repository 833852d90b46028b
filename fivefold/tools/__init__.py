"""Tools built on the runtime, bottom to top (tests/test_architecture.py keeps the order):
the multi-process test harness (`testing`), measured saved activations
(`saved_activations`), the planner's command line (`plan_render`, `plan_compare`,
`auto_layout`, `plan_cli`), parity and diagnosis of a layout against the single-process run
(`parity`, `diagnose`, `parity_cli`), the dry run (`dryrun`), text generation (`generate`),
run reports (`report`) and benchmarks (`bench`). Nothing in the runtime imports them.
"""
