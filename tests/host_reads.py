"""Counting the device -> host reads of per-group loops (grouping.host_ends), for tests that pin
how many host syncs a path makes."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch


@contextlib.contextmanager
def counted_host_reads(*modules) -> Iterator[list[bool]]:
    """Patch grouping.host_ends (and the name in each of ``modules``, which imported it) to record
    each call; the yielded list holds True for each call that read a device tensor (a sync)."""
    from moetron.core.precision import grouping

    reads: list[bool] = []
    host_ends = grouping.host_ends

    def counted(offsets_E):
        reads.append(isinstance(offsets_E, torch.Tensor))
        return host_ends(offsets_E)

    with pytest.MonkeyPatch.context() as mp:
        for module in (grouping, *modules):
            mp.setattr(module, "host_ends", counted)
        yield reads
