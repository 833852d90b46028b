"""fivefold: five-way parallel training of decoder-only language models.

The tree is the layer map, bottom to top (docs/architecture.md); a package imports only
packages below it:

    config/      frozen values and TOML presets
    rules/       pure rules the runtime and the planner share
    planner/     the cost model
    data/        tokens in, batches out
    model/       plain PyTorch
    parallel/    the mesh, every collective, the five strategies
    parallelize.py   the composition point
    observe/     what a run measures
    train.py     one step
    job/         processes, run folders, the machine's settings
    checkpoint/  saving, resuming under any layout, Hugging Face in and out
    run.py       a whole run
    tools/       built on the runtime: parity, diagnose, dry run, report, bench, plan
    cli.py       the command line
"""

from . import _moved

__version__ = "0.1.0"

_moved.install()  # old import paths of moved modules still work, with a DeprecationWarning
