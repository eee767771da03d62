"""Linear layers: merged ones (QKV, gate-up) load several checkpoint tensors; the tensor-parallel
ones hold one rank's slice of the checkpoint matrix.

    column-parallel   W [N, K] split by rows: each rank computes N / tp outputs, no communication
    row-parallel      W [N, K] split by columns: each rank multiplies its K / tp inputs, then the
                      partial outputs are summed over the tensor-parallel group (one all-reduce)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.distributed.communicator import tp_all_reduce
from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.layers.float_linear import FloatFormat
from kvforge.layers.linear_kernel import LinearFormat, LinearKernel, WeightArena


class Linear(nn.Module):
    """y = x W^T + b. Merged layers stack several checkpoint matrices along the output dimension;
    `shard_sizes` names the row count of each, and `load_shard` fills one of them.

    The layer's format (layers/linear_kernel.py; float until `set_format` gives it another, before loading) says which
    checkpoint tensors it loads; once they are all in, the format turns them into the layer's kernel, which every
    forward calls, whatever the format."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = shard_sizes
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.out_features = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        self.format: LinearFormat = FloatFormat()
        self.kernel: LinearKernel | None = None  # the format's kernel, holding the weight (prepared at load)
        self.weight_arena: WeightArena | None = None  # where a kernel's packed weight goes (set by the loader)
        # the float weight's dtype and device, which a format that replaces it creates its tensors on
        self.param_dtype, self.param_device = self.weight.dtype, self.weight.device
        # (parameter, shard) filled until the format has turned them into the kernel; None once it has
        self.loaded_shards: set[tuple[str, int]] | None = set()
        self.lora: nn.Module | None = None  # LoRA adapters' slots, adding each row's update (lora/layer.py)

    def set_format(self, weight_format: LinearFormat) -> None:
        """Before loading: let the format replace the float weight with its own tensors."""
        self.param_dtype, self.param_device = self.weight.dtype, self.weight.device
        self.format = weight_format
        weight_format.create_weights(self)

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None]:
        """(output-feature axis, input-feature axis) of a checkpoint tensor of this layer; None: absent."""
        axes = self.format.checkpoint_axes(param_name)
        return axes if axes is not None else _FLOAT_AXES.get(param_name, (0, None))

    def checkpoint_slice(self, param_name: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a full checkpoint tensor that this rank holds (all of it without parallelism)."""
        return tensor

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        tensor = self.checkpoint_slice(param_name, shard, tensor)
        if not self.format.load_shard(self, param_name, shard, tensor):
            self.load_into(param_name, shard, tensor)
        self._process_when_loaded(param_name, shard)

    def _process_when_loaded(self, param_name: str, shard: int) -> None:
        """Prepare the kernel as soon as every shard of every checkpoint tensor is in, so a load holds one layer's
        checkpoint tensors at a time, not the model's."""
        if self.loaded_shards is None:
            raise ValueError(f"checkpoint has a second {param_name} (shard {shard}) for a layer already converted")
        self.loaded_shards.add((param_name, shard))
        expected = {(name, s) for name, _ in self.named_parameters(recurse=False) for s in range(len(self.shard_sizes))}
        if expected <= self.loaded_shards:
            self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        """Once: the format's kernel, prepared from the loaded checkpoint tensors."""
        if self.loaded_shards is not None:
            self.kernel = self.format.prepare_kernel(self)
            self.loaded_shards = None

    def load_into(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy this rank's part of a checkpoint tensor into its rows of the parameter."""
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} that this layer does not use")
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit shard {shard} "
                f"of shape {(size, *param.shape[1:])}"
            )
        param.data[start : start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # [num_tokens, in_features], as the models call it
            y = self.kernel.apply(x)
        else:
            y = self.kernel.apply(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        return y if self.lora is None else self.lora(x, y)  # NOTE: before a row-parallel layer's all-reduce

    def forward_fused(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """FUSED_ACTIVATIONS[activation](self(x)) (x [num_tokens, in_features]): in one pass where the kernel fuses it
        into the multiply (float32 rows through oneDNN: float_linear.py), else in two."""
        fused = getattr(self.kernel, "apply_fused", None)
        if fused is not None and self.lora is None:
            out = fused(x, activation)
            if out is not None:
                return out
        return FUSED_ACTIVATIONS[activation](self(x))


# The activations Linear.forward_fused applies, by name (the CPU's oneDNN post-ops: kernels/cpu/dense_gemv.py).
FUSED_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
_FLOAT_AXES = {"weight": (0, 1), "bias": (0, None)}


def _piece(tensor: torch.Tensor, axis: int, num_pieces: int, index: int, what: str) -> torch.Tensor:
    """Piece `index` of `num_pieces` equal pieces of tensor along axis."""
    size = tensor.shape[axis]
    if size % num_pieces:
        raise ValueError(f"cannot split {what} of shape {tuple(tensor.shape)} into {num_pieces} equal parts "
                         f"along axis {axis}")
    width = size // num_pieces
    return tensor.narrow(axis, index * width, width)


class ColumnParallelLinear(Linear):
    """Output features split over the tensor-parallel ranks; each output shard of a merged layer is
    split on its own. shard_pieces[i] = (pieces, index): shard i of the checkpoint is cut into
    `pieces` parts and this rank holds part `index` (KV heads fewer than ranks are replicated by
    cutting into fewer pieces than ranks). Default: (tp, tp_rank) for every shard."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False,
                 shard_pieces: list[tuple[int, int]] | None = None, dtype: torch.dtype = torch.float32) -> None:
        state = get_parallel_state()
        pieces = shard_pieces or [(state.tp_size, state.tp_rank)] * len(shard_sizes)
        for size, (num_pieces, _) in zip(shard_sizes, pieces, strict=True):
            if size % num_pieces:
                raise ValueError(f"{size} output features cannot be split over {num_pieces} tensor-parallel ranks")
        super().__init__(in_features, [size // n for size, (n, _) in zip(shard_sizes, pieces)], bias, dtype)
        self.shard_pieces = pieces

    def checkpoint_slice(self, param_name: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        axis, _ = self.checkpoint_axes(param_name)
        num_pieces, index = self.shard_pieces[shard]
        if axis is None or num_pieces == 1:
            return tensor
        return _piece(tensor, axis, num_pieces, index, f"{param_name} (shard {shard})")


class RowParallelLinear(Linear):
    """Input features split over the tensor-parallel ranks; forward sums the partial products."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        state = get_parallel_state()
        if in_features % state.tp_size:
            raise ValueError(f"{in_features} input features cannot be split over {state.tp_size} tensor-parallel ranks")
        super().__init__(in_features // state.tp_size, shard_sizes, bias, dtype)
        self.parallel = state
        self.tp_size, self.tp_rank = state.tp_size, state.tp_rank

    def checkpoint_slice(self, param_name: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return tensor
        if param_name == "bias":  # added once: rank 0 holds it, the others add zeros
            return tensor if self.tp_rank == 0 else torch.zeros_like(tensor)
        _, axis = self.checkpoint_axes(param_name)
        return tensor if axis is None else _piece(tensor, axis, self.tp_size, self.tp_rank, param_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.parallel, super().forward(x))
