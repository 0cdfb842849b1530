"""Stopping every rank at the same step on SIGTERM, agreed on the host, so that the GPUs never wait.

Lightning (2.6) makes the ranks agree on a SIGTERM by broadcasting a flag from rank 0 at the start
of every training batch, through the GPU's process group: a host-to-GPU copy and an ``.item()``
that each wait until the GPU has run everything queued. Every step the host then stops running ahead,
and the next step's kernels start only after it has launched them: two H200s trained the compiled
CV8x8x8 step far slower than twice one (docs/benchmarks.md). Its broadcast also reads only rank
0's flag, while a rank that got the signal itself stops after its batch alone, which can leave the
others waiting in a collective for good.

:class:`HostStopAgreement` replaces both under DDP: a signal only sets a flag of its rank, and at the
start of every optimizer step the ranks take the maximum of their flags over a CPU (gloo) process
group. When any rank got the signal, all of them raise Lightning's ``SIGTERMException`` there, so
``on_exception`` hooks (the preemption checkpoint) run everywhere at one step, between whole steps.
"""

from __future__ import annotations

import signal
import warnings
from types import FrameType

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException


class HostStopAgreement(pl.Callback):
    """Under DDP: agree on a SIGTERM over a CPU process group at every step's start (see the module)."""

    def __init__(self) -> None:
        self.signalled = False
        self.group: dist.ProcessGroup | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        loop = trainer.fit_loop.epoch_loop
        if stage != "fit" or trainer.world_size < 2 or not dist.is_initialized():
            return
        if not hasattr(loop, "_broadcast_sigterm_tensor") or not hasattr(trainer, "_signal_connector"):
            warnings.warn(
                f"lightning {pl.__version__} has no per-batch SIGTERM broadcast to replace: stop signals under "
                "DDP are left to Lightning (the tested version is in requirements.txt)",
                stacklevel=2,
            )
            return
        self.signalled = False
        self._release()  # a group left by an earlier fit that ended in an exception
        # Every rank runs setup, in the same order, as new_group requires.
        self.group = dist.new_group(backend="gloo")
        loop._broadcast_sigterm_tensor = self.agree
        # Runs before Lightning registers its handlers (Trainer._run), so the signal goes here.
        trainer._signal_connector._sigterm_notifier_fn = self._on_signal  # type: ignore[method-assign]
        self._trainer = trainer

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Lightning's own handler also broadcasts from inside the signal handler; here only a flag is
        # set. Its end-of-batch check reads the trainer's flag, which stays False until all agree.
        launcher = self._trainer.strategy.launcher
        if not self.signalled and launcher is not None:
            launcher.kill(signal.Signals(signum))
        self.signalled = True

    def agree(self) -> None:
        """All ranks, at the first micro-batch of an optimizer step: raise ``SIGTERMException`` when any
        rank was signalled. Between micro-batches the step goes on, so the checkpoint holds whole steps."""
        trainer = self._trainer
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches:
            return  # the same answer on every rank: the same batches came before
        flag = torch.tensor([int(self.signalled)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            self._trainer._signal_connector.received_sigterm = True
            raise SIGTERMException()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips callbacks' teardown when a fit ends in an exception (a stop signal is one).
        self._release()

    def _release(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
