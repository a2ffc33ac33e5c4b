"""Session 54: how many of split_master's guarded metadata reads a training step makes (core/split_param.py's
__torch_function__, counted), eager and compiled, on tests/core/test_split_master.py's tiny MoE (every copy on,
the masters split). Run from the repo root: PYTHONPATH=tools:. python docs/bench/session54/count_guard.py"""
import collections

import torch

import moetron.core.split_param as sp
from tests.core.test_split_master import _trainer

counts: collections.Counter = collections.Counter()
guard = sp._FreedMixin.__torch_function__.__func__


def counting(cls, func, types, args=(), kwargs=None):
    counts[getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))] += 1
    return guard(cls, func, types, args, kwargs)


sp._FreedMixin.__torch_function__ = classmethod(counting)
for compile in (False, True):
    torch._dynamo.reset()
    trainer, data = _trainer(True, compile=compile)
    for _ in range(4):  # the fourth step's reads (compiled and warm)
        counts.clear()
        trainer.train_step(data.next_batch())
    n = len(trainer.optimizer.split_parameters())
    print(f"{'compiled' if compile else 'eager'}: {sum(counts.values())} guarded reads in a step for {n} split "
          f"parameters ({sum(counts.values()) / n:.1f} each): {dict(counts.most_common())}")
