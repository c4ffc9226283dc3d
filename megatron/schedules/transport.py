"""How the executor's messages travel: the seam between a rank's program and its peers.

``PipelineExecutor.run_batch`` hands each batch of its program (``[S1:F3.1 R1:B2.0]``)
to a transport with one tensor per message: the tensor to send, or an empty buffer of
the message's shape, dtype and device to receive into. Two transports:

* ``ProcessGroupTransport`` (training): one ``batch_isend_irecv`` on the pipeline
  group, timed under megatron-core's p2p timer names, then ``batch_p2p_sync``;
* ``SyntheticNeighbours`` (the one-stage benchmark, tests): rank ``r`` of ``p`` runs
  alone in one process; receives are filled with made-up values, sends are dropped,
  nothing is timed.

A transport also says which rank of how many this program runs as, so the executor
never asks a process group itself.
"""

from typing import Any, Dict, Protocol, Sequence, runtime_checkable

import torch

from megatron.schedules.actions import SEND, Batch


@runtime_checkable
class Transport(Protocol):
    rank: int  # this program's rank in the pipeline
    size: int  # pipeline stages
    group: Any  # the process group a paired unit's attention exchange uses (or None)

    def global_rank(self, peer: int) -> int:
        """The global rank of pipeline rank ``peer``."""

    def exchange(self, batch: Batch, tensors: Sequence[torch.Tensor]) -> None:
        """Post ``batch`` at once and return when it is done: ``tensors[i]`` is sent for a
        send message and filled for a receive."""


class ProcessGroupTransport:
    """The pipeline's process group, as megatron-core's p2p communication uses it."""

    def __init__(self, group, config):
        self.group = group
        self.config = config  # timers and batch_p2p_sync, read at each batch
        self.rank, self.size = group.rank(), group.size()

    def global_rank(self, peer: int) -> int:
        return torch.distributed.get_global_rank(self.group, peer)

    def exchange(self, batch: Batch, tensors: Sequence[torch.Tensor]) -> None:
        timer = None
        if self.config.timers is not None:  # megatron-core's p2p timers, by the same names
            timer = self.config.timers(p2p_timer_name(batch), log_level=2)
            timer.start()
        ops = [torch.distributed.P2POp(
                   torch.distributed.isend if message.kind == SEND else torch.distributed.irecv,
                   tensor, self.global_rank(message.peer), self.group)
               for message, tensor in zip(batch, tensors)]
        for request in torch.distributed.batch_isend_irecv(ops):
            request.wait()
        if self.config.batch_p2p_sync and torch.cuda.is_available():
            torch.cuda.synchronize()  # as megatron-core: guard against batch_isend_irecv races
        if timer is not None:
            timer.stop()


class SyntheticNeighbours:
    """The rest of a ``size``-stage pipeline, made up, for rank ``rank`` running alone.

    A received activation is standard normal, a received gradient 1e-3 times that (about
    a loss gradient's size), drawn from a generator seeded by the rank so every
    iteration sees the same values; the executor's buffer already has the message's
    shape, dtype, device and ``requires_grad``. Sends are dropped. No timer runs: no
    communication happened."""

    group = None
    GRADIENT_SCALE = 1e-3

    def __init__(self, rank: int, size: int, seed: int = 1000):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not a stage of a {size}-stage pipeline")
        self.rank, self.size, self.seed = rank, size, seed
        self.generators: Dict[torch.device, torch.Generator] = {}

    def global_rank(self, peer: int) -> int:
        raise NotImplementedError(
            "synthetic neighbours cannot answer an attention exchange (SlimPipe's attention "
            "balance pairs units of two real ranks): run it over a process group")

    def exchange(self, batch: Batch, tensors: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():  # the buffers are autograd leaves that require grad
            for message, tensor in zip(batch, tensors):
                if message.kind == SEND:
                    continue
                tensor.normal_(generator=self.generator(tensor.device))
                if not message.unit.is_forward:
                    tensor.mul_(self.GRADIENT_SCALE)

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(
                self.seed + self.rank)
        return self.generators[device]


def p2p_timer_name(batch: Batch) -> str:
    """megatron-core's timer name for a batch: ``forward-send`` (an activation sent),
    ``backward-recv`` (a gradient received), ``forward-send-backward-recv``, ...; a batch
    of more kinds than megatron-core's calls combine is
    ``forward-backward-send-forward-backward-recv``."""
    kinds = {("forward" if m.unit.is_forward else "backward", m.kind) for m in batch}
    if len(kinds) == 1:
        (direction, kind), = kinds
        return f"{direction}-{kind}"
    sends = [d for d, k in kinds if k == SEND]
    recvs = [d for d, k in kinds if k != SEND]
    if len(sends) == 1 and len(recvs) == 1:
        return f"{sends[0]}-send-{recvs[0]}-recv"
    return "forward-backward-send-forward-backward-recv"
