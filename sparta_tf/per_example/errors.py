"""The one error of the per-example engines: a model (or a layer of it) they refuse."""


class UnsupportedLayerError(ValueError):
    """The per-example engine cannot compute this layer's per-example gradients exactly.

    Raised when the model is wrapped or before its first DP step, never mid-training, with one
    line naming the layer, the reason and what to do. A layer the engine cannot see exactly is
    refused rather than trained with a gradient that is silently wrong: a variable missing from the
    per-example norms would get only noise, and a per-example re-run that sees other examples'
    data (a whole-batch mask) would make one example's clipped contribution depend on the others.
    """
