"""The action IR: what one pipeline rank does, as data.

A rank's *program* is a list of actions, run in order:

* a compute ``Unit`` -- the forward or backward pass of one split of one microbatch
  on one model chunk, printed ``F3.1`` (forward, microbatch 3, split 1, chunk 0) or
  ``B3.1c2`` (backward, chunk 2);
* a ``Batch`` -- a tuple of ``Message``\\ s posted together as one
  ``batch_isend_irecv``, printed ``[S1:F3.1 R1:B2.0]``: send to pipeline rank 1 the
  input of ``F3.1``, receive from rank 1 the input of ``B2.0``.

A message names the unit that *consumes* its tensor (on the receiving rank), so a send
and its matching receive carry the same unit. Schedule modules (``seq1f1b``,
``interleaved``, ``slimpipe``) give each rank's units; ``lowering`` adds the batches;
``simulate`` times and checks programs; the executor runs them. ``format_program`` and
``parse_program`` convert a program to and from its printed form (for logs and tests).

Stages: with ``v`` chunks per rank, chunk ``c`` of rank ``r`` is global stage
``c p + r``. A forward's output goes to global stage ``+1`` and a backward's input
gradient to global stage ``-1`` (``consumer``); ``producer`` is the reverse.
"""

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

FORWARD = "F"
BACKWARD = "B"
SEND, RECV = "send", "recv"


@dataclass(frozen=True, order=True)
class Unit:
    """One forward or backward pass of one split of one microbatch on one model chunk."""

    kind: str
    microbatch: int
    split: int = 0
    chunk: int = 0

    @property
    def is_forward(self) -> bool:
        return self.kind == FORWARD

    def __str__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}.{self.split}{chunk}"


@dataclass(frozen=True)
class Message:
    """One op of a batch: send or receive the tensor that ``unit`` consumes.

    ``peer`` is the rank in the pipeline group on the other end.
    """

    kind: str  # SEND or RECV
    peer: int
    unit: Unit

    def __str__(self) -> str:
        return f"{'S' if self.kind == SEND else 'R'}{self.peer}:{self.unit}"


Batch = Tuple[Message, ...]
Action = Union[Unit, Batch]


def format_action(action: Action) -> str:
    if isinstance(action, Unit):
        return str(action)
    return "[" + " ".join(str(message) for message in action) + "]"


def format_program(program: Sequence[Action]) -> str:
    """A program in one line, e.g. ``F0.0 [S1:F0.0] F0.1 [S1:F0.1 R1:B0.1] B0.1``."""
    return " ".join(format_action(action) for action in program)


_UNIT = re.compile(r"([FB])(\d+)\.(\d+)(?:c(\d+))?$")
_MESSAGE = re.compile(r"([SR])(\d+):(.+)$")


def parse_unit(text: str) -> Unit:
    match = _UNIT.match(text)
    if match is None:
        raise ValueError(f"not a unit: {text!r} (expected e.g. F3.1 or B3.1c2)")
    kind, microbatch, split, chunk = match.groups()
    return Unit(kind, int(microbatch), int(split), int(chunk or 0))


def parse_program(text: str) -> List[Action]:
    """The inverse of ``format_program``."""
    program: List[Action] = []
    batch: Optional[List[Message]] = None
    for token in text.split():
        opens, closes = token.startswith("["), token.endswith("]")
        token = token.strip("[]")
        if opens:
            batch = []
        if batch is None:
            program.append(parse_unit(token))
            continue
        match = _MESSAGE.match(token)
        if match is None:
            raise ValueError(f"not a message: {token!r} (expected e.g. S1:F3.1)")
        kind, peer, unit = match.groups()
        batch.append(Message(SEND if kind == "S" else RECV, int(peer), parse_unit(unit)))
        if closes:
            program.append(tuple(batch))
            batch = None
    if batch is not None:
        raise ValueError(f"unclosed batch at the end of {text!r}")
    return program


def units_of(program: Sequence[Action]) -> List[Unit]:
    """The compute units of a program, in order."""
    return [action for action in program if isinstance(action, Unit)]


def _global_stage(rank: int, chunk: int, pp_size: int) -> int:
    return chunk * pp_size + rank


def _rank_chunk(stage: int, pp_size: int) -> Tuple[int, int]:
    return stage % pp_size, stage // pp_size


def producer(unit: Unit, rank: int, pp_size: int, num_chunks: int) -> Optional[Tuple[int, Unit]]:
    """(rank, unit) whose output ``unit`` on ``rank`` consumes; None when it reads data
    (first stage's forwards) or the loss (last stage's backwards)."""
    stage = _global_stage(rank, unit.chunk, pp_size)
    source = stage - 1 if unit.is_forward else stage + 1
    if not 0 <= source < pp_size * num_chunks:
        return None
    src_rank, src_chunk = _rank_chunk(source, pp_size)
    return src_rank, Unit(unit.kind, unit.microbatch, unit.split, src_chunk)


def consumer(unit: Unit, rank: int, pp_size: int, num_chunks: int) -> Optional[Tuple[int, Unit]]:
    """(rank, unit) that consumes the output of ``unit`` on ``rank``; None at the ends."""
    stage = _global_stage(rank, unit.chunk, pp_size)
    target = stage + 1 if unit.is_forward else stage - 1
    if not 0 <= target < pp_size * num_chunks:
        return None
    dst_rank, dst_chunk = _rank_chunk(target, pp_size)
    return dst_rank, Unit(unit.kind, unit.microbatch, unit.split, dst_chunk)
