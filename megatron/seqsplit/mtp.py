"""Multi-token prediction (DeepSeek-V3's MTP) exact under sequence splits.

megatron-core's MTP layer k predicts token i + k + 1 at position i: it embeds the input
tokens shifted k + 1 to the left, and its loss reads the labels and the loss mask shifted
the same way. Each shift is ``roll_tensor`` (``torch.roll`` with the vacated last
position zeroed; the sum of the rolled tensor comes back with it, which for the loss mask
is the loss's token count). On a split the shift must bring in the tokens after the
split's end (the next splits' first tokens), and the count must be the whole microbatch's,
as the main loss's is. So under splits ``roll_tensor`` reads the rolled window from the
whole microbatch: ``SplitRolls`` knows which of the split's tensors (tokens, position
ids, labels, loss mask) each rolled tensor is and how far it has been shifted, and cuts
the shifted window out of the microbatch ``MicrobatchSlicer`` keeps for the split.

``install_split_roll`` replaces megatron-core's ``roll_tensor`` in the modules that call
it (there is no hook): a call with a ``SplitContext`` as ``packed_seq_params`` is the
split's; every other call (unsplit runs, megatron-core's own schedules) goes to
megatron-core's function unchanged.
"""

import copy

import torch

from megatron.core.models.gpt import gpt_model
from megatron.core.transformer import multi_token_prediction

from megatron.seqsplit.split_context import SplitContext

# the per-token tensors MTP shifts, by their names in the batch
ROLLED = ("tokens", "position_ids", "labels", "loss_mask")


class SplitRolls:
    """The tensors of one split's forward that MTP may shift, each with its name in the
    microbatch and how far it is shifted already (0: the split's own slice)."""

    def __init__(self, split: SplitContext, microbatch: dict):
        self.split = split
        self.microbatch = microbatch
        self._inputs = {}  # name -> the split's own tensor given to the model
        self._known = {}  # id -> (tensor, name, shift): the tensor is kept so ids stay unique

    def register(self, name: str, tensor) -> None:
        if tensor is not None:
            self._inputs[name] = tensor
            self._known[id(tensor)] = (tensor, name, 0)

    def roll(self, tensor):
        """(tensor shifted one more position left, sum over the whole microbatch's
        shifted tensor), as megatron-core's ``roll_tensor`` returns for the unsplit row."""
        name, shift = self._place(tensor)
        shift += 1
        full = self.microbatch[name]
        start = self.split.offset + shift
        window = full[:, start:start + self.split.length]
        missing = self.split.length - window.shape[1]  # past the sequence's end: zeros
        if missing:
            window = torch.cat([window, window.new_zeros(window.shape[0], missing)], dim=1)
        rolled = window.to(device=tensor.device, dtype=tensor.dtype).reshape(tensor.shape)
        self._known[id(rolled)] = (rolled, name, shift)
        total = full[:, shift:].sum().to(device=tensor.device, dtype=tensor.dtype)
        return rolled, total

    def _place(self, tensor):
        entry = self._known.get(id(tensor))
        if entry is not None and entry[0] is tensor:
            return entry[1], entry[2]
        # megatron-core clones the labels before shifting them (GPTModel's loss): a copy
        # equal to the split's labels is them
        labels = self._inputs.get("labels")
        if labels is not None and tensor.shape == labels.shape and torch.equal(tensor, labels):
            return "labels", 0
        raise RuntimeError(
            "multi-token prediction under sequence splits: megatron-core shifted a tensor "
            "that is not the split's tokens, position ids, labels or loss mask, so its "
            "window past the split cannot be read. Pass the batch's loss_mask to the model "
            "(model(..., labels=..., loss_mask=...), as pretrain_gpt.py's forward_step "
            "does); otherwise this megatron-core version's MTP is not supported with "
            "--seq1f1b-splits > 1")


def begin_split_rolls(split: SplitContext, **tensors) -> None:
    """Before a split's forward through a model with MTP: the split's own tensors (the
    ones passed to the model) to shift past its end. A split that is the whole sequence
    (packed documents unsplit) reads them as they are."""
    microbatch = split.microbatch
    if microbatch is None and split.offset == 0 and split.length == split.seq_length:
        microbatch = {name: tensor for name, tensor in tensors.items() if tensor is not None}
    if microbatch is None:
        raise RuntimeError("multi-token prediction under sequence splits needs the whole "
                           "microbatch on the split (the executor's MicrobatchSlicer keeps it)")
    missing = [name for name in ROLLED if tensors.get(name) is not None
               and name not in microbatch]
    if missing:
        raise RuntimeError(f"multi-token prediction under sequence splits: the batch has no "
                           f"{', '.join(missing)} to read past the split's end")
    split.rolls = SplitRolls(split, microbatch)
    for name in ROLLED:
        split.rolls.register(name, tensors.get(name))


def end_split_rolls(split: SplitContext) -> None:
    split.rolls = None


_MEGATRON_ROLL = multi_token_prediction.roll_tensor


def split_aware_roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """megatron-core's ``roll_tensor`` (same signature), reading past a split's end when
    ``packed_seq_params`` is a split of a model with MTP."""
    rolls = getattr(packed_seq_params, "rolls", None)
    if not isinstance(packed_seq_params, SplitContext) or rolls is None or tensor is None:
        return _MEGATRON_ROLL(tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                              packed_seq_params=packed_seq_params)
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise RuntimeError(f"multi-token prediction under sequence splits shifts one position "
                           f"along the sequence; megatron-core asked for shifts={shifts}, "
                           f"dims={dims}")
    return rolls.roll(tensor)


_MEGATRON_PROCESS_MTP_LOSS = getattr(multi_token_prediction, "process_mtp_loss", None)
_MEGATRON_MTP_SCALER = multi_token_prediction.MTPLossAutoScaler


def split_aware_process_mtp_loss(*args, **kwargs):
    """megatron-core's (0.17+) ``process_mtp_loss``, with the per-token weight of the
    whole microbatch under a split.

    With --calculate-per-token-loss it attaches each depth's masked loss times the loss
    tokens of its call (``loss_mask.sum()`` before the shift) over the shifted count; the
    shifted count is already the microbatch's (``SplitRolls.roll``), the call's own count
    is the split's. Here megatron-core runs its per-microbatch formula (the loss over the
    shifted count) and the attached loss is multiplied by the microbatch's loss tokens:
    the unsplit call's weight, also for a split whose own tokens are all masked. The
    logged losses do not depend on it."""
    split, config = kwargs.get("packed_seq_params"), kwargs.get("config")
    rolls = getattr(split, "rolls", None)
    if not (isinstance(split, SplitContext) and rolls is not None
            and config.calculate_per_token_loss):
        return _MEGATRON_PROCESS_MTP_LOSS(*args, **kwargs)
    per_microbatch = copy.copy(config)
    per_microbatch.calculate_per_token_loss = False
    loss_tokens = rolls.microbatch["loss_mask"].sum()

    class WholeMicrobatchTokens:
        @staticmethod
        def apply(hidden_states, loss):
            return _MEGATRON_MTP_SCALER.apply(
                hidden_states, loss * loss_tokens.to(device=loss.device, dtype=loss.dtype))

    multi_token_prediction.MTPLossAutoScaler = WholeMicrobatchTokens
    try:
        return _MEGATRON_PROCESS_MTP_LOSS(*args, **dict(kwargs, config=per_microbatch))
    finally:
        multi_token_prediction.MTPLossAutoScaler = _MEGATRON_MTP_SCALER


def install_split_roll() -> None:
    """Route megatron-core's MTP shifts through ``split_aware_roll_tensor``: the MTP
    layers and (0.17+) ``process_mtp_loss`` read ``multi_token_prediction.roll_tensor``,
    0.16's ``GPTModel._postprocess`` its own import of it. On 0.17+ ``GPTModel`` calls its
    import of ``process_mtp_loss``: ``split_aware_process_mtp_loss`` there. (0.16 attaches
    the masked loss sum under --calculate-per-token-loss, exact over the splits as it is.)"""
    for module in (multi_token_prediction, gpt_model):
        if getattr(module, "roll_tensor", None) is _MEGATRON_ROLL:
            module.roll_tensor = split_aware_roll_tensor
    if (_MEGATRON_PROCESS_MTP_LOSS is not None
            and getattr(gpt_model, "process_mtp_loss", None) is _MEGATRON_PROCESS_MTP_LOSS):
        gpt_model.process_mtp_loss = split_aware_process_mtp_loss
