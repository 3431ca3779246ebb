"""The model room's errors, apart from the modules that raise them, so that a module that
only needs to raise one (LoRA wrapping, a tokenizer) does not import the HF policy."""

from __future__ import annotations

from erlay.supervisor.errors import ErlayError


class ModelLoadError(ErlayError, ValueError):
    """A model named by ``model.hf`` cannot be found or loaded; the message says which."""


class WeightsMismatch(ErlayError, ValueError):
    """A weight update does not fit the served model (missing, unexpected or reshaped tensors);
    nothing was loaded.  Re-exported by :mod:`erlay.actors.engine.api`, the protocol it belongs
    to; defined here so that :mod:`erlay.actors.model.refit` raises it without importing the
    engine room."""
