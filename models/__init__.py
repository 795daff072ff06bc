"""Model families, the dataset interface and training.

Importing the package loads no framework: the families (torch modules) register themselves the first time
the registry is used, so the server, which needs only `models.data`, never imports torch.
"""

from typing import Any

__all__ = ["create_model", "list_models", "register_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
