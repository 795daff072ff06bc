"""Model families, the dataset interface and training."""

from models import resnet_exits as _resnet_exits  # noqa: F401  (registers the family)
from models.registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]
