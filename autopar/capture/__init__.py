"""Capture: turn a single-device training forward into an ATen FX graph.

`capture(model, args, loss_fn=None) -> Captured`

The model is exported with `torch.export.export(strict=False)` and decomposed to core ATen,
except for the ops autopar plans as one unit (`scaled_dot_product_attention`,
`nll_loss_forward`). Every node keeps its FakeTensor in `meta["val"]` and its
`nn_module_stack`. Placeholders get a role: parameter, buffer (or lifted constant), user
input. Tied parameters (one tensor under two names, e.g. GPT's embedding and head) become a
single placeholder so that the search gives them one placement and autograd sums their
gradients.
"""

from autopar.capture.export import Captured, CaptureError, capture

__all__ = ["Captured", "CaptureError", "capture"]
