"""Triton kernels (forward + backward) that the fusion pass swaps in for matched regions.

Importing this package registers the ``autopar::*`` custom ops (``torch.ops.autopar``).
One import line per kernel module (``X as X`` marks a re-export); kernels run only when
:func:`available` is true.
"""

from autopar.kernels._triton import available as available
from autopar.kernels.add_layer_norm import AddLayerNormFunction as AddLayerNormFunction
from autopar.kernels.add_rms_norm import AddRMSNormFunction as AddRMSNormFunction
from autopar.kernels.bias_gelu import BiasGeluFunction as BiasGeluFunction
from autopar.kernels.linear_cross_entropy import (
    LinearCrossEntropyFunction as LinearCrossEntropyFunction,
)
from autopar.kernels.moe_permute import MoePermuteFunction as MoePermuteFunction
from autopar.kernels.moe_permute import MoeUnpermuteFunction as MoeUnpermuteFunction
from autopar.kernels.rope import RopeFunction as RopeFunction
from autopar.kernels.swiglu import SwiGLUFunction as SwiGLUFunction
