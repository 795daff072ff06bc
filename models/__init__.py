"""Model families, the dataset interface and training."""

from models import densenet as _densenet  # noqa: F401  (each import registers its family)
from models import mobilenet as _mobilenet  # noqa: F401
from models import resnet_exits as _resnet_exits  # noqa: F401
from models import vgg as _vgg  # noqa: F401
from models.registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]
