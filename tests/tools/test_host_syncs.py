"""Host syncs of one training step, counted on CPU as `torch.cuda.set_sync_debug_mode` would
flag them on a GPU (fivefold/tools/host_syncs.py). Every sync left in a step is named here
with the reason it has to be there; a new one fails these tests until it is documented."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fivefold.config import load_config
from fivefold.parallel.mesh import Mesh
from fivefold.rules.layout import validate
from fivefold.tools.host_syncs import HostSyncs

from host_sync_workers import syncs_of_second_step, syncs_on_rank

# Every step: the sampler reads the shuffled order of its windows (host memory on every
# device; the counter cannot tell it from a device read on a CPU run), clipping reads the
# gradient norm (one number, after its one collective), and the step's report reads the
# loss and auxiliary-loss sums (one transfer).
EVERY_STEP = Counter({
    "sources.py (_window_ids) tolist": 1,
    "optim.py (reduced_norm) tolist": 1,
    "train.py (_report_sums) tolist": 1,
})


def test_the_counter_sees_every_kind_of_host_read_and_nothing_else():
    t = torch.arange(4.0)
    with HostSyncs() as syncs:
        u = (t * 2).sum() + t.max()  # device work only
        t.tolist(), u.item(), int(u), float(u), bool(u), t.cpu(), t.numpy()
    assert syncs.count == 7, syncs.summary()
    assert all(site.startswith("test_host_syncs.py (test_the_counter") for site in syncs.sites), syncs.summary()


def test_one_dense_step_syncs_only_for_the_norm_and_the_report():
    config = validate(load_config("tiny"))
    syncs = syncs_of_second_step(config, Mesh.single(config.layout))
    assert syncs.sites == EVERY_STEP, syncs.summary()


def test_data_parallel_step_syncs_as_the_single_process_one(pools):
    config = load_config("tiny", ["layout.dp=2"])
    for sites in pools.run(2, syncs_on_rank, config):
        assert Counter(sites) == EVERY_STEP, sites


def _moe_step(layers: int, forwards_per_layer: int, dispatch_site: str) -> Counter:
    """A MoE step: the split sizes of each MoE layer read once per forward (the dispatch needs
    them on the host: the all-to-all splits, the experts' group sizes), and every layer's
    routing statistics read together once."""
    return EVERY_STEP + Counter({dispatch_site: layers * forwards_per_layer,
                                 "train.py (moe_statistics) tolist": 1})


def test_moe_step_reads_the_split_sizes_once_per_layer():
    config = validate(load_config("tiny-moe"))
    syncs = syncs_of_second_step(config, Mesh.single(config.layout))
    expected = _moe_step(config.model.layers, 1, "moe.py (forward) tolist")  # LocalDispatcher
    assert syncs.sites == expected, syncs.summary()


def test_expert_parallel_step_reads_the_split_sizes_once_per_layer(pools):
    config = load_config("tiny-moe", ["layout.dp=2", "layout.ep=2"])
    expected = _moe_step(config.model.layers, 1, "expert_parallel.py (read) tolist")  # DispatchSizes.read
    for sites in pools.run(2, syncs_on_rank, config):
        assert Counter(sites) == expected, sites
