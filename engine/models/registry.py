"""The model architectures the engine runs, by the `architecture` name of a model config (the
policies' registry style): a model class registers with `@register_model("name", ...)`."""
from __future__ import annotations

from policies.registry import Registry

MODELS: Registry[type] = Registry("model architecture", field="architecture")
register_model = MODELS.register
